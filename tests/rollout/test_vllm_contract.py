"""The contract between ``VLLMRolloutEngine`` and vLLM, checked on the CPU against a fake
``vllm`` module put in ``sys.modules``: what the engine passes to ``vllm.LLM``, the
per-request ``SamplingParams`` it builds, how it reads vLLM's ``RequestOutput``s into
``Rollouts``, and how it pushes weights through ``collective_rpc``. The fake only mirrors the
parts of vLLM's API the engine uses, as this module spells them; these tests pin postrl's side
of that contract, not vLLM's API itself (tests/distributed/test_vllm.py runs the real engine
where there is a GPU and vLLM)."""

import os
import pickle
import sys
import tempfile
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from postrl.config import TrainConfig
from postrl.errors import ConfigError
from postrl.rollout import SamplingParams
from postrl.rollout.vllm import (
    VLLMOptions,
    VLLMRolloutEngine,
    cpu_threads,
    import_vllm,
    sample_seed,
    weight_buckets,
)
from postrl.train.distributed.weights import trainable_state


class FakeWorker:
    """vLLM's worker as the reload function sees it: ``reload_weights`` and a model whose
    tied head records when it is processed again."""

    def __init__(self, log: list) -> None:
        self.log = log
        head = SimpleNamespace(quant_method=SimpleNamespace(
            process_weights_after_loading=lambda layer: log.append(("process head",))))
        model = SimpleNamespace(lm_head=head, config=SimpleNamespace(tie_word_embeddings=True))
        # no ``model`` attribute on the runner: the engine must ask for ``get_model()``
        self.model_runner = SimpleNamespace(get_model=lambda: model)

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.log.append(("reload", list(weights_iterator)))


