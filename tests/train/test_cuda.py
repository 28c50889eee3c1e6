"""``device=cuda``: the local trainer on one GPU. Skipped without CUDA (CI has none); run by
``bench/gpu_check.sh`` on a GPU machine. ``POSTRL_TEST_DEVICE=cpu`` runs them on the CPU, to
check the tests themselves."""

import copy
import dataclasses
import math
import os

import pytest
import torch

from postrl.train.scorers import TokenScorer
from postrl.train.trainer import Trainer
from postrl.train.update import Trainable, UpdateSettings, round_metrics, run_updates
from tests.train.test_trainer import tiny_config
from tests.train.test_update import _mixed_batch

DEVICE = os.environ.get("POSTRL_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU")


def on_cuda(module) -> bool:
    return all(p.device.type == DEVICE for p in module.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-master"])
@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_a_cuda_run_keeps_every_model_and_optimizer_state_on_the_gpu(tmp_path, recipe,
                                                                     precision):
    trainer = Trainer(tiny_config(tmp_path, recipe, f"device={DEVICE}", f"precision={precision}",
                                  "steps=2", "epochs=2"))
    before = {n: p.detach().clone() for n, p in trainer.lm.named_parameters()}
    metrics = trainer.train()
    assert trainer.device.type == DEVICE and on_cuda(trainer.lm)
    assert trainer.critic is None or on_cuda(trainer.critic)
    frozen = trainer.reference.frozen if trainer.reference is not None else None
    assert frozen is None or on_cuda(frozen)
    moments = [t for state in trainer.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim()]
    assert moments and all(t.device.type == DEVICE for t in moments)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.lm.named_parameters())
    assert metrics["memory/peak_gb"] > 0 and metrics["throughput/tokens_per_s"] > 0
    assert all(math.isfinite(metrics[k]) for k in ("loss/total", "grad/norm", "ratio/mean"))


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("bf16", 5e-2),
                                                  ("bf16-master", 5e-2)])
def test_old_log_probs_come_from_the_updates_device_and_precision(tmp_path, precision,
                                                                   tolerance):
    """The first update of a batch sees ratios of 1: the old log-probs were computed where
    and how the update computes (before, the driver scored under CPU autocast)."""
    trainer = Trainer(tiny_config(tmp_path, "grpo", f"device={DEVICE}", f"precision={precision}",
                                  "prompts_per_step=3", "max_new_tokens=16", "epochs=2"))
    batch = _mixed_batch(trainer)
    assert batch.old_logp is not None and batch.old_logp.device.type == "cpu"
    settings = UpdateSettings(epochs=1, minibatches=1, micro_batch_size=3, temperature=1.0,
                              max_grad_norm=1.0, pad_id=trainer.engine.pad_id,
                              precision=precision, device=str(trainer.device))
    models = Trainable(TokenScorer(trainer.scoring_lm), trainer.optimizer, master=trainer.master)
    [result] = run_updates(models, batch, trainer.recipe, trainer.loss_cfg, settings,
                           [torch.arange(batch.rows)])
    metrics = round_metrics(result)
    assert abs(metrics["ratio/min"] - 1) < tolerance and abs(metrics["ratio/max"] - 1) < tolerance


def test_a_cuda_update_makes_the_cpu_updates_step_on_the_same_batch(tmp_path):
    cpu = Trainer(tiny_config(tmp_path / "cpu", "dr_grpo", "device=cpu", "prompts_per_step=3",
                              "max_new_tokens=16", "epochs=2"))
    batch = _mixed_batch(cpu)
    settings = UpdateSettings(epochs=1, minibatches=1, micro_batch_size=3, temperature=1.0,
                              max_grad_norm=1.0, pad_id=cpu.engine.pad_id)
    steps = {}
    for device in ("cpu", DEVICE):
        lm = copy.deepcopy(cpu.lm).to(device).train()
        optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-3)
        [result] = run_updates(Trainable(TokenScorer(lm), optimizer), batch, cpu.recipe,
                               cpu.loss_cfg, dataclasses.replace(settings, device=device),
                               [torch.arange(batch.rows)])
        steps[device] = (round_metrics(result), {n: p.detach().cpu()
                                                 for n, p in lm.named_parameters()})
    (cpu_metrics, cpu_weights), (gpu_metrics, gpu_weights) = steps["cpu"], steps[DEVICE]
    for key in ("loss/total", "loss/per_token", "grad/norm", "entropy/mean"):
        assert gpu_metrics[key] == pytest.approx(cpu_metrics[key], rel=1e-3, abs=1e-5), key
    for name, value in cpu_weights.items():
        torch.testing.assert_close(gpu_weights[name], value, atol=1e-5, rtol=1e-4, msg=name)
