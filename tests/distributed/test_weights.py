"""Weights between replicas, without Ray: which device an actor's model lives on, optimizer
moments into FSDP2 shards and back, the buckets of a weight push, packing for the broadcast
and when it is used."""

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from postrl.config import TrainConfig
from postrl.errors import ConfigError
from postrl.train.distributed.broadcast import (
    WeightChannel,
    choose_backend,
    empty_buffers,
    gpu_uuid,
    layout,
    pack,
    unpack,
)
from postrl.train.distributed.parallel import load_optimizer_state, shard
from postrl.train.distributed.training import device_option
from postrl.train.distributed.weights import (
    buckets,
    device_label,
    to_cpu,
    trainable_state,
    worker_device,
)


def ray_config(worker_gpus: float) -> TrainConfig:
    """Built directly: validating launcher=ray would need Ray, which gpu_check.sh's GPU
    machine lacks."""
    return TrainConfig(model="tiny", launcher="ray", worker_gpus=worker_gpus)


@pytest.mark.parametrize("gpus, cuda, device", [("0", True, "cpu"), ("0", False, "cpu"),
                                                ("0.5", True, "cuda:0"), ("2", True, "cuda:0")])
def test_an_actor_uses_its_gpu_when_it_reserved_one(monkeypatch, gpus, cuda, device):
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)  # Ray: CUDA_VISIBLE_DEVICES
    assert worker_device(ray_config(float(gpus))) == torch.device(device)


@pytest.mark.parametrize("cuda_build, visible, why", [
    (None, "0", r"torch \S+ is built without CUDA"),
    ("12.8", "", "CUDA_VISIBLE_DEVICES=''"), ("12.8", None, "CUDA_VISIBLE_DEVICES is unset")])
def test_an_actor_that_reserved_a_gpu_torch_cannot_see_is_an_error(monkeypatch, cuda_build,
                                                                   visible, why):
    """Not a silent fallback to the CPU: one line naming the option, the actor and why."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("torch.version.cuda", cuda_build)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = ray_config(0.5)
    with pytest.raises(ConfigError, match=rf"^worker_gpus=0.5: train worker 2/2 reserved a GPU, "
                                          rf"but torch in that actor sees no CUDA GPU \({why}\); "
                                          r"check .*CUDA_VISIBLE_DEVICES.* or set worker_gpus=0$"):
        worker_device(cfg, "train worker 2/2")


def test_a_cuda_rank_binds_its_process_group_to_its_gpu():
    assert device_option(torch.device("cpu")) == {}
    assert device_option(torch.device("cuda", 0)) == {"device_id": torch.device("cuda", 0)}
    assert device_label(torch.device("cpu")) == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_is_reported_with_its_name():
    label = device_label(torch.device("cuda", 0))
    assert label == f"cuda:0 ({torch.cuda.get_device_name(0)})"


F32, BF16 = torch.float32, torch.bfloat16


def test_a_push_walks_buckets_in_order_none_over_the_limit_but_a_tensor_alone():
    slots = [("a", (10,), F32), ("b", (2, 3), F32), ("c", (100,), F32), ("d", (3,), BF16),
             ("e", (4, 5), F32), ("f", (1,), F32)]
    # bytes: 40, 24, 400 (over the limit: alone), 6, 80 (alone), 4
    parts = buckets(slots, 64)
    assert [[name for name, _, _ in part] for part in parts] == [
        ["a", "b"], ["c"], ["d"], ["e"], ["f"]]
    assert [slot for part in parts for slot in part] == slots
    assert buckets(slots, 10**6) == [slots]
    assert buckets([], 64) == []


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
    # a rank whose copy nobody reads joins the same gathers and keeps nothing
    dropped = to_cpu(sharded.state_dict(), keep=False)["state"]
    assert dropped.keys() == back.keys()
    assert all(value is None for state in dropped.values() for key, value in state.items()
               if key != "step")
    assert trainable_state(replica, keep=False) == {}


def test_packed_weights_unpack_under_their_names():
    weights = {"a": torch.randn(2, 3), "b": torch.arange(4), "c": torch.randn(5),
               "d": torch.randn(1, 1, dtype=torch.bfloat16)}
    buffers = pack(weights, "cpu")
    assert {dtype: len(b) for dtype, b in buffers.items()} == {
        torch.float32: 11, torch.int64: 4, torch.bfloat16: 1}
    slots = layout(weights)
    empty = empty_buffers(slots, "cpu")
    assert {d: (b.shape, b.dtype) for d, b in empty.items()} == {
        d: (b.shape, b.dtype) for d, b in buffers.items()}
    back = unpack(buffers, slots)
    assert list(back) == list(weights)
    assert all(torch.equal(back[name], value) for name, value in weights.items())


NAMES = ["train worker 1/2", "rollout worker 1/2", "rollout worker 2/2"]


@pytest.mark.parametrize("weight_sync, gpus, backend", [
    ("object_store", ["g0", "g1", "g2"], None),
    ("auto", ["g0", "g1", "g2"], "nccl"), ("broadcast", ["g0", "g1", "g2"], "nccl"),
    ("auto", [None, None, None], None), ("broadcast", [None, None, None], "gloo"),
    ("auto", ["g0", "g1", "g0"], None), ("broadcast", ["g0", None, "g1"], "gloo")])
def test_the_weights_are_broadcast_when_asked_or_when_every_member_has_its_own_gpu(
        weight_sync, gpus, backend):
    assert choose_backend(weight_sync, gpus, NAMES) == backend


def test_broadcast_on_a_shared_gpu_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match=r"^weight_sync=broadcast: train worker 1/2 and "
                                          r"rollout worker 2/2 share one GPU \(g0\), and NCCL"):
        choose_backend("broadcast", ["g0", "g1", "g0"], NAMES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_nccl_weight_channel_of_one_member_sends():
    """The standalone NCCL group builds on this torch and a broadcast runs (one member: a
    real broadcast needs two GPUs)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    channel = WeightChannel(f"127.0.0.1:{port}", 0, 1, "nccl", timedelta(seconds=60))
    weights = {"w": torch.randn(3, 2, device="cuda"), "b": torch.randn(2, device="cuda")}
    channel.send(weights)
    torch.cuda.synchronize()
    assert gpu_uuid("cuda") is not None and gpu_uuid("cpu") is None
