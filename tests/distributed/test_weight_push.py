"""The trainer and rollout workers without Ray: two ``TrainWorker`` FSDP2 ranks (a real gloo
group) and one ``RolloutWorker``, each in a process of its own where ``import ray`` fails.
After an optimizer step on the shards, rank 0 pushes the weights bucket by bucket, over the
object store's path (CPU copies) and a gloo weight channel to the rollout worker; both get
the trained weights, and no rank ever holds more than one bucket of gathered weights."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import torch

from postrl.config import TrainConfig
from postrl.models.policy import causal_lm
from postrl.train.distributed.weights import buckets, trainable_layout, trainable_state
from postrl.train.setup import load_trained_policy, make_optimizers

LIMIT = 40_000  # bytes: the tiny model's layers go in several buckets, its embedding alone
CONFIG = {"model": "tiny", "launcher": "ray", "train_workers": 2, "train_parallel": "fsdp2",
          "lr": 1e-2, "weight_decay": 0.1, "prompts_per_step": 2, "group_size": 2,
          "max_new_tokens": 4}

# Each process: Ray made unimportable before postrl is imported. A wrapper around `full`
# (the gather of one FSDP2 parameter) records, at every gather, the bytes of gathered
# tensors still alive, the new one included.
CHILD = r"""
import json, sys, weakref
sys.modules["ray"] = None
import torch
import postrl.train.distributed.weights as weights
from postrl.config import TrainConfig
from postrl.train.distributed.rollout import RolloutWorker
from postrl.train.distributed.training import TrainWorker
from postrl.rollout import SamplingParams

role, rank, trainers, channel, limit, state_path, out = sys.argv[1:8]
rank, limit = int(rank), int(limit)
cfg = TrainConfig(**json.loads(sys.argv[8]))
state = torch.load(state_path, weights_only=False)
alive, peaks = [], []
real_full = weights.full

def full(tensor):
    whole = real_full(tensor)
    alive.append((weakref.ref(whole), whole.numel() * whole.element_size()))
    live = sum(size for ref, size in alive if ref() is not None)
    peaks.append([live, whole.numel() * whole.element_size()])
    return whole

weights.full = full
report = {}
if role == "train":
    worker = TrainWorker(cfg, rank, 2, 1, bucket_bytes=limit)
    worker.join(trainers, state)
    for param in worker.lm.parameters():  # one AdamW step on the shards
        param.grad = torch.ones_like(param)
    worker.models.optimizer.step()
    if rank == 0:
        worker.open_channel(channel, 2, "gloo")
        report["buckets"] = [[name for name, _, _ in part] for part in worker.weight_layout()]
    alive.clear(), peaks.clear()
    pushed = worker.weights()
    report["peaks"] = peaks
    report["device"] = worker.device_name()
    if rank == 0:
        torch.save(pushed, out + ".pt")
    else:
        report["pushed"] = pushed
else:
    worker = RolloutWorker(cfg, state["policy"], 1, "rollout worker 1/1")
    worker.open_channel(channel, 1, 2, "gloo", state["buckets"])
    worker.receive_weights()
    model = worker.engine.model
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out + ".pt")
    made = worker.generate([[1, 2, 3]], 2, SamplingParams(temperature=1.0, max_new_tokens=4),
                           seed=0, first_prompt=0)
    report["rows"] = int(made.response_ids.shape[0])
    report["device"] = worker.device_name()
report["ray"] = repr(sys.modules["ray"])
with open(out + ".json", "w") as f:
    json.dump(report, f)
"""


def free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_fsdp2_ranks_push_the_trained_weights_bucket_by_bucket_without_ray(tmp_path: Path):
    cfg = TrainConfig(**CONFIG)
    policy, _ = load_trained_policy(cfg)
    lm = causal_lm(policy)
    optimizer, _ = make_optimizers(cfg, policy, None)
    plan = buckets(trainable_layout(lm), LIMIT)
    state = {"policy": lm.state_dict(), "critic": None, "optimizer": optimizer.state_dict(),
             "critic_optimizer": None, "buckets": plan}
    torch.save(state, tmp_path / "state.pt")
    before = trainable_state(lm)
    for param in lm.parameters():  # the driver's copy takes the same step, whole
        param.grad = torch.ones_like(param)
    optimizer.step()
    trained = trainable_state(lm)
    assert len(plan) > 4 and any(len(part) > 1 for part in plan)

    trainers, channel = free_address(), free_address()
    roles = [("train", 0), ("train", 1), ("rollout", 0)]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, role, str(rank), trainers, channel,
                               str(LIMIT), str(tmp_path / "state.pt"),
                               str(tmp_path / f"{role}{rank}"), json.dumps(CONFIG)],
                              stdout=(tmp_path / f"{role}{rank}.log").open("w"),
                              stderr=subprocess.STDOUT)
             for role, rank in roles]
    for proc, (role, rank) in zip(procs, roles, strict=True):
        proc.wait(timeout=300)
        assert proc.returncode == 0, (tmp_path / f"{role}{rank}.log").read_text()[-3000:]
    reports = {f"{role}{rank}": json.loads((tmp_path / f"{role}{rank}.json").read_text())
               for role, rank in roles}
    assert all(r["ray"] == "None" and r["device"] == "cpu" for r in reports.values())
    # rank 0 cut the weights as the driver's plan does; the others returned nothing
    assert reports["train0"]["buckets"] == [[name for name, _, _ in part] for part in plan]
    assert reports["train1"]["pushed"] is None
    for pushed in (torch.load(tmp_path / "train0.pt"), torch.load(tmp_path / "rollout0.pt")):
        assert list(pushed) == list(trained)
        for name, value in trained.items():
            torch.testing.assert_close(pushed[name], value, rtol=0, atol=1e-6, msg=name)
            assert not torch.equal(value, before[name])  # the step changed it
    # every parameter was gathered once, on both ranks; at each gather the gathered tensors
    # still alive were one bucket's at most (or one larger tensor, alone in its bucket)
    for rank in ("train0", "train1"):
        peaks = reports[rank]["peaks"]
        assert len(peaks) == len(trained)
        assert all(live <= max(LIMIT, new) for live, new in peaks), peaks
    assert reports["rollout0"]["rows"] == 2