class FakeLLM:
    """Records its constructor's kwargs and every call; ``generate`` answers with the
    completions queued on ``replies``. A weight push is logged as the files it names, read
    while they exist."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.log: list = []
        self.replies: list = []
        self.worker = FakeWorker(self.log)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert len(prompts) == len(sampling_params) == len(self.replies)
        self.log.append(("generate", prompts, sampling_params))
        return [SimpleNamespace(outputs=[reply]) for reply in self.replies]

    def collective_rpc(self, method, args=(), kwargs=None):
        from safetensors.torch import load_file

        # vLLM sends a plain function to its worker processes (msgpack, or pickle by value
        # for a function): plain values only, which paths are
        method, args = pickle.loads(pickle.dumps((method, args)))
        (paths,) = args
        assert all(isinstance(path, str) for path in paths)
        self.log.append(("files", [list(load_file(path).items()) for path in paths]))
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.log.append(("reset",))
        return True


class FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` (and ``vllm.inputs``) module whose ``LLM`` lists each instance in ``.built``."""
    vllm = types.ModuleType("vllm")
    inputs = types.ModuleType("vllm.inputs")
    vllm.built = []

    def make_llm(**kwargs):
        vllm.built.append(FakeLLM(**kwargs))
        return vllm.built[-1]

    vllm.LLM = make_llm
    vllm.SamplingParams = FakeSamplingParams
    inputs.TokensPrompt = lambda **kwargs: dict(kwargs)
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.setenv(name, "")  # what an engine sets here is undone after the test
        monkeypatch.delenv(name)
    return vllm


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """``from_policy``'s scratch directories land under the test's own tmp_path."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path


def completion(tokens, text, logprobs, finish_reason, stop_reason=None):
    """One of vLLM's ``CompletionOutput``s: ``logprobs`` holds, per step, a dict from token
    to an object with ``.logprob``."""
    steps = [{t: SimpleNamespace(logprob=v) for t, v in step.items()} for step in logprobs]
    return SimpleNamespace(token_ids=tokens, text=text, logprobs=steps,
                           finish_reason=finish_reason, stop_reason=stop_reason)


def llm_kwargs(engine) -> dict:
    return {k: v for k, v in engine.llm.kwargs.items() if k != "model"}


def expected(dtype: str, share: float = 0.5, max_len: int | None = None,
             eager: bool = True, kv_gb: float | None = 2.0) -> dict:
    """``vllm.LLM``'s kwargs; the defaults are a CPU's (this machine's, unless a test says
    the GPU is there)."""
    kwargs = {"dtype": dtype, "enable_prefix_caching": True, "gpu_memory_utilization": share,
              "max_model_len": max_len, "enforce_eager": eager,
              "logprobs_mode": "processed_logprobs"}
    if kv_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
    return kwargs


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize(("precision", "sampler", "dtype"), [
    ("fp32", None, "float32"), ("bf16", None, "bfloat16"), ("bf16-master", None, "bfloat16"),
    ("bf16", "fp32", "float32"), ("fp32", "bf16", "bfloat16")])
def test_the_engine_takes_the_run_s_options_and_sampling_precision(
        fake_vllm, scratch, on_gpu, tiny, precision, sampler, dtype):
    model, tokenizer = tiny
    cfg = TrainConfig(model="tiny", rollout_backend="vllm", precision=precision,
                      sampler_precision=sampler, vllm_gpu_memory_utilization=0.3,
                      vllm_max_model_len=256, vllm_enforce_eager=True, vllm_kv_cache_gb=1.5)
    engine = VLLMRolloutEngine.from_config(model, tokenizer, cfg)
    assert llm_kwargs(engine) == expected(dtype, 0.3, 256, eager=True, kv_gb=1.5)
    assert engine.dtype == getattr(torch, dtype)
    model_dir = engine.llm.kwargs["model"]  # the policy's weights and tokenizer, saved
    assert model_dir.startswith(str(scratch)) and (scratch / model_dir / "config.json").exists()
    assert (scratch / model_dir / "tokenizer_config.json").exists()


def test_the_options_default_to_the_config_s_defaults(fake_vllm, on_gpu):
    assert VLLMOptions.from_config(TrainConfig()) == VLLMOptions()
    engine = VLLMRolloutEngine("model-dir", SimpleNamespace(pad_token_id=0))
    assert engine.llm.kwargs["model"] == "model-dir"
    assert llm_kwargs(engine) == expected("float32", eager=False, kv_gb=None)


def test_on_a_cpu_the_engine_runs_eagerly_with_its_own_kv_cache_and_every_core(
        fake_vllm, on_cpu):
    engine = VLLMRolloutEngine("model-dir", SimpleNamespace(pad_token_id=0))
    assert llm_kwargs(engine) == expected("float32")
    cpus = sorted(os.sched_getaffinity(0))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cpus))
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    engine = VLLMRolloutEngine("model-dir", SimpleNamespace(pad_token_id=0),
                               options=VLLMOptions(enforce_eager=False, kv_cache_gb=0.5))
    assert llm_kwargs(engine) == expected("float32", eager=False, kv_gb=0.5)


def test_the_user_s_thread_settings_are_kept():
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert cpu_threads([0, 1, 3], env) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert cpu_threads([3, 0, 1], {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1,3",
                                          "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_a_vllm_broken_by_torchvision_says_what_to_uninstall(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    with pytest.raises(ConfigError, match="pip uninstall -y torchvision torchaudio torchcodec"):
        import_vllm()
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed
    with pytest.raises(ConfigError, match=r"needs vLLM: pip install 'postrl\[vllm\]'"):
        import_vllm()


def test_the_trainer_builds_its_engine_from_its_config(fake_vllm, scratch, on_gpu, tiny):
    from postrl.train.trainer import Trainer

    model, tokenizer = tiny
    cfg = TrainConfig(model="tiny", rollout_backend="vllm", precision="bf16",
                      vllm_gpu_memory_utilization=0.25, vllm_max_model_len=128)
    trainer = SimpleNamespace(cfg=cfg, lm=model, tokenizer=tokenizer, engine=None)
    Trainer._start_engines(trainer)
    assert isinstance(trainer.engine, VLLMRolloutEngine)
    assert llm_kwargs(trainer.engine) == expected("bfloat16", 0.25, 128, eager=False,
                                                  kv_gb=None)


def test_a_rollout_actor_builds_its_engine_from_its_config(fake_vllm, scratch, on_gpu, tiny):
    pytest.importorskip("ray")
    from postrl.train.distributed.rollout import build_engine

    model, _ = tiny
    cfg = TrainConfig(model="tiny", rollout_backend="vllm", precision="bf16-master",
                      vllm_gpu_memory_utilization=0.4, vllm_enforce_eager=True)
    engine, load = build_engine(cfg, model.state_dict())
    assert load == engine.load_weights
    assert llm_kwargs(engine) == expected("bfloat16", 0.4, eager=True, kv_gb=None)


def test_each_sample_is_one_request_with_its_own_keyed_seed(fake_vllm):
    engine = VLLMRolloutEngine("model-dir", SimpleNamespace(pad_token_id=0))
    engine.llm.replies = [completion([1], "a", [{1: -0.1}], "length")] * 4
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12,
                            stop=("\n", "END"))
    engine.generate([[10, 11], [12]], 2, params, seed=5, first_prompt=3)
    (_, prompts, settings), = engine.llm.log
    assert prompts == [{"prompt_token_ids": [10, 11]}] * 2 + [{"prompt_token_ids": [12]}] * 2
    seeds = [sample_seed(5, prompt, sample) for prompt in (3, 4) for sample in (0, 1)]
    assert len(set(seeds)) == 4
    assert [s.kwargs for s in settings] == [
        {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 12,
         "stop": ["\n", "END"], "include_stop_str_in_output": True, "seed": seed,
         "logprobs": 0} for seed in seeds]

    engine.llm.replies = engine.llm.replies[:1]
    engine.generate([[10]], 1, SamplingParams(top_k=5), seed=0)
    kwargs = engine.llm.log[-1][2][0].kwargs
    assert kwargs["top_k"] == 5 and kwargs["stop"] is None


def test_vllm_s_outputs_become_padded_rollouts(fake_vllm):
    engine = VLLMRolloutEngine("model-dir", SimpleNamespace(pad_token_id=9))
    engine.llm.replies = [
        # the sampled token's entry is read, whatever else the step holds
        completion([5, 6, 7], "abc", [{4: -0.1, 5: -0.5}, {6: -1.0}, {7: -0.25}], "stop"),
        completion([8], "\n", [{8: -2.0}], "stop", stop_reason="\n"),
        completion([1, 2, 3, 4], "wxyz", [{1: -0.125}, {2: -0.375}, {3: -3.0}, {4: -0.875}],
                   "length"),
        completion([3, 3], "zz", [{3: -0.5}, {3: -0.75}], "abort"),
        completion([2], "y", [{2: -1.5}], "stop", stop_reason=2),  # a stop token id
        completion([], "", [], "stop"),
    ]
    out = engine.generate([[10, 11], [12]], 3, SamplingParams(), seed=0)
    assert out.group_size == 3 and out.prompt_ids == [[10, 11]] * 3 + [[12]] * 3
    assert out.response_ids.tolist() == [[5, 6, 7, 9], [8, 9, 9, 9], [1, 2, 3, 4],
                                         [3, 3, 9, 9], [2, 9, 9, 9], [9, 9, 9, 9]]
    assert out.lengths.tolist() == [3, 1, 4, 2, 1, 0]
    assert out.response_mask.tolist() == [[i < n for i in range(4)] for n in (3, 1, 4, 2, 1, 0)]
    assert out.logprobs.tolist() == [[-0.5, -1.0, -0.25, 0.0], [-2.0, 0.0, 0.0, 0.0],
                                     [-0.125, -0.375, -3.0, -0.875], [-0.5, -0.75, 0.0, 0.0],
                                     [-1.5, 0.0, 0.0, 0.0], [0.0] * 4]
    assert out.logprobs.dtype == torch.float32
    assert out.finish_reasons == ["eos", "stop", "length", "length", "eos", "eos"]
    assert out.texts == ["abc", "\n", "wxyz", "zz", "y", ""]


def pushed(llm) -> list[list[tuple[str, torch.Tensor]]]:
    """The buckets (files) ``load_weights`` sent in its one call, after checking that the
    worker reloaded exactly them, its tied head was processed again, and the prefix cache
    was reset once, last."""
    kinds = [entry[0] for entry in llm.log]
    assert kinds == ["files", "reload", "process head", "reset"]
    files, reloaded = llm.log[0][1], llm.log[1][1]
    assert [name for name, _ in reloaded] == [name for bucket in files for name, _ in bucket]
    return files


@pytest.mark.parametrize(("precision", "dtype"), [
    ("bf16", torch.bfloat16), ("bf16-master", torch.bfloat16), ("fp32", torch.float32)])
def test_weights_reach_the_workers_once_each_cast_and_in_bounded_buckets(
        fake_vllm, tiny, precision, dtype):
    model, _ = tiny
    weights = trainable_state(model)  # float32, as the trainer (and bf16-master's masters) has
    engine = VLLMRolloutEngine("model-dir", SimpleNamespace(pad_token_id=0), precision)
    bound = 40_000
    sizes = {name: w.numel() * dtype.itemsize for name, w in weights.items()}
    assert max(sizes.values()) > bound > min(sizes.values())  # an oversized tensor, and buckets
    engine.load_weights(weights, bucket_bytes=bound)
    buckets = pushed(engine.llm)
    sent = [name for bucket in buckets for name, _ in bucket]
    assert sorted(sent) == sorted(weights)  # every weight, exactly once
    assert len(weights) > len(buckets) > 1
    for bucket in buckets:
        assert len(bucket) == 1 or sum(sizes[name] for name, _ in bucket) <= bound
        for name, tensor in bucket:
            assert tensor.dtype == dtype
            assert torch.equal(tensor, weights[name].to(dtype))


def test_buckets_are_filled_greedily_in_order():
    weights = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([3, 3, 5, 1, 1, 2])]
    buckets = list(weight_buckets(weights, torch.float32, limit=6 * 4))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"],
                                                           ["w4", "w5"]]
    assert list(weight_buckets([], torch.float32, limit=1)) == []


def test_default_buckets_push_a_small_model_in_one_call(fake_vllm, tiny):
    model, _ = tiny
    engine = VLLMRolloutEngine("model-dir", SimpleNamespace(pad_token_id=0), "bf16")
    engine.load_weights(trainable_state(model))
    assert len(pushed(engine.llm)) == 1
    assert not list(Path(tempfile.gettempdir()).glob("postrl-vllm-weights-*"))
    assert not list(Path("/dev/shm").glob("postrl-vllm-weights-*"))  # the files are gone


def test_a_script_without_a_main_guard_is_told_so(fake_vllm, monkeypatch):
    spawned = types.ModuleType("__mp_main__")  # how a spawned process holds the script
    spawned.__file__ = "train_me.py"
    monkeypatch.setitem(sys.modules, "__main__", spawned)
    with pytest.raises(ConfigError, match=r"train_me.py starts training when it is imported.*"
                                          r"if __name__ == \"__main__\":"):
        VLLMRolloutEngine("model-dir", SimpleNamespace(pad_token_id=0))
    assert not fake_vllm.built
