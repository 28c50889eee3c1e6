"""A deliberately naive re-derivation of ``postrl.objectives`` from docs/algorithms.md.

Everything here is written as plain Python loops over responses ``i`` and tokens ``t``, one
scalar at a time, so that each line can be checked against a formula of the specification.
Quantities that need a gradient are built from 0-d torch tensors (so autograd works); the rest
are Python floats. Nothing here imports ``postrl``: it is an independent oracle for the
vectorised code, compared to it by ``test_reference.py``.

Inputs are ``[N]`` or ``[N, T]`` tensors with a 0/1 ``response_mask``; masked positions may hold
arbitrary values and must never influence a result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

K3_CLAMP = 10.0  # verl's low-variance KL clamps k3 to [-10, 10] (docs/algorithms.md §4)
WHITEN_EPS = 1e-8

# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def valid_positions(response_mask: Tensor, i: int) -> list[int]:
    """Token positions ``t`` with ``m[i, t] = 1``, in order."""
    return [t for t in range(response_mask.shape[1]) if response_mask[i, t] > 0]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: list[float], bessel: bool) -> float:
    m = _mean(xs)
    denominator = len(xs) - 1 if bessel else len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / denominator)


def _groups(n: int, group_size: int) -> list[list[int]]:
    """Contiguous groups of response indices: all samples of one prompt are adjacent."""
    assert n % group_size == 0
    return [list(range(start, start + group_size)) for start in range(0, n, group_size)]


def _zeros(n: int, t: int) -> list[list[float]]:
    return [[0.0] * t for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# §1 Advantages (no gradient: Python floats)
# ---------------------------------------------------------------------------------------------


def group_advantages(
    rewards: list[float], group_size: int, scale: str, std: str, eps: float
) -> list[float]:
    """GRPO (Shao et al. 2024 §4.1.2): ``A_i = (R_i - mean_g R) / (std + eps)``.

    ``scale``: the group's std, the whole batch's std, or none (Dr. GRPO, Liu et al. 2025 §3.1).
    A zero-variance group gives exactly 0 for every member.
    """
    bessel = std == "bessel"
    batch_std = _std(rewards, bessel) if scale == "batch" else None
    out = [0.0] * len(rewards)
    for members in _groups(len(rewards), group_size):
        values = [rewards[i] for i in members]
        if all(v == values[0] for v in values):
            continue  # zero-variance group: exactly 0
        mean = _mean(values)
        for i in members:
            if scale == "group":
                out[i] = (rewards[i] - mean) / (_std(values, bessel) + eps)
            elif scale == "batch":
                out[i] = (rewards[i] - mean) / (batch_std + eps)
            else:
                out[i] = rewards[i] - mean
    return out


def rloo_advantages(rewards: list[float], group_size: int) -> list[float]:
    """RLOO (Ahmadian et al. 2024): ``A_i = R_i - mean_{j != i} R_j`` within the group."""
    out = [0.0] * len(rewards)
    for members in _groups(len(rewards), group_size):
        for i in members:
            others = [rewards[j] for j in members if j != i]
            out[i] = rewards[i] - _mean(others)
    return out


def whiten(values: list[list[float]], response_mask: Tensor) -> list[list[float]]:
    """``(x - mean) / sqrt(var + 1e-8)`` over the valid tokens of the batch, Bessel variance.

    A single valid token has no spread (its deviation from the mean is 0): it whitens to 0.
    """
    n, t_max = response_mask.shape
    xs = [values[i][t] for i in range(n) for t in valid_positions(response_mask, i)]
    mean = _mean(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
    out = _zeros(n, t_max)
    for i in range(n):
        for t in valid_positions(response_mask, i):
            out[i][t] = (values[i][t] - mean) / math.sqrt(var + WHITEN_EPS)
    return out


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
) -> tuple[list[list[float]], list[list[float]]]:
    """GAE (Schulman et al. 2015 eq. 16): ``delta_t = rho_t + gamma V_{t+1} - V_t``,
    ``A_t = sum_l (gamma lam)^l delta_{t+l}``, ``V = 0`` past the last valid token.

    Returns ``(advantages, returns)``; ``returns = A + V`` is taken before whitening.
    """
    n, t_max = response_mask.shape
    adv = _zeros(n, t_max)
    returns = _zeros(n, t_max)
    for i in range(n):
        positions = valid_positions(response_mask, i)
        for k, t in enumerate(positions):
            # The explicit sum over the future, no recursion.
            total = 0.0
            for ell, u in enumerate(positions[k:]):
                later = positions[k + ell + 1 :]
                v_next = float(values[i, later[0]]) if later else 0.0  # V = 0 past the end
                delta = float(token_rewards[i, u]) + gamma * v_next - float(values[i, u])
                total += (gamma * lam) ** ell * delta
            adv[i][t] = total
            returns[i][t] = total + float(values[i, t])
    if whiten_advantages:
        adv = whiten(adv, response_mask)
    return adv, returns


def return_to_go(
    token_rewards: list[list[float]], response_mask: Tensor, gamma: float
) -> list[list[float]]:
    """``G_t = sum_{u >= t} gamma^(u - t) rho_u`` over the valid tokens of each response."""
    n, t_max = response_mask.shape
    out = _zeros(n, t_max)
    for i in range(n):
        positions = valid_positions(response_mask, i)
        for k, t in enumerate(positions):
            out[i][t] = sum(gamma**ell * token_rewards[i][u] for ell, u in enumerate(positions[k:]))
    return out


def reinforce_pp_advantages(
    token_rewards: Tensor, response_mask: Tensor, gamma: float, whiten_advantages: bool
) -> list[list[float]]:
    """REINFORCE++ (Hu 2025 §3): return-to-go of the token rewards, whitened over the batch."""
    rewards = [[float(x) for x in row] for row in token_rewards]
    adv = return_to_go(rewards, response_mask, gamma)
    return whiten(adv, response_mask) if whiten_advantages else adv


def reinforce_pp_baseline_advantages(
    rewards: list[float],
    group_size: int,
    response_mask: Tensor,
    token_penalty: Tensor | None,
    gamma: float,
    whiten_advantages: bool,
) -> list[list[float]]:
    """REINFORCE++-baseline (Hu 2025 §3.3): ``R_i - mean_g R`` on the last valid token, minus
    the optional per-token penalty, then REINFORCE++."""
    n, t_max = response_mask.shape
    centred = list(rewards)
    for members in _groups(n, group_size):
        mean = _mean([rewards[i] for i in members])
        for i in members:
            centred[i] = rewards[i] - mean
    token_rewards = _zeros(n, t_max)
    for i in range(n):
        positions = valid_positions(response_mask, i)
        if positions:
            token_rewards[i][positions[-1]] = centred[i]
        if token_penalty is not None:
            for t in positions:
                token_rewards[i][t] -= float(token_penalty[i, t])
    adv = return_to_go(token_rewards, response_mask, gamma)
    return whiten(adv, response_mask) if whiten_advantages else adv


# ---------------------------------------------------------------------------------------------
# §2–§4 The policy loss (autograd through 0-d tensors)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossConfig:
    """Mirror of the loss options, spelled out independently of ``PolicyLossConfig``.

    ``clip_low`` / ``clip_high`` is the trust region of the chosen ratio unit (GSPO's recipe sets
    3e-4 / 4e-4 here); ``seq_clip_*`` is only the sequence branch of the ``hybrid`` ratio.
    ``dual_clip`` applies to the PPO-clipped units (token, sequence, sequence_token, hybrid);
    GMPO and CISPO have no such term.
    """

    ratio: str = "token"
    clip_low: float = 0.2
    clip_high: float = 0.2
    seq_clip_low: float = 3e-4
    seq_clip_high: float = 4e-4
    hybrid_mixing: str = "averaged"
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    norm_constant: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05


@dataclass
class NaiveLoss:
    """The scalar loss and the statistics a reader can check by hand.

    Clip fractions count tokens, or responses for ``sequence`` / ``sequence_token``; they are
    ``None`` where docs/algorithms.md §2 leaves them undefined (a per-response ratio with
    advantages that vary within a response). ``ratio_mean`` is the mean of the ratio the
    surrogate uses, over responses for ``sequence`` / ``sequence_token`` and over tokens
    otherwise (the mixed ratio for ``hybrid``, the token ratio for ``geometric`` and ``cispo``).
    """

    loss: Tensor
    per_token: float
    per_response: float
    clip_low_frac: float | None
    clip_high_frac: float | None
    dual_frac: float | None
    clip_token_frac: float  # tokens whose low or high bound acted, for every ratio unit
    ratio_mean: float
    kl_mean: float | None
    entropy_mean: float | None


@dataclass
class ResponseTerms:
    """The surrogate of one response: ``psi`` per valid token and where clipping was active."""

    psi: dict[int, Tensor] = field(default_factory=dict)
    ratio: dict[int, float] = field(default_factory=dict)
    low: dict[int, bool] = field(default_factory=dict)
    high: dict[int, bool] = field(default_factory=dict)
    dual: dict[int, bool] = field(default_factory=dict)


def clip(z: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """``clip(z, 1 - eps_low, 1 + eps_high)`` (docs/algorithms.md notation)."""
    return torch.clamp(z, 1.0 - eps_low, 1.0 + eps_high)


def ppo_term(
    z: Tensor, z_clipped: Tensor, a: float, dual_clip: float | None
) -> tuple[Tensor, bool]:
    """PPO (Schulman et al. 2017 eq. 7): ``min(z A, z_clipped A)``; dual-clip (Ye et al. 2019):
    ``max(psi, c A)`` when ``A < 0``. Returns the term and whether the dual clip was active."""
    unclipped = z * a
    clipped = z_clipped * a
    psi = unclipped if unclipped.item() <= clipped.item() else clipped
    if dual_clip is not None and a < 0 and psi.item() < dual_clip * a:
        return torch.tensor(dual_clip * a, dtype=z.dtype), True
    return psi, False


def kl_estimate(logp: Tensor, ref: float, estimator: str) -> Tensor:
    """Schulman's estimators on ``log_ratio = ref - logp``; k3 clamped to [-10, 10] (GRPO eq. 4)."""
    log_ratio = ref - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -K3_CLAMP, K3_CLAMP)


