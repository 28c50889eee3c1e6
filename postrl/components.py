"""The components a recipe is made of, with their sources and formulas, for ``explain``.

Each :class:`Component` owns some of :class:`~postrl.recipes.Recipe`'s fields. Two recipes
differ in a component when its ``state`` differs; fields a component ignores under a recipe's
other choices (the KL estimator when KL is off) are left out of the state, so they never show
up as differences. Every recipe field except ``name`` belongs to exactly one component.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from postrl.recipes import Recipe


@dataclass(frozen=True)
class Component:
    title: str
    fields: tuple[str, ...]
    state: Callable[[Recipe], tuple]
    describe: Callable[[Recipe], str]  # the value, in words
    source: Callable[[Recipe], str]  # the paper it comes from
    formula: Callable[[Recipe], str]  # one line of maths


def _advantage_state(r: Recipe) -> tuple:
    if r.advantage == "group":
        scale = (r.adv_scale,) if r.adv_scale == "none" else (r.adv_scale, r.adv_std, r.adv_eps)
        return (r.advantage, *scale)
    if r.advantage == "gae":
        return (r.advantage, r.gamma, r.lam, r.whiten_advantages)
    if r.advantage.startswith("reinforce_pp"):
        return (r.advantage, r.gamma, r.whiten_advantages)
    return (r.advantage,)


def _advantage_describe(r: Recipe) -> str:
    if r.advantage == "group":
        scale = {"group": "/ group std", "batch": "/ batch std", "none": "no std scaling"}
        return f"group-relative, {scale[r.adv_scale]}"
    if r.advantage == "gae":
        return f"GAE with a critic (gamma={r.gamma}, lambda={r.lam})"
    return {"rloo": "leave-one-out (RLOO)", "reinforce_pp": "REINFORCE++ return-to-go",
            "reinforce_pp_baseline": "REINFORCE++ with group-mean baseline"}[r.advantage]


_ADVANTAGE = {  # key -> (source, formula)
    ("group", "group"): ("GRPO, Shao et al. 2024 §4.1.2",
                         "A_i = (R_i - mean_g R) / (std_g R + eps)"),
    ("group", "batch"): ("GRPO with batch-level std (as TRL scale_rewards='batch')",
                         "A_i = (R_i - mean_g R) / (std_batch R + eps)"),
    ("group", "none"): ("Dr. GRPO, Liu et al. 2025 §3.1", "A_i = R_i - mean_g R"),
    "rloo": ("RLOO, Ahmadian et al. 2024 eq. 7", "A_i = R_i - mean_{j != i} R_j"),
    "gae": ("GAE, Schulman et al. 2015 eq. 16; PPO, Schulman et al. 2017",
            "A_t = sum_l (gamma*lambda)^l delta_{t+l},  delta_t = rho_t + gamma*V_{t+1} - V_t"),
    "reinforce_pp": ("REINFORCE++, Hu 2025", "A_t = whiten(sum_{l>=t} gamma^(l-t) rho_l)"),
    "reinforce_pp_baseline": ("REINFORCE++-baseline, Hu 2025",
                              "A_t = whiten(return-to-go of (R_i - mean_g R) - beta*KL_t)"),
}


def _advantage_key(r: Recipe):
    return (r.advantage, r.adv_scale) if r.advantage == "group" else r.advantage


_RATIO = {
    "token": ("token ratio r = exp(logp - old)", "PPO, Schulman et al. 2017 eq. 6",
              "z[i,t] = pi(y_t|..)/pi_old(y_t|..)"),
    "sequence": ("sequence ratio (GSPO)", "GSPO, Zheng et al. 2025 eq. 7",
                 "z_i = s_i = exp(mean_t (logp - old))"),
    "sequence_token": ("GSPO-token", "GSPO, Zheng et al. 2025 eq. 13",
                       "z[i,t] = sg(s_i) * exp(logp - sg(logp))"),
    "hybrid": ("hybrid token+sequence (DHPO)", "DHPO, Min et al. 2026 (arXiv 2601.05607)",
               "z = w*r + (1-w)*s,  z_clip = w*clip(r) + (1-w)*clip(s)"),
    "geometric": ("geometric mean of token ratios (GMPO)", "GMPO, Zhao et al. 2025 eq. 4",
                  "psi_i = A_i * exp(mean_t clip(log r_t, -eps_low, eps_high))"),
    "cispo": ("clipped IS weight, REINFORCE gradient (CISPO)", "MiniMax-M1, 2025 eq. 4",
              "l = -sg(min(r, 1+eps_high)) * A * logp"),
    "sapo": ("token ratio through a soft gate (SAPO)",
             "SAPO, Gao et al. 2025 (arXiv 2511.20347) eqs. 5-6",
             "psi = (4/tau) * sigmoid(tau*(r-1)) * A,  tau = tau_pos if A > 0 else tau_neg"),
    "dppo_tv": ("token ratio, binary total-variation mask (DPPO-Binary-TV)",
                "DPPO, Qi et al. 2026 (arXiv 2602.04879) eq. 13",
                "psi = M * sg(min(r, 20)) * A * logp,  M = 0 if |p - p_old| > delta "
                "in A's direction"),
    "dppo_kl": ("token ratio, binary KL mask (DPPO-Binary-KL)",
                "DPPO, Qi et al. 2026 (arXiv 2602.04879) eq. 14",
                "psi = M * sg(min(r, 20)) * A * logp,  M = 0 if KL_bin(p_old, p) > delta "
                "in A's direction"),
}


def _ratio_describe(r: Recipe) -> str:
    text = _RATIO[r.ratio][0]
    return f"{text}, {r.hybrid_mixing} mixing" if r.ratio == "hybrid" else text


def _clip_state(r: Recipe) -> tuple:
    if r.ratio == "cispo":
        return (r.clip_high,)
    if r.ratio == "sapo":
        return (r.sapo_tau_pos, r.sapo_tau_neg)
    if r.ratio == "hybrid":
        return (r.clip_low, r.clip_high, r.seq_clip_low, r.seq_clip_high)
    return (r.clip_low, r.clip_high)


def _clip_describe(r: Recipe) -> str:
    if r.ratio == "cispo":
        return f"IS weight capped at 1 + {r.clip_high}"
    if r.ratio == "sapo":
        return f"soft gate, tau_pos={r.sapo_tau_pos}, tau_neg={r.sapo_tau_neg} (no clip)"
    if r.ratio.startswith("dppo_"):
        kind = "total variation" if r.ratio == "dppo_tv" else "binary KL"
        return f"{kind} within delta={r.clip_low} (A < 0) / {r.clip_high} (A > 0)"
    kind = "clip-higher" if r.clip_high > r.clip_low else "symmetric"
    text = f"eps_low={r.clip_low}, eps_high={r.clip_high} ({kind})"
    if r.ratio == "hybrid":
        text = f"token {text}; sequence {r.seq_clip_low}/{r.seq_clip_high}"
    return text


def _clip_source(r: Recipe) -> str:
    if r.ratio == "sapo":
        return "SAPO, Gao et al. 2025: tau_pos=1.0, tau_neg=1.05"
    if r.ratio.startswith("dppo_"):
        return "DPPO, Qi et al. 2026 App. C: delta=0.15 (TV), 0.05 (KL)"
    if r.ratio in ("sequence", "sequence_token"):
        return "GSPO, Zheng et al. 2025 §5.1 (ranges 3e-4 / 4e-4)"
    if r.ratio == "hybrid":
        return "DHPO, Min et al. 2026: branch-specific clipping before mixing"
    if r.clip_high > r.clip_low:
        return "DAPO clip-higher, Yu et al. 2025 §3.1"
    return "PPO, Schulman et al. 2017 eq. 7"


def _clip_formula(r: Recipe) -> str:
    if r.ratio == "sapo":
        return "a sigmoid gate of width 1/tau around r = 1 replaces the clip"
    if r.ratio.startswith("dppo_"):
        return "M = 0 where A > 0, p > p_old, D > delta_high or A < 0, p < p_old, D > delta_low"
    return "psi = min(z*A, clip(z, 1-eps_low, 1+eps_high)*A)"


_AGGREGATION = {
    "token_mean": ("token-level: mean over all tokens of the batch", "DAPO, Yu et al. 2025 §3.3",
                   "L = sum_{i,t} l[i,t] / sum_i L_i"),
    "seq_mean_token_mean": ("sample-level: mean over responses of token means",
                            "GRPO, Shao et al. 2024 eq. 3", "L = 1/N sum_i (1/L_i) sum_t l[i,t]"),
    "seq_mean_token_sum": ("mean over responses of token sums", "verl's seq-mean-token-sum",
                           "L = 1/N sum_i sum_t l[i,t]"),
    "seq_mean_token_sum_norm": ("constant-normalised token sum", "Dr. GRPO, Liu et al. 2025 §3.1",
                                "L = sum_{i,t} l[i,t] / (N*C),  C constant (max_new_tokens)"),
}


def _kl_state(r: Recipe) -> tuple:
    return (r.kl_placement, r.kl_estimator, r.kl_coef) if r.needs_reference else ("off",)


def _kl_describe(r: Recipe) -> str:
    if not r.needs_reference:
        return "KL off (no reference model)"
    return f"in the {r.kl_placement}, {r.kl_estimator}, beta={r.kl_coef}"


def _kl_source(r: Recipe) -> str:
    if not r.needs_reference:
        return "DAPO, Yu et al. 2025 §2.3 (KL removed); Dr. GRPO, Liu et al. 2025"
    if r.kl_placement == "reward":
        return "InstructGPT, Ouyang et al. 2022 eq. 2 (per-token penalty in the reward)"
    return "GRPO, Shao et al. 2024 eq. 4; estimators from Schulman 2020"


_KL_FORMULA = {
    "k1": "k1 = logp - ref", "k2": "k2 = (ref - logp)^2 / 2",
    "k3": "k3 = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]",
}


def _mismatch_state(r: Recipe) -> tuple:
    weight = (("off",) if r.mismatch_weight == "none" else
              (r.mismatch_weight, r.mismatch_mode, r.mismatch_cap) if r.mismatch_mode == "truncate"
              else (r.mismatch_weight, r.mismatch_mode, r.mismatch_low, r.mismatch_high))
    return (*weight, r.mismatch_reject)


def _mismatch_describe(r: Recipe) -> str:
    parts = []
    if r.mismatch_weight != "none":
        unit = {"token": "per token", "sequence_product": "per response, product of token "
                "weights (underflows on long responses)", "sequence_geometric":
                "per response, geometric mean of token weights"}[r.mismatch_weight]
        handled = (f"truncated at C={r.mismatch_cap} (TIS)" if r.mismatch_mode == "truncate" else
                   f"0 outside [{r.mismatch_low}, {r.mismatch_high}] (MIS)")
        parts.append(f"importance weights {unit}, {handled}")
    if r.mismatch_reject is not None:
        parts.append(f"responses rejected outside [1/{r.mismatch_reject}, {r.mismatch_reject}]")
    return "; ".join(parts) or "off (the gap is logged, not corrected)"


def _mismatch_source(r: Recipe) -> str:
    sources = []
    decoupled = (r.mismatch_weight == "token" and r.mismatch_mode == "mask"
                 and r.mismatch_low == 0)
    if decoupled:  # tests/objectives/test_mismatch.py checks it against AReaL's formula
        sources.append("decoupled PPO's behaviour weight, capped by masking (AReaL, Fu et al. "
                       "2025: behav_imp_weight_cap; Hilton et al. 2021)")
    elif r.mismatch_weight != "none":
        sources.append("TIS, Yao et al. 2025 ('Your efficient RL framework secretly brings you "
                       "off-policy RL training')" if r.mismatch_mode == "truncate" else
                       "MIS / IcePop, Ling Team 2025; Liu, Li et al. 2025 ('When speed kills "
                       "stability')")
    if r.mismatch_reject is not None:
        sources.append("geometric rejection, Liu, Li et al. 2025 (verl rollout_rs=seq_mean_k1)")
    return "; ".join(sources) or "Yao et al. 2025; Liu, Li et al. 2025 (off in every preset)"


def _mismatch_formula(r: Recipe) -> str:
    unit = {"none": "w = 1", "token": "w[i,t] = pi_old/pi_sampler",
            "sequence_product": "w_i = exp(sum_t (old - sampler))",
            "sequence_geometric": "w_i = exp(mean_t (old - sampler))"}[r.mismatch_weight]
    if r.mismatch_weight != "none":
        unit += (",  w <- min(w, C)" if r.mismatch_mode == "truncate" else
                 ",  w <- 0 outside [low, high]")
    if r.mismatch_reject is not None:
        unit += ",  w_i <- 0 if exp(mean_t (old - sampler)) outside [1/b, b]"
    return f"l[i,t] = -w * psi,  {unit}"


def _on_off(flag: bool, detail: str = "") -> str:
    return f"on{detail}" if flag else "off"


COMPONENTS: tuple[Component, ...] = (
    Component("advantage", ("advantage", "adv_scale", "adv_std", "adv_eps", "gamma", "lam",
                            "whiten_advantages"),
              _advantage_state, _advantage_describe,
              lambda r: _ADVANTAGE[_advantage_key(r)][0],
              lambda r: _ADVANTAGE[_advantage_key(r)][1]),
    Component("ratio", ("ratio", "hybrid_mixing"),
              lambda r: (r.ratio, r.hybrid_mixing if r.ratio == "hybrid" else None),
              _ratio_describe, lambda r: _RATIO[r.ratio][1], lambda r: _RATIO[r.ratio][2]),
    Component("clip", ("clip_low", "clip_high", "seq_clip_low", "seq_clip_high", "sapo_tau_pos",
                       "sapo_tau_neg"),
              _clip_state, _clip_describe, _clip_source, _clip_formula),
    Component("dual-clip", ("dual_clip",), lambda r: (r.dual_clip,),
              lambda r: f"c={r.dual_clip}" if r.dual_clip else "off",
              lambda r: "Dual-clip PPO, Ye et al. 2019 eq. 5",
              lambda r: "A < 0: psi = max(psi, c*A)"),
    Component("aggregation", ("aggregation", "norm_constant"),
              lambda r: (r.aggregation,
                         r.norm_constant if r.aggregation == "seq_mean_token_sum_norm" else None),
              lambda r: _AGGREGATION[r.aggregation][0], lambda r: _AGGREGATION[r.aggregation][1],
              lambda r: _AGGREGATION[r.aggregation][2]),
    Component("KL", ("kl_placement", "kl_estimator", "kl_coef"), _kl_state, _kl_describe,
              _kl_source,
              lambda r: _KL_FORMULA[r.kl_estimator] if r.needs_reference else "no KL term"),
    Component("distillation", ("distill_coef",), lambda r: (r.distill_coef,),
              lambda r: (f"on-policy, reverse KL to the teacher per token in the advantage, "
                         f"lambda={r.distill_coef}" if r.distill_coef else "off (no teacher)"),
              lambda r: ("on-policy distillation: GKD, Agarwal et al. 2024 (on-policy data, "
                         "reverse KL); Thinking Machines Lab 2025 (per-token advantage, "
                         "discount 0)" if r.distill_coef else "none"),
              lambda r: ("A[i,t] += -lambda * (log pi_old(y_t) - log pi_teacher(y_t))"
                         if r.distill_coef else "no teacher term")),
    Component("entropy bonus", ("entropy_coef",), lambda r: (r.entropy_coef,),
              lambda r: f"coef={r.entropy_coef}" if r.entropy_coef else "off",
              lambda r: "entropy regularisation, Williams & Peng 1991; PPO eq. 9",
              lambda r: "l -= entropy_coef * H[i,t]"),
    Component("critic", ("critic", "vf_coef", "value_clip"),
              lambda r: (r.vf_coef, r.value_clip) if r.critic else ("none",),
              lambda r: (f"value head, vf_coef={r.vf_coef}, value_clip={r.value_clip}"
                         if r.critic else "none (critic-free)"),
              lambda r: "PPO, Schulman et al. 2017 eq. 9",
              lambda r: "L_V = 1/2 max((V-G)^2, (V_old + clip(V-V_old, -eps, eps) - G)^2)"),
    Component("dynamic sampling", ("dynamic_sampling", "dynamic_sampling_by",
                                   "max_sampling_rounds"),
              lambda r: (r.dynamic_sampling, r.dynamic_sampling_by if r.dynamic_sampling else None,
                         r.max_sampling_rounds if r.dynamic_sampling else None),
              lambda r: _on_off(r.dynamic_sampling, f" by {r.dynamic_sampling_by} (up to "
                                f"{r.max_sampling_rounds} rounds)"),
              lambda r: "DAPO, Yu et al. 2025 §3.2",
              lambda r: ("keep groups with 0 < #correct < G, resample until P groups are useful"
                         if r.dynamic_sampling_by == "correctness" else
                         "keep groups with std_g(R) > 0, resample until P groups are useful")),
    Component("overlong filtering", ("overlong_filter",), lambda r: (r.overlong_filter,),
              lambda r: _on_off(r.overlong_filter), lambda r: "DAPO, Yu et al. 2025 §3.4",
              lambda r: "m[i,t] = 0 for every token of a truncated response"),
    Component("overlong shaping", ("overlong_penalty", "overlong_buffer",
                                   "overlong_penalty_factor"),
              lambda r: ((r.overlong_penalty, r.overlong_buffer, r.overlong_penalty_factor)
                         if r.overlong_penalty else (False,)),
              lambda r: _on_off(r.overlong_penalty,
                                f": soft overlong punishment, L_cache={r.overlong_buffer}"),
              lambda r: "DAPO soft overlong punishment, Yu et al. 2025 eq. 13",
              lambda r: "R += ((L_max - L_cache) - L) / L_cache inside the last L_cache tokens"),
    Component("mismatch correction", ("mismatch_weight", "mismatch_mode", "mismatch_cap",
                                      "mismatch_low", "mismatch_high", "mismatch_reject"),
              _mismatch_state, _mismatch_describe, _mismatch_source, _mismatch_formula),
    Component("staleness", ("max_staleness",), lambda r: (r.max_staleness,),
              lambda r: (f"up to {r.max_staleness} updates: step t trains on samples of the "
                         f"weights after update max(0, t - {r.max_staleness})"
                         if r.max_staleness else "none: every batch drawn by the weights it "
                         "trains"),
              lambda r: ("asynchronous RL with bounded staleness (AReaL, Fu et al. 2025, arXiv "
                         "2505.24298: max_head_offpolicyness)" if r.max_staleness
                         else "synchronous RL"),
              lambda r: "batch t drawn by theta_{max(0, t - k)}: staleness min(t, k)"),
    Component("old policy", ("old_policy",), lambda r: (r.old_policy,),
              lambda r: ("proximal: the trainer's forward at the update's start"
                         if r.old_policy == "proximal" else
                         "behaviour: the sampler's own log-probs (no recomputation)"),
              lambda r: ("decoupled PPO, Hilton et al. 2021 ('Batch size-invariance for "
                         "policy optimization', arXiv 2110.00641); AReaL, Fu et al. 2025"
                         if r.old_policy == "proximal" else
                         "PPO, Schulman et al. 2017, with the sampler as pi_old (verl's "
                         "bypass mode)"),
              lambda r: ("z = pi / pi_prox, clipped around 1; the mismatch weight "
                         "pi_prox / pi_behav multiplies it" if r.old_policy == "proximal" else
                         "z = pi / pi_behav, clipped around 1")),
)


def differing(a: Recipe, b: Recipe) -> list[Component]:
    """The components whose state differs between two recipes, in table order."""
    return [c for c in COMPONENTS if c.state(a) != c.state(b)]


TABLE_COLUMNS = ("recipe", "advantage", "ratio", "clip eps_low / eps_high", "aggregation", "KL",
                 "filters / shaping")


def summary_row(r: Recipe) -> tuple[str, ...]:
    """One short row of the recipe table (``postrl recipes``), aligned with TABLE_COLUMNS."""
    advantage = "gae (critic)" if r.critic else r.advantage
    if r.advantage == "group":
        advantage += f", scale={r.adv_scale}"
    ratio = f"hybrid ({r.hybrid_mixing})" if r.ratio == "hybrid" else r.ratio
    if r.ratio == "cispo":
        clip = f"weight <= 1 + {r.clip_high}"
    elif r.ratio == "sapo":
        clip = f"soft gate, tau {r.sapo_tau_pos:g} / {r.sapo_tau_neg:g}"
    elif r.ratio.startswith("dppo_"):
        clip = f"{r.ratio[5:].upper()} <= {r.clip_low:g} / {r.clip_high:g}"
    elif r.ratio == "hybrid":
        clip = f"tok {r.clip_low} / {r.clip_high}, seq {r.seq_clip_low:g} / {r.seq_clip_high:g}"
    else:
        clip = f"{r.clip_low:g} / {r.clip_high:g}"
        clip += " (log space)" if r.ratio == "geometric" else ""
    if r.dual_clip:
        clip += f", dual c={r.dual_clip}"
    aggregation = r.aggregation
    kl = (f"{r.kl_placement}, {r.kl_estimator}, beta={r.kl_coef}" if r.needs_reference else "none")
    shaping = [name for flag, name in ((r.dynamic_sampling, "dynamic sampling"),
                                       (r.overlong_filter, "overlong filtering"),
                                       (r.overlong_penalty, "soft overlong"),
                                       (r.entropy_coef > 0, f"entropy {r.entropy_coef}")) if flag]
    return (r.name, advantage, ratio, clip, aggregation, kl, ", ".join(shaping) or "-")


def markdown_table(recipes: list[Recipe]) -> str:
    """The recipe table as GitHub Markdown (the README embeds this output verbatim)."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(summary_row(r)) + " |" for r in recipes]
    return "\n".join(lines)
