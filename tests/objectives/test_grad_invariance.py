"""Gradient accumulation over micro-batches equals the full-batch gradient (docs/algorithms.md §3).

Each micro-batch's loss is normalised by the GLOBAL ``BatchCounts`` of the whole optimizer step,
so summing the micro-batch gradients must give exactly the full-batch gradient, and merging the
micro-batch ``Diagnostics`` must give the full-batch diagnostics, whatever the split. Entropy-
guided hybrid mixing uses per-response statistics only, so it is split-invariant too (micro-
batches split by responses).
"""

from __future__ import annotations

from functools import reduce

import pytest
import torch
from torch import Tensor

from postrl.objectives import (
    AGGREGATIONS,
    RATIO_UNITS,
    BatchCounts,
    Diagnostics,
    PolicyLossConfig,
    PolicyLossInputs,
    policy_loss,
)
from postrl.objectives.policy_loss import NOT_PPO_CLIPPED

F64 = torch.float64
LENGTHS = [3, 1, 0, 7, 5, 2]  # a length-1 and a fully masked response
T_MAX = 7
SPLITS = {
    "size1": [1, 1, 1, 1, 1, 1],
    "size2": [2, 2, 2],
    "uneven": [1, 3, 2],
}


SEED = 8  # with this seed both clip sides are active for every unit, and dual-clip for token units


def make_batch(per_token_advantages: bool, seed: int = SEED) -> dict[str, Tensor]:
    """A global batch of six responses, float64, with unrelated values on masked positions."""
    g = torch.Generator().manual_seed(seed)
    n = len(LENGTHS)
    mask = (torch.arange(T_MAX).expand(n, T_MAX) < torch.tensor(LENGTHS).unsqueeze(1)).to(F64)
    logp = -3.0 * torch.rand(n, T_MAX, generator=g, dtype=F64)
    old_logp = logp + 0.3 * torch.randn(n, T_MAX, generator=g, dtype=F64)
    ref_logp = logp + 1.0 * torch.randn(n, T_MAX, generator=g, dtype=F64)
    entropy = 2.0 * torch.rand(n, T_MAX, generator=g, dtype=F64)
    shape = (n, T_MAX) if per_token_advantages else (n,)
    advantages = torch.randn(shape, generator=g, dtype=F64)
    return dict(
        logp=logp,
        old_logp=old_logp,
        ref_logp=ref_logp,
        entropy=entropy,
        advantages=advantages,
        mask=mask,
    )


def config(ratio: str, aggregation: str, extras: bool) -> PolicyLossConfig:
    """Tiny clip ranges for the sequence units (so sequence clipping triggers), small
    divergence bounds for DPPO (so both its masks do), DAPO's otherwise; ``extras`` turns on KL
    in the loss, the entropy bonus, dual-clip and entropy-guided mixing."""
    sequence = ratio in ("sequence", "sequence_token")
    delta = {"dppo_tv": 0.01, "dppo_kl": 0.001}.get(ratio)
    return PolicyLossConfig(
        ratio=ratio,
        clip_low=3e-4 if sequence else delta or 0.2,
        clip_high=4e-4 if sequence else delta or 0.28,
        hybrid_mixing="entropy" if extras else "averaged",
        dual_clip=1.5 if extras and ratio not in NOT_PPO_CLIPPED else None,
        aggregation=aggregation,
        norm_constant=float(T_MAX),
        kl_coef=0.1 if extras else 0.0,
        kl_estimator="k3",
        entropy_coef=0.01 if extras else 0.0,
    )


def run(
    batch: dict[str, Tensor],
    rows: slice,
    logp: Tensor,
    entropy: Tensor,
    cfg: PolicyLossConfig,
    counts: BatchCounts,
) -> Diagnostics:
    """Backward one (micro-)batch's loss into the shared leaves; return its diagnostics."""
    inputs = PolicyLossInputs(
        logp=logp[rows],
        old_logp=batch["old_logp"][rows],
        advantages=batch["advantages"][rows],
        response_mask=batch["mask"][rows],
        ref_logp=batch["ref_logp"][rows],
        entropy=entropy[rows],
    )
    out = policy_loss(inputs, cfg, counts)
    if out.loss.requires_grad:
        out.loss.backward()
    return out.diagnostics


def leaves(batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    return batch["logp"].clone().requires_grad_(), batch["entropy"].clone().requires_grad_()


def assert_same_metrics(got: dict[str, float], expected: dict[str, float]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


# GMPO needs one advantage per response; every other unit also takes per-token advantages.
UNIT_ADVANTAGES = [(ratio, "response") for ratio in RATIO_UNITS] + [
    (ratio, "token") for ratio in RATIO_UNITS if ratio != "geometric"
]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "kl+entropy+dual"])
@pytest.mark.parametrize(("ratio", "adv_shape"), UNIT_ADVANTAGES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_match_full_batch(
    aggregation: str, ratio: str, adv_shape: str, extras: bool, split: str
) -> None:
    batch = make_batch(per_token_advantages=adv_shape == "token")
    cfg = config(ratio, aggregation, extras)
    counts = BatchCounts.of(batch["mask"])

    full_logp, full_entropy = leaves(batch)
    full = run(batch, slice(None), full_logp, full_entropy, cfg, counts)

    micro_logp, micro_entropy = leaves(batch)
    diagnostics = []
    start = 0
    for size in SPLITS[split]:
        rows = slice(start, start + size)
        diagnostics.append(run(batch, rows, micro_logp, micro_entropy, cfg, counts))
        start += size
    assert start == len(LENGTHS)

    torch.testing.assert_close(micro_logp.grad, full_logp.grad, atol=1e-6, rtol=1e-6)
    if cfg.entropy_coef > 0:
        torch.testing.assert_close(micro_entropy.grad, full_entropy.grad, atol=1e-6, rtol=1e-6)
    merged = reduce(lambda a, b: a.merge(b), diagnostics)
    assert_same_metrics(merged.finish(), full.finish())


def test_counts_add_up_over_micro_batches() -> None:
    """``BatchCounts`` of the micro-batches sum to those of the full batch."""
    mask = make_batch(per_token_advantages=False)["mask"]
    parts = [BatchCounts.of(mask[i : i + 1]) for i in range(len(LENGTHS))]
    assert reduce(lambda a, b: a + b, parts) == BatchCounts.of(mask)
    assert BatchCounts.of(mask) == BatchCounts(tokens=sum(LENGTHS), responses=5)


@pytest.mark.parametrize(("ratio", "adv_shape"), UNIT_ADVANTAGES)
def test_batch_exercises_clipping(ratio: str, adv_shape: str) -> None:
    """Guard for ``SEED``: the batch above really hits the clipped branches it is meant to test."""
    batch = make_batch(per_token_advantages=adv_shape == "token")
    inputs = PolicyLossInputs(
        batch["logp"],
        batch["old_logp"],
        batch["advantages"],
        batch["mask"],
        batch["ref_logp"],
        batch["entropy"],
    )
    cfg = config(ratio, "token_mean", extras=True)
    metrics = policy_loss(inputs, cfg, BatchCounts.of(batch["mask"])).diagnostics.finish()
    expected = (["clip/high_frac"] if ratio == "cispo" else [] if ratio == "sapo"  # no clip
                else ["clip/low_frac", "clip/high_frac"])
    if ratio in ("token", "hybrid"):
        expected.append("clip/dual_frac")
    for key in expected:
        assert metrics[key] > 0, key
