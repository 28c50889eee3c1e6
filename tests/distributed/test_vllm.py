"""The vllm rollout backend with real vLLM: on a CUDA GPU, or on the CPU with vLLM's CPU build
(``make test-vllm`` makes such an environment and runs these). Elsewhere only the lazy import
and its error are checked, and the rest skips saying why (tests/rollout/test_vllm_contract.py
checks the engine's side of its contract with vLLM against a fake ``vllm`` anywhere).

vLLM's CPU attention takes head sizes of 32 and up, and postrl's ``tiny`` has 16, so these
runs use ``tiny32``: the same 2-layer Llama over the SmolLM2 tokenizer with 2 heads of 32."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from postrl.config import load_config
from postrl.config_checks import vllm_for_cpus
from postrl.errors import ConfigError
from postrl.models import load_policy
from postrl.models.loading import tiny_config
from postrl.rollout import SamplingParams
from postrl.rollout.vllm import VLLMOptions, VLLMRolloutEngine, sample_seed
from postrl.train.distributed.rollout import cat_rollouts, prompt_slices
from postrl.train.distributed.weights import engine_weights, trainable_state
from postrl.train.trainer import Trainer

HAS_VLLM = importlib.util.find_spec("vllm") is not None
RUNS = HAS_VLLM and (torch.cuda.is_available() or vllm_for_cpus())
needs_vllm = pytest.mark.skipif(not RUNS, reason="needs vLLM with a CUDA GPU, or vLLM's CPU "
                                "build (make test-vllm)")
SMALL = VLLMOptions(gpu_memory_utilization=0.2, kv_cache_gb=0.25)  # two engines share a GPU
REWARDS = Path(__file__).parents[1] / "train" / "rewards_for_tests.py"
FIXED = "What is 12 + 30? Let me think. 12 + 30 = 42, so the answer is 42."


def test_sample_seeds_depend_on_the_prompt_index_only():
    seeds = {sample_seed(3, prompt, sample) for prompt in range(10) for sample in range(8)}
    assert len(seeds) == 80 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(3, 4, 1) == sample_seed(3, 4, 1) != sample_seed(4, 4, 1)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_without_vllm_the_engine_says_how_to_install_it(tiny):
    model, tokenizer = tiny
    with pytest.raises(ConfigError, match=r"rollout_backend=vllm needs vLLM: pip install"):
        VLLMRolloutEngine("unused", tokenizer)


@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU's attention kernels")
def test_a_head_size_the_cpu_kernels_lack_is_refused_by_name(tiny):
    model, tokenizer = tiny
    with pytest.raises(ConfigError, match="this model's is 16"):
        VLLMRolloutEngine.from_policy(model, tokenizer)


def tiny32(tokenizer, seed: int) -> LlamaForCausalLM:
    config = tiny_config(len(tokenizer), tokenizer.eos_token_id)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """``tiny32`` saved as a model directory, for ``model=<dir>``."""
    _, tokenizer = load_policy("tiny")
    path = tmp_path_factory.mktemp("tiny32")
    tiny32(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    model, tokenizer = load_policy(str(model_dir))
    engine = VLLMRolloutEngine.from_policy(model, tokenizer, options=SMALL)
    yield engine
    engine.close()


def token_logprobs(lm, ids: list[int]) -> torch.Tensor:
    """The trainer's log-probs (temperature 1) of ``ids[1:]``, by a plain forward."""
    with torch.no_grad():
        logits = lm(torch.tensor([ids])).logits[0, :-1].float()
    return F.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    return engine.score([ids[:1]], [ids[1:]])[0]


@needs_vllm
def test_rollouts_follow_the_protocol_and_do_not_depend_on_the_split(engine):
    prompts = [engine.tokenizer(f"{a} + {a} =").input_ids for a in range(5)]
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    whole = engine.generate(prompts, 3, params, seed=5)
    assert whole.response_ids.shape[0] == 15 and whole.group_size == 3
    assert torch.equal(whole.response_mask.sum(dim=1), whole.lengths)
    assert set(whole.finish_reasons) <= {"eos", "length", "stop"}
    assert (whole.logprobs[whole.response_mask] <= 0).all()
    parts = [engine.generate(prompts[a:b], 3, params, seed=5, first_prompt=a)
             for a, b in prompt_slices(5, 2)]
    assert cat_rollouts(parts, engine.pad_id).texts == whole.texts


@needs_vllm
def test_a_prompt_that_extends_an_earlier_one_is_prefilled_from_the_prefix_cache(engine):
    # an episode's next turn: the last context, the turn sampled and a reply after it
    prompt = engine.tokenizer(" ".join(f"{a} * {a} =" for a in range(90, 150))).input_ids
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    first = engine.generate([prompt], 1, params, seed=0)
    assert first.prefill_lengths[0] > len(prompt) // 2  # no earlier call read this prompt
    turn = prompt + first.response_ids[0, : int(first.lengths[0])].tolist() + prompt[:5]
    again = engine.generate([turn], 1, params, seed=1)
    assert 0 < again.prefill_lengths[0] < len(turn) - len(prompt) // 2


