"""Weights between replicas, without Ray: which device an actor's model lives on."""

import pytest

from postrl.config import load_config
from postrl.distributed.weights import worker_device

BASE = ["model=tiny", "prompts_per_step=2", "group_size=4", "max_new_tokens=4", "launcher=ray"]


@pytest.mark.parametrize("gpus, cuda, device", [("0", True, "cpu"), ("0.5", True, "cuda"),
                                                ("1", False, "cpu")])
def test_an_actor_uses_its_gpu_only_when_it_reserved_one_and_sees_it(monkeypatch, gpus, cuda,
                                                                     device):
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    assert worker_device(load_config(None, [*BASE, f"worker_gpus={gpus}"])) == device
