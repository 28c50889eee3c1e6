"""FSDP2 with one trainer worker (``train_parallel=fsdp2, train_workers=1``), over gloo on the
CPU, without Ray. With one replica, rows without a gradient run forward-only. When they ran
after the trained ones, the reduce-scatter was asked of a micro-batch without a backward: the
sharded gradients stayed None and AdamW silently skipped the step; asked of the last trained
micro-batch, the root's (embeddings, final norm) still stayed None."""

import copy
import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist

from postrl.train.distributed.parallel import FSDPReplica, decoder_layers, shard
from postrl.train.distributed.weights import full
from postrl.train.scorers import TokenScorer
from postrl.train.update import Trainable, UpdateSettings, run_updates
from tests.train.test_trainer import tiny_config
from tests.train.test_update import _mixed_batch, _zero_rows

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")


@pytest.fixture
def one_rank_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["kept", "checkpointed"])
def test_one_fsdp2_worker_steps_the_weights_as_one_process_does(tmp_path, one_rank_group,
                                                                checkpointed):
    """And with ``gradient_checkpointing`` on the sharded model (transformers' layers
    recompute inside FSDP2's hooks)."""
    from postrl.train.setup import checkpoint_layers
    from postrl.train.trainer import Trainer

    trainer = Trainer(tiny_config(tmp_path, "dr_grpo", "prompts_per_step=3",
                                  "max_new_tokens=16", "epochs=2"))
    batch = _mixed_batch(trainer)  # old log-probs, and a group with no gradient
    zero = _zero_rows(batch, trainer)
    assert zero.any() and not zero.all()  # so forward-only micro-batches follow the trained
    settings = UpdateSettings(epochs=1, minibatches=1, micro_batch_size=3, temperature=1.0,
                              max_grad_norm=None, pad_id=trainer.engine.pad_id,
                              share_prompts=False)
    plan = [torch.arange(batch.rows)]
    before = {n: p.detach().clone() for n, p in trainer.lm.named_parameters()}

    def step(lm, policy, replica=None):
        optimizer = torch.optim.AdamW(lm.parameters(), lr=1e-2)
        results = run_updates(Trainable(policy, optimizer), batch, trainer.recipe,
                              trainer.loss_cfg, dataclasses.replace(settings, replica=replica),
                              plan)
        return results, {n: full(p.detach()).clone() for n, p in lm.named_parameters()}

    plain_lm = copy.deepcopy(trainer.lm).train()
    _, expected = step(plain_lm, TokenScorer(plain_lm, share_prompts=False))
    sharded_lm = copy.deepcopy(trainer.lm).train()
    if checkpointed:
        checkpoint_layers(sharded_lm, "tiny")
    policy = shard(TokenScorer(sharded_lm, share_prompts=False), decoder_layers(sharded_lm.model))
    [result], got = step(sharded_lm, policy, FSDPReplica(0, 1, [policy], "cpu"))

    assert not result.skipped and result.grad_norm > 0
    moved = [n for n in before if not torch.equal(got[n], before[n])]
    assert len(moved) == len(before), "AdamW skipped parameters without a gradient"
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5)