@needs_vllm
def test_the_sampled_log_probs_and_the_scores_are_the_trainer_s(engine, model_dir):
    model, tokenizer = load_policy(str(model_dir))
    ids = tokenizer(FIXED).input_ids
    assert torch.allclose(engine_logprobs(engine, ids), token_logprobs(model, ids), atol=1e-3)
    prompt = tokenizer("1 + 1 =").input_ids
    out = engine.generate([prompt], 4, SamplingParams(max_new_tokens=12), seed=1)
    for row in range(4):
        n = int(out.lengths[row])
        ours = token_logprobs(model, prompt + out.response_ids[row, :n].tolist())[-n:]
        assert torch.allclose(out.logprobs[row, :n], ours, atol=1e-3)


@needs_vllm
def test_load_weights_makes_the_engine_sample_and_score_the_new_policy(engine, model_dir):
    _, tokenizer = load_policy(str(model_dir))
    other = tiny32(tokenizer, seed=1)
    prompts = [tokenizer("1 + 1 =").input_ids]
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    before = engine.generate(prompts, 4, params, seed=9)
    engine.load_weights(trainable_state(other))
    after = engine.generate(prompts, 4, params, seed=9)
    ids = tokenizer(FIXED).input_ids
    assert torch.allclose(engine_logprobs(engine, ids), token_logprobs(other, ids), atol=1e-3)
    fresh = VLLMRolloutEngine.from_policy(other, tokenizer, options=SMALL)
    try:
        assert after.texts == fresh.generate(prompts, 4, params, seed=9).texts != before.texts
    finally:
        fresh.close()


def config(model_dir: Path, out: Path, *extra: str):
    return load_config(None, [f"model={model_dir}", "rollout_backend=vllm", "recipe=grpo",
                              "prompts_per_step=2", "group_size=4", "max_new_tokens=16",
                              "lr=1e-2", "quiet=true", "vllm_kv_cache_gb=0.25",
                              f"rewards=[{REWARDS}:length_parity]", f"out={out}", *extra])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_engine_follows(trainer: Trainer, steps: int, atol: float) -> None:
    """After each of ``steps`` updates the engine scores a fixed sequence as the weights the
    trainer samples with do (its bf16 working copy under bf16-master), to ``atol``, and
    far closer to them than to the weights before the update (so a skipped sync fails)."""
    ids = trainer.tokenizer(FIXED).input_ids
    sampled_by = trainer.master.working if trainer.master is not None else trainer.lm
    before = token_logprobs(sampled_by, ids)
    for _ in range(steps):
        trainer.train_step()
        ours, theirs = token_logprobs(sampled_by, ids), engine_logprobs(trainer.engine, ids)
        assert (theirs - ours).abs().max() < atol
        assert (theirs - ours).abs().mean() < 0.25 * (before - ours).abs().mean()
        before = ours


@needs_vllm
@pytest.mark.parametrize(("extra", "atol"), [
    (["epochs=2", "minibatches=2"], 1e-3),  # several updates per batch, fp32 sampler
    (["precision=bf16-master"], 0.1),  # a bf16 engine beside float32 masters
    (["lora.r=4", "lora.alpha=32", "lora.target_modules=[q_proj,v_proj]"], 1e-3),  # merged
], ids=["fp32-several-updates", "bf16-master", "lora"])
def test_the_engine_samples_the_weights_of_every_update(model_dir, tmp_path, extra, atol):
    trainer = Trainer(config(model_dir, tmp_path / "run", *extra))
    try:
        assert isinstance(trainer.engine, VLLMRolloutEngine)
        assert_engine_follows(trainer, steps=2, atol=atol)
    finally:
        trainer.close()


@needs_vllm
def test_a_resumed_run_s_engine_starts_from_the_checkpoint_and_follows(model_dir, tmp_path):
    out = tmp_path / "run"
    Trainer(config(model_dir, out, "steps=2", "save_every=1")).train()
    trainer = Trainer(config(model_dir, out, "steps=4", "save_every=1", "resume=auto"))
    try:
        assert trainer.step == 2
        ids = trainer.tokenizer(FIXED).input_ids
        assert torch.allclose(engine_logprobs(trainer.engine, ids),
                              token_logprobs(trainer.lm, ids), atol=1e-3)
        assert_engine_follows(trainer, steps=2, atol=1e-3)
    finally:
        trainer.close()


