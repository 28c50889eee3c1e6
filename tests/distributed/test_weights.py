"""Weights between replicas, without Ray: which device an actor's model lives on, and
optimizer moments into FSDP2 shards and back."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from postrl.config import load_config
from postrl.distributed.parallel import load_optimizer_state, shard
from postrl.distributed.weights import to_cpu, trainable_state, worker_device

BASE = ["model=tiny", "prompts_per_step=2", "group_size=4", "max_new_tokens=4", "launcher=ray"]


@pytest.mark.parametrize("gpus, cuda, device", [("0", True, "cpu"), ("0.5", True, "cuda"),
                                                ("1", False, "cpu")])
def test_an_actor_uses_its_gpu_only_when_it_reserved_one_and_sees_it(monkeypatch, gpus, cuda,
                                                                     device):
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    assert worker_device(load_config(None, [*BASE, f"worker_gpus={gpus}"])) == device


@pytest.fixture
def one_process_group():
    """A gloo group of one process (FSDP2 shards over it: one shard of everything)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp2_optimizer_state_goes_into_the_shards_and_comes_back_whole(one_process_group):
    """The driver's AdamW moments load into an optimizer over FSDP2 parameters (as DTensor
    shards), and read back whole they are the driver's again."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    driver = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    optimizer = torch.optim.AdamW(driver.parameters(), lr=1e-2)
    driver(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    replica = copy.deepcopy(driver)
    shard(replica, [replica[0], replica[2]])
    sharded = torch.optim.AdamW(replica.parameters(), lr=1e-2)
    load_optimizer_state(sharded, optimizer.state_dict())
    assert all(isinstance(s["exp_avg"], DTensor) for s in sharded.state.values())
    back = to_cpu(sharded.state_dict())["state"]
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(back[index][key], value), (index, key)
    assert torch.equal(trainable_state(replica)["0.weight"], driver[0].weight.detach())