def entropy_weights(entropy: Tensor, positions: list[int], i: int) -> dict[int, float]:
    """DHPO entropy-guided mixing (postrl's reconstruction of Min et al. 2026): the token
    entropy min–max normalised over the valid tokens of response ``i``; 1/2 if all equal."""
    hs = {t: entropy[i, t].item() for t in positions}
    lo, hi = min(hs.values()), max(hs.values())
    if hi == lo:
        return {t: 0.5 for t in positions}
    return {t: (h - lo) / (hi - lo) for t, h in hs.items()}


def response_terms(
    cfg: LossConfig,
    i: int,
    positions: list[int],
    logp: Tensor,
    old_logp: Tensor,
    adv: Callable[[int], float],
    entropy: Tensor | None,
) -> ResponseTerms:
    """docs/algorithms.md §2 for the valid tokens ``positions`` of response ``i``."""
    out = ResponseTerms()
    log_ratio = {t: logp[i, t] - old_logp[i, t].item() for t in positions}
    ratio = {t: torch.exp(log_ratio[t]) for t in positions}
    # GSPO sequence ratio (Zheng et al. 2025 eq. 7): the geometric mean of the token ratios.
    s = torch.exp(sum(log_ratio.values()) / len(positions))

    if cfg.ratio == "geometric":
        # GMPO (Zhao et al. 2025 eq. 4): token log-ratios clipped in log space, pessimistically
        # (min for A > 0, max for A < 0); psi_i = A_i exp(mean of the clipped log-ratios).
        a = adv(positions[0])
        chosen_sum = 0.0
        for t in positions:
            lr = log_ratio[t]
            lr_clipped = torch.clamp(lr, -cfg.clip_low, cfg.clip_high)
            if a > 0:
                chosen = lr if lr.item() <= lr_clipped.item() else lr_clipped
            elif a < 0:
                chosen = lr if lr.item() >= lr_clipped.item() else lr_clipped
            else:
                chosen = lr  # A = 0: psi is 0 whichever is chosen
            chosen_sum = chosen_sum + chosen
            out.ratio[t] = ratio[t].item()
            out.low[t] = a < 0 and lr.item() < -cfg.clip_low
            out.high[t] = a > 0 and lr.item() > cfg.clip_high
            out.dual[t] = False
        psi_i = a * torch.exp(chosen_sum / len(positions))
        for t in positions:
            out.psi[t] = psi_i
        return out

    if cfg.ratio == "cispo":
        # CISPO (MiniMax-M1 2025 eq. 4): psi = sg(min(r, 1 + eps_high)) A logp.
        for t in positions:
            r = ratio[t].item()
            out.psi[t] = min(r, 1.0 + cfg.clip_high) * adv(t) * logp[i, t]
            out.ratio[t] = r
            out.low[t] = False
            out.high[t] = r > 1.0 + cfg.clip_high  # the weight was truncated, whatever A
            out.dual[t] = False
        return out

    if cfg.ratio == "sapo":
        # SAPO (Gao et al. 2025): psi = (4/tau) sigmoid(tau (r - 1)) A, tau by the sign of A.
        for t in positions:
            tau = cfg.sapo_tau_pos if adv(t) > 0 else cfg.sapo_tau_neg
            out.psi[t] = (4.0 / tau) * torch.sigmoid(tau * (ratio[t] - 1.0)) * adv(t)
            out.ratio[t] = ratio[t].item()
            out.low[t] = out.high[t] = out.dual[t] = False
        return out

    if cfg.ratio in ("dppo_tv", "dppo_kl"):
        # DPPO (Qi et al. 2026): no gradient for a token whose probability moved beyond delta in
        # the direction its advantage pushes; else the gradient sg(min(r, 20)) A grad logp.
        for t in positions:
            p, q = math.exp(logp[i, t].item()), math.exp(old_logp[i, t].item())
            if cfg.ratio == "dppo_tv":
                divergence = abs(p - q)
            else:
                divergence = (q * math.log(q / p)
                              + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8)))
            a, r = adv(t), ratio[t].item()
            out.high[t] = a > 0 and p > q and divergence > cfg.clip_high
            out.low[t] = a < 0 and p < q and divergence > cfg.clip_low
            keep = 0.0 if (out.high[t] or out.low[t]) else 1.0
            out.psi[t] = keep * min(r, 20.0) * a * torch.exp(logp[i, t] - logp[i, t].item())
            out.ratio[t] = r
            out.dual[t] = False
        return out

    weights = None
    if cfg.ratio == "hybrid" and cfg.hybrid_mixing == "entropy":
        weights = entropy_weights(entropy, positions, i)
    for t in positions:
        a = adv(t)
        if cfg.ratio == "token":  # PPO / GRPO / DAPO: z = r[i,t]
            z = ratio[t]
            z_clipped = clip(z, cfg.clip_low, cfg.clip_high)
        elif cfg.ratio == "sequence":  # GSPO eq. 5: z = s_i
            z = s
            z_clipped = clip(z, cfg.clip_low, cfg.clip_high)
        elif cfg.ratio == "sequence_token":  # GSPO-token eq. 13: value s_i, own-token gradient
            z = s.detach() * torch.exp(logp[i, t] - logp[i, t].detach())
            z_clipped = clip(z, cfg.clip_low, cfg.clip_high)
        elif cfg.ratio == "hybrid":  # DHPO: each branch clipped in its own region, then mixed
            w = 0.5 if weights is None else weights[t]
            z = w * ratio[t] + (1.0 - w) * s
            z_clipped = w * clip(ratio[t], cfg.clip_low, cfg.clip_high) + (1.0 - w) * clip(
                s, cfg.seq_clip_low, cfg.seq_clip_high
            )
        else:
            raise ValueError(f"unknown ratio unit {cfg.ratio!r}")
        out.psi[t], out.dual[t] = ppo_term(z, z_clipped, a, cfg.dual_clip)
        out.ratio[t] = z.item()
        # The clip is active where the min picks the clipped branch: for a plain clip that is
        # "z below 1 - eps_low with A < 0" / "z above 1 + eps_high with A > 0".
        out.low[t] = a < 0 and z_clipped.item() > z.item()
        out.high[t] = a > 0 and z_clipped.item() < z.item()
    return out


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
) -> NaiveLoss:
    """``aggregate(l)`` with ``l[i,t] = -psi + beta k - entropy_coef H``
    (docs/algorithms.md §2–§4).

    The batch given here is the whole global batch: ``N`` = responses with a valid token,
    ``T`` = valid tokens.
    """
    n = response_mask.shape[0]
    rows = {i: valid_positions(response_mask, i) for i in range(n)}
    rows = {i: positions for i, positions in rows.items() if positions}
    n_responses = len(rows)
    n_tokens = sum(len(positions) for positions in rows.values())
    per_token_adv = advantages.dim() == 2
    if cfg.ratio == "geometric" and per_token_adv:
        raise ValueError("geometric (GMPO) needs one advantage per response")

    terms: dict[int, ResponseTerms] = {}
    for i, positions in rows.items():

        def adv(t: int, i: int = i) -> float:
            return (advantages[i, t] if per_token_adv else advantages[i]).item()

        terms[i] = response_terms(cfg, i, positions, logp, old_logp, adv, entropy)

    def aggregate(term: Callable[[int, int], Tensor | float], mode: str) -> Tensor | float:
        """docs/algorithms.md §3, written out over the global counts."""
        total = 0.0
        for i, positions in rows.items():
            for t in positions:
                if mode == "token_mean":  # DAPO §3.3
                    total = total + term(i, t) / n_tokens
                elif mode == "seq_mean_token_mean":  # GRPO, GSPO
                    total = total + term(i, t) / (len(positions) * n_responses)
                elif mode == "seq_mean_token_sum":
                    total = total + term(i, t) / n_responses
                elif mode == "seq_mean_token_sum_norm":  # Dr. GRPO, constant C
                    total = total + term(i, t) / (n_responses * cfg.norm_constant)
                else:
                    raise ValueError(f"unknown aggregation {mode!r}")
        return total

    use_kl = cfg.kl_coef > 0 and ref_logp is not None
    use_entropy = cfg.entropy_coef > 0 and entropy is not None

    def kl(i: int, t: int) -> Tensor:
        return kl_estimate(logp[i, t], ref_logp[i, t].item(), cfg.kl_estimator)

    def token_loss(i: int, t: int) -> Tensor:
        value = -terms[i].psi[t]
        if use_kl:
            value = value + cfg.kl_coef * kl(i, t)
        if use_entropy:
            value = value - cfg.entropy_coef * entropy[i, t]
        return value

    def minus_psi(i: int, t: int) -> float:
        return -terms[i].psi[t].item()

    def count(events: str) -> float | None:
        """Share of valid tokens, or of responses for a sequence ratio, where ``events`` hold."""
        if cfg.ratio not in ("sequence", "sequence_token"):
            return sum(sum(getattr(terms[i], events).values()) for i in rows) / n_tokens
        if per_token_adv:
            return None
        return sum(any(getattr(terms[i], events).values()) for i in rows) / n_responses

    if cfg.ratio in ("sequence", "sequence_token"):
        ratios = [next(iter(terms[i].ratio.values())) for i in rows]
    else:
        ratios = [terms[i].ratio[t] for i, positions in rows.items() for t in positions]

    kl_mean = aggregate(lambda i, t: kl(i, t).item(), "token_mean") if use_kl else None
    entropy_mean = None
    if use_entropy:
        entropy_mean = aggregate(lambda i, t: entropy[i, t].item(), "token_mean")

    return NaiveLoss(
        loss=aggregate(token_loss, cfg.aggregation),
        per_token=aggregate(minus_psi, "token_mean"),
        per_response=aggregate(minus_psi, "seq_mean_token_mean"),
        clip_low_frac=count("low"),
        clip_high_frac=count("high"),
        dual_frac=count("dual"),
        clip_token_frac=sum(terms[i].low.get(t, False) or terms[i].high.get(t, False)
                            for i, positions in rows.items() for t in positions) / n_tokens,
        ratio_mean=_mean(ratios),
        kl_mean=kl_mean,
        entropy_mean=entropy_mean,
    )