@needs_vllm
@pytest.mark.parametrize("overlap", ["false", "true"], ids=["in-order", "thread"])
def test_stale_batches_are_drawn_by_the_engine_with_the_scheduled_weights(model_dir, tmp_path,
                                                                          overlap):
    """max_staleness=2: batch t's sampled log-probs are those of the weights after update
    max(0, t - 2), pushed to the engine by the update (in order) or by the sampler thread,
    and not those of the weights it trains with."""
    from postrl.models.logprobs import response_logprobs
    from postrl.train.staleness import drawn_by

    trainer = Trainer(config(model_dir, tmp_path / "run", "steps=5",
                             "recipe_options.max_staleness=2", f"overlap_sampling={overlap}"))
    versions = [{k: v.clone() for k, v in trainer.lm.state_dict().items()}]
    batches = []
    prepare = trainer.phases.prepare

    def keep(batch):
        batches.append(batch)
        prepare(batch)

    trainer.phases.prepare = keep
    try:
        for _ in range(5):
            trainer.train_step()
            versions.append({k: v.clone() for k, v in trainer.lm.state_dict().items()})
        scorer, _ = load_policy(str(model_dir))
        for step, batch in enumerate(batches):
            sequences = batch.sequences(torch.arange(batch.rows), trainer.engine.pad_id)
            mask = batch.response_mask[:, :sequences.input_ids.shape[1] - sequences.prompt_width]
            sampled = batch.sampler_logp[:, :mask.shape[1]][mask]
            gaps = {}
            for version in {drawn_by(step, 2), step}:
                scorer.load_state_dict(versions[version])
                with torch.no_grad():
                    ours = response_logprobs(scorer, sequences, 1.0)[0][mask]
                gaps[version] = (ours - sampled).abs().mean().item()
            assert gaps[drawn_by(step, 2)] < 1e-3, (step, gaps)
            if step >= 1:  # the weights it trains with are not the ones that drew it
                assert gaps[step] > 10 * gaps[drawn_by(step, 2)], (step, gaps)
    finally:
        trainer.close()


@needs_vllm
def test_lora_reaches_the_engine_merged(model_dir):
    from postrl.models.policy import apply_lora, causal_lm

    model, _ = load_policy(str(model_dir))
    lm = causal_lm(apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.normal_()
    state = engine_weights(lm)
    assert not any("lora" in name or "base_layer" in name for name in state)
    layer = lm.model.layers[0].self_attn.q_proj
    delta = layer.get_delta_weight("default")
    assert delta.abs().max() > 0
    assert torch.allclose(state["model.layers.0.self_attn.q_proj.weight"],
                          layer.base_layer.weight + delta)


@needs_vllm
@pytest.mark.parametrize("extra", [
    ["recipe=ppo"],
    # the random model's turns end at its first space, so that episodes have several
    ["task=guess_number", "max_turns=3", "stop=[\" \"]", "max_new_tokens=32", "rewards=[]"],
], ids=["ppo", "multi-turn"])
def test_recipes_and_environments_train_with_the_engine(model_dir, tmp_path, extra):
    out = tmp_path / "run"
    Trainer(config(model_dir, out, "steps=2", *extra)).train()
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["mismatch/kl_k3"] >= 0 and row["rollout/tokens_generated"] > 0
        assert row["rollout/prefill_tokens"] > 0
    if "max_turns=3" in extra:
        assert max(r["episode/turns_mean"] for r in rows) > 1


@needs_vllm
def test_compare_runs_arms_with_the_engine(model_dir, tmp_path):
    from postrl.cli import main

    out = tmp_path / "cmp"
    main(["compare", "grpo", "dr_grpo", "--seeds", "1", "--out", str(out),
          f"model={model_dir}", "rollout_backend=vllm", "prompts_per_step=2", "group_size=4",
          "max_new_tokens=8", "steps=2", "quiet=true", "vllm_kv_cache_gb=0.25",
          f"rewards=[{REWARDS}:length_parity]"])
    runs = sorted(p.parent for p in out.rglob("metrics.jsonl"))
    assert len(runs) == 2
    assert all(len(metrics(run)) == 2 for run in runs)


@needs_vllm
def test_smollm2_trains_five_grpo_steps_with_the_engine(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct, 5 GRPO steps sampled by vLLM in fp32: ``mismatch/kl_k3`` on every
    step, and the engine's log-probs of a fixed sequence move with every update while they
    stay the trainer's."""
    out = tmp_path / "smollm2"
    trainer = Trainer(load_config(None, [
        "model=smollm2-135m-instruct", "rollout_backend=vllm", "recipe=grpo", "steps=5",
        "prompts_per_step=4", "group_size=4", "max_new_tokens=48", "lr=1e-5", "quiet=true",
        "vllm_kv_cache_gb=1", f"out={out}"]))
    ids = trainer.tokenizer(FIXED).input_ids
    scores = [engine_logprobs(trainer.engine, ids)]
    push = trainer.engine.load_weights

    def push_and_score(weights):
        push(weights)
        scores.append(engine_logprobs(trainer.engine, ids))
        assert (scores[-1] - token_logprobs(trainer.lm, ids)).abs().max() < 2e-3

    monkeypatch.setattr(trainer.engine, "load_weights", push_and_score)
    trainer.train()
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(0 <= r["mismatch/kl_k3"] < 1e-3 for r in rows)
    assert len(scores) == 6
    for before, after in zip(scores, scores[1:], strict=False):
        assert (after - before).abs().max() > 1e-4
