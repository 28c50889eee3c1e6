"""The Ray actors' bodies on one GPU, without Ray: a ``TrainWorker`` (one rank, NCCL, DDP or
FSDP2) trains a real batch as one process does, and a ``RolloutWorker`` samples on the GPU
and loads the new weights. Skipped without CUDA; run by ``bench/gpu_check.sh``.
``POSTRL_TEST_DEVICE=cpu`` runs them over gloo on the CPU, to check the tests themselves."""

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from postrl.config import TrainConfig
from postrl.rollout import SamplingParams
from postrl.train.distributed.rollout import RolloutWorker
from postrl.train.distributed.training import TrainWorker
from postrl.train.scorers import TokenScorer
from postrl.train.update import Trainable, UpdateSettings, run_updates
from tests.train.test_trainer import tiny_config
from tests.train.test_update import _mixed_batch

DEVICE = os.environ.get("POSTRL_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU")


@pytest.fixture
def trainer(tmp_path):
    from postrl.train.trainer import Trainer

    return Trainer(tiny_config(tmp_path, "dr_grpo", "device=cpu", "prompts_per_step=3",
                               "max_new_tokens=16", "epochs=2"))


def worker_config(trainer, mode: str) -> TrainConfig:
    # built directly: load_config would ask for Ray, which the GPU machine lacks
    return dataclasses.replace(trainer.cfg, launcher="ray", train_parallel=mode,
                               worker_gpus=1.0 if DEVICE == "cuda" else 0.0)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_train_worker_on_the_gpu_makes_one_process_step(trainer, mode):
    batch = _mixed_batch(trainer)
    settings = UpdateSettings(epochs=1, minibatches=1, micro_batch_size=3, temperature=1.0,
                              max_grad_norm=1.0, pad_id=trainer.engine.pad_id)
    plan = [torch.arange(batch.rows)]
    lm = copy.deepcopy(trainer.lm).train()
    optimizer = torch.optim.AdamW(lm.parameters(), lr=trainer.cfg.lr)
    run_updates(Trainable(TokenScorer(lm), optimizer), batch, trainer.recipe, trainer.loss_cfg,
                settings, plan)
    expected = {n: p.detach() for n, p in lm.named_parameters()}

    worker = TrainWorker(worker_config(trainer, mode), 0, 1, 1)
    try:
        worker.join(worker.address(), {"policy": trainer.lm.state_dict(), "critic": None,
                                        "optimizer": trainer.optimizer.state_dict(),
                                        "critic_optimizer": None})
        assert worker.device.type == DEVICE
        assert dist.get_backend() == ("nccl" if DEVICE == "cuda" else "gloo")
        [result] = worker.update(batch, settings, plan, trainer.cfg.lr)
        got = worker.weights()
    finally:
        dist.destroy_process_group()
    assert not result.skipped and result.grad_norm > 0
    # AdamW moves every weight by about lr (1e-3) and magnifies the roundoff of near-zero
    # gradients, which FSDP2's unshared prompts arrange differently
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-4, rtol=1e-3,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_rollout_worker_samples_on_the_gpu_and_loads_new_weights(trainer):
    worker = RolloutWorker(worker_config(trainer, "ddp"), trainer.lm.state_dict(), 1)
    assert str(worker.device_name()).startswith(DEVICE)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = [[1, 2, 3, 4], [5, 6]]
    first = worker.generate(prompts, 2, params, 3, 0)
    assert first.response_ids.shape[0] == 4 and first.response_ids.device.type == "cpu"
    assert torch.isfinite(first.logprobs).all()
    state = {n: p.detach() * 0.5 for n, p in trainer.lm.named_parameters() if p.requires_grad}
    worker.load_weights(state)
    second = worker.generate(prompts, 2, params, 3, 0)
    assert not torch.equal(first.logprobs, second.logprobs)  # the new weights sample
