"""The one policy loss: surrogate (§2) + KL in the loss (§4) + entropy bonus, aggregated (§3)
(sections of docs/algorithms.md; the mismatch weight is §9).

``policy_loss`` is called once per micro-batch with the counts of the whole optimizer step;
summing the returned losses' gradients over the micro-batches gives the full-batch gradient,
and merging the returned diagnostics gives the full-batch diagnostics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from postrl.objectives import mismatch, surrogates
from postrl.objectives.aggregation import Aggregation, BatchCounts, aggregate
from postrl.objectives.diagnostics import Diagnostics
from postrl.objectives.kl import Estimator, kl_penalty
from postrl.objectives.ratios import entropy_mixing_weight, sequence_log_ratio, token_log_ratio

RATIO_UNITS = ("token", "sequence", "sequence_token", "hybrid", "geometric", "cispo", "sapo",
               "dppo_tv", "dppo_kl")
NOT_PPO_CLIPPED = ("geometric", "cispo", "sapo", "dppo_tv", "dppo_kl")  # no dual-clip term


@dataclass(frozen=True)
class PolicyLossConfig:
    """The loss-side components of a recipe (``Recipe.policy_loss_config()`` builds one)."""

    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    seq_clip_low: float = 3e-4  # hybrid's sequence branch
    seq_clip_high: float = 4e-4
    hybrid_mixing: str = "averaged"  # or "entropy"
    dual_clip: float | None = None
    aggregation: Aggregation = "token_mean"
    norm_constant: float | None = None  # C of seq_mean_token_sum_norm
    kl_coef: float = 0.0  # beta of the KL term placed in the loss; 0 = no KL term
    kl_estimator: Estimator = "k3"
    entropy_coef: float = 0.0
    sapo_tau_pos: float = 1.0  # SAPO's gate temperatures (ratio="sapo")
    sapo_tau_neg: float = 1.05
    # the sampler-trainer mismatch correction (postrl.objectives.mismatch); "none": off
    mismatch_weight: str = "none"
    mismatch_mode: str = "truncate"
    mismatch_cap: float = 2.0
    mismatch_low: float = 0.5
    mismatch_high: float = 2.0
    mismatch_reject: float | None = None

    @property
    def corrects_mismatch(self) -> bool:
        return self.mismatch_weight != "none" or self.mismatch_reject is not None


@dataclass
class PolicyLossInputs:
    """One micro-batch, response-aligned ``[N, T]``; ``advantages`` may be ``[N]``."""

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    response_mask: Tensor
    ref_logp: Tensor | None = None
    entropy: Tensor | None = None  # per-token policy entropy (with grad for the bonus)
    sampler_logp: Tensor | None = None  # the sampler's log-probs of its tokens (behaviour)


@dataclass
class LossOutput:
    loss: Tensor
    diagnostics: Diagnostics


def surrogate(cfg: PolicyLossConfig, batch: PolicyLossInputs, adv: Tensor) -> surrogates.Surrogate:
    """Dispatch on the ratio unit (a component, never a recipe's name)."""
    args = (batch.logp, batch.old_logp, adv, batch.response_mask)
    if cfg.ratio in ("token", "sequence", "sequence_token"):
        fn = getattr(surrogates, cfg.ratio)
        return fn(*args, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    if cfg.ratio == "hybrid":
        if cfg.hybrid_mixing == "averaged":
            weight: float | Tensor = 0.5
        elif cfg.hybrid_mixing == "entropy":
            if batch.entropy is None:
                raise ValueError("hybrid_mixing='entropy' needs per-token entropy in the inputs")
            weight = entropy_mixing_weight(batch.entropy, batch.response_mask)
        else:
            raise ValueError(f"unknown hybrid_mixing {cfg.hybrid_mixing!r}")
        return surrogates.hybrid(
            *args, weight, cfg.clip_low, cfg.clip_high, cfg.seq_clip_low, cfg.seq_clip_high,
            cfg.dual_clip,
        )
    if cfg.dual_clip is not None:
        raise ValueError(f"dual_clip applies to PPO-clipped surrogates, not ratio={cfg.ratio!r}")
    if cfg.ratio == "geometric":
        return surrogates.geometric(*args, cfg.clip_low, cfg.clip_high)
    if cfg.ratio == "cispo":
        return surrogates.cispo(*args, cfg.clip_high)
    if cfg.ratio == "sapo":
        return surrogates.sapo(*args, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    if cfg.ratio in ("dppo_tv", "dppo_kl"):  # clip_low / clip_high are DPPO's deltas
        return surrogates.dppo(*args, cfg.clip_low, cfg.clip_high, cfg.ratio.removeprefix("dppo_"))
    raise ValueError(f"unknown ratio unit {cfg.ratio!r}; expected one of {', '.join(RATIO_UNITS)}")


def policy_loss(
    batch: PolicyLossInputs, cfg: PolicyLossConfig, counts: BatchCounts
) -> LossOutput:
    """Loss ``sum over terms of aggregate(l)`` with ``l = -psi + beta*k - entropy_coef*H``.

    ``counts`` are the GLOBAL counts of the optimizer step (see ``aggregation``).
    """
    mask = batch.response_mask
    adv = batch.advantages
    adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).detach().expand_as(batch.logp)
    adv = adv.masked_fill(~mask.bool(), 0.0)
    surr = surrogate(cfg, batch, adv)

    def agg(values: Tensor) -> Tensor:
        return aggregate(values, mask, cfg.aggregation, counts, cfg.norm_constant)

    token_loss = -surr.psi
    if batch.sampler_logp is not None:
        correction = mismatch.correct(batch.old_logp, batch.sampler_logp, mask,
                                      cfg.mismatch_weight, cfg.mismatch_mode, cfg.mismatch_cap,
                                      cfg.mismatch_low, cfg.mismatch_high, cfg.mismatch_reject)
        if cfg.corrects_mismatch:
            token_loss = token_loss * correction.weight.to(token_loss.dtype)
    elif cfg.corrects_mismatch:
        raise ValueError("the mismatch correction needs the sampler's log-probs in the inputs")
    loss = agg(token_loss)
    diag = Diagnostics()
    diag.add("loss/policy", loss)
    diag.add("loss/per_token", aggregate(token_loss.detach(), mask, "token_mean", counts))
    diag.add("loss/per_response",
             aggregate(token_loss.detach(), mask, "seq_mean_token_mean", counts))
    if batch.ref_logp is not None:
        kl = kl_penalty(batch.logp, batch.ref_logp, cfg.kl_estimator)
        diag.add("kl/mean", aggregate(kl.detach(), mask, "token_mean", counts))
        if cfg.kl_coef:
            kl_loss = agg(cfg.kl_coef * kl)
            diag.add("loss/kl", kl_loss)
            loss = loss + kl_loss
    elif cfg.kl_coef:
        raise ValueError("kl_coef > 0 with the KL in the loss needs reference log-probs")
    if batch.entropy is not None:
        entropy_mean = aggregate(batch.entropy.detach(), mask, "token_mean", counts)
        diag.add("entropy/mean", entropy_mean)
        if cfg.entropy_coef:
            bonus = agg(cfg.entropy_coef * batch.entropy)
            diag.add("loss/entropy_bonus", bonus)
            loss = loss - bonus
    elif cfg.entropy_coef:
        raise ValueError("entropy_coef > 0 needs per-token entropy in the inputs")
    diag.add("loss/total", loss)
    _ratio_diagnostics(diag, surr, batch, counts)
    if batch.sampler_logp is not None:
        _mismatch_diagnostics(diag, batch, cfg, correction)
    return LossOutput(loss=loss, diagnostics=diag)


def _mismatch_diagnostics(diag: Diagnostics, batch: PolicyLossInputs, cfg: PolicyLossConfig,
                          correction: mismatch.Correction) -> None:
    """The gap between sampler and trainer, and the weights that correct it: means over the
    rows that carry the sampler's log-probs. With the correction off, the weight statistics
    are those of the token weights it would apply."""
    valid = batch.response_mask.bool()

    def total(values: Tensor) -> Tensor:  # over valid tokens, without a host sync
        return torch.where(valid, values, 0).sum()

    tokens = valid.sum().double()
    responses = valid.any(dim=1).sum().double()
    k1, k3 = mismatch.mismatch_kl(batch.old_logp, batch.sampler_logp)
    diag.add_mean("mismatch/kl_k1", total(k1), tokens)
    diag.add_mean("mismatch/kl_k3", total(k3), tokens)
    diag.add_mean("mismatch/sampler_ppl", -total(batch.sampler_logp.double()), tokens, exp=True)
    diag.add_mean("mismatch/trainer_ppl", -total(batch.old_logp.double()), tokens, exp=True)
    if cfg.mismatch_weight == "none":
        log_w, _ = mismatch.log_weights(batch.old_logp, batch.sampler_logp, valid, "token")
        weights = raw = log_w.exp()
    else:
        weights, raw = correction.weight, correction.raw
    diag.add_mean("mismatch/weight_mean", total(weights), tokens)
    diag.low("mismatch/weight_min", weights.masked_fill(~valid, math.inf).amin())
    diag.high("mismatch/weight_max", weights.masked_fill(~valid, -math.inf).amax())
    diag.add_ess("mismatch/ess", total(raw), total(raw.square()), tokens)
    diag.add_mean("mismatch/truncated_frac", total(correction.truncated), tokens)
    diag.add_mean("mismatch/masked_frac", total(correction.masked), tokens)
    diag.add_mean("mismatch/rejected_frac", correction.rejected.sum().double(), responses)
    if cfg.mismatch_weight == "sequence_product":
        diag.add_mean("mismatch/bounded_frac", correction.bounded.sum().double(), responses)


def _ratio_diagnostics(
    diag: Diagnostics, surr: surrogates.Surrogate, batch: PolicyLossInputs, counts: BatchCounts
) -> None:
    """Clip fractions and ratio statistics, counted per token or per response (§2)."""
    valid = batch.response_mask.bool()
    has_tokens = valid.any(dim=1)
    lengths = valid.sum(dim=1).clamp(min=1).double()
    if surr.per_response:
        # one ratio per response: each response weighs 1/N, spread evenly over its tokens
        # (with one advantage per response a response is wholly clipped or not at all)
        weights = valid / lengths.unsqueeze(1) / max(counts.responses, 1)
    else:
        weights = valid / float(max(counts.tokens, 1))

    def share(values: Tensor) -> Tensor:
        return (values.double() * weights).sum()

    diag.add("clip/low_frac", share(surr.clipped_low))
    diag.add("clip/high_frac", share(surr.clipped_high))
    diag.add("clip/dual_frac", share(surr.dual_clipped))
    # GSPO's unit (Zheng et al. 2025, Fig. 3): tokens, whatever the ratio unit
    clipped = (surr.clipped_low | surr.clipped_high) & valid
    diag.add("clip/token_frac", clipped.double().sum() / float(max(counts.tokens, 1)))
    diag.add("ratio/mean", share(surr.ratio))
    ratio = surr.ratio.detach()
    diag.low("ratio/min", ratio.masked_fill(~valid, math.inf).amin())
    diag.high("ratio/max", ratio.masked_fill(~valid, -math.inf).amax())

    # Sequence-level spread, whatever the ratio unit: std over responses of s_i, and the mean
    # over responses of the std of each response's token log-ratios.
    responses = max(counts.responses, 1)
    log_r = token_log_ratio(batch.logp.detach(), batch.old_logp, batch.response_mask).double()
    seq_log = sequence_log_ratio(batch.logp.detach(), batch.old_logp, batch.response_mask)
    # shift by 1: no cancellation near s=1
    shifted = torch.where(has_tokens, seq_log.double().exp() - 1.0, 0.0)
    diag.add_std("ratio/seq_std", shifted.sum() / responses, shifted.square().sum() / responses)
    centred = (log_r - seq_log.double().unsqueeze(1)).masked_fill(~valid, 0.0)
    per_response_std = (centred.square().sum(dim=1) / lengths).sqrt()
    diag.add("ratio/token_logratio_std",
             torch.where(has_tokens, per_response_std, 0.0).sum() / responses)
