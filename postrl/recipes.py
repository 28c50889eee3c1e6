"""Recipes: named sets of orthogonal components (docs/algorithms.md §7).

A :class:`Recipe` is frozen data. The trainer and the loss branch on its components, never on
its name, so ``dapo`` is exactly "grpo + these component changes" and
``postrl explain dapo --vs grpo`` can say so (see ``postrl.components``).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, get_args

from postrl.errors import ConfigError
from postrl.objectives import AGGREGATIONS, RATIO_UNITS, PolicyLossConfig
from postrl.objectives.mismatch import WEIGHT_MODES, WEIGHT_UNITS
from postrl.objectives.policy_loss import NOT_PPO_CLIPPED
from postrl.options import opt

ADVANTAGES = ("group", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline")
GROUP_ADVANTAGES = ("group", "rloo", "reinforce_pp_baseline")
TOKEN_REWARD_ADVANTAGES = ("gae", "reinforce_pp", "reinforce_pp_baseline")
CHOICES: dict[str, tuple[str, ...]] = {
    "advantage": ADVANTAGES,
    "adv_scale": ("group", "batch", "none"),
    "adv_std": ("bessel", "population"),
    "ratio": RATIO_UNITS,
    "hybrid_mixing": ("averaged", "entropy"),
    "aggregation": AGGREGATIONS,
    "kl_placement": ("none", "loss", "reward"),
    "kl_estimator": ("k1", "k2", "k3"),
    "mismatch_weight": WEIGHT_UNITS,
    "mismatch_mode": WEIGHT_MODES,
    "dynamic_sampling_by": ("correctness", "reward"),
    "old_policy": ("proximal", "behaviour"),
}


@dataclass(frozen=True)
class Recipe:
    """Every algorithmic choice of a post-training run; all fields overridable.

    Schedule choices shared by all recipes (prompts per step, G, max_new_tokens, sampling,
    learning rate, updates per batch) live in the training config, not here, so that a
    comparison of recipes is a comparison of components only.
    """

    name: str = opt(doc="the recipe's name in config.yaml and reports; a preset's own, or "
                    "base(k=v) once recipe_options change it")
    # advantage (§1)
    advantage: str = opt(
        "group", "the advantage estimator: group (GRPO, Shao et al. 2024 §4.1.2), rloo (RLOO, "
        "Ahmadian et al. 2024 eq. 7), gae (needs critic; Schulman et al. 2015 eq. 16), "
        "reinforce_pp or reinforce_pp_baseline (REINFORCE++, Hu 2025 §3 and §3.3)")
    adv_scale: str = opt(
        "group", "what divides the group-centred rewards: the group's std (group; GRPO, Shao et "
        "al. 2024 §4.1.2), the batch's (batch; as TRL's scale_rewards='batch') or nothing "
        "(none; Dr. GRPO, Liu et al. 2025 §3.1)")
    adv_std: str = opt("bessel", "the std's divisor: bessel (G - 1, as TRL and verl) or "
                       "population (G)")
    adv_eps: float = opt(1e-6, "ε in A = (R - mean_g R) / (std + ε), in reward units (GRPO, "
                         "Shao et al. 2024 §4.1.2)")
    gamma: float = opt(1.0, "discount γ per token of GAE (Schulman et al. 2015 eq. 16) and of "
                       "REINFORCE++'s return-to-go (Hu 2025 §3), in [0, 1]")
    lam: float = opt(0.95, "GAE's λ, trading the advantage's bias for its variance "
                     "(Schulman et al. 2015 eq. 16), in [0, 1]")
    whiten_advantages: bool = opt(
        True, "whiten gae and reinforce_pp advantages over the batch's valid tokens, "
        "(x - mean) / sqrt(var + 1e-8) (REINFORCE++, Hu 2025 §3)")
    # importance ratio, clipping and surrogate (§2)
    ratio: str = opt(
        "token", "the importance ratio's unit: token (PPO, Schulman et al. 2017 eq. 6), sequence "
        "(GSPO, Zheng et al. 2025 eq. 7), sequence_token (GSPO eq. 13), hybrid (DHPO, Min et al. "
        "2026), geometric (GMPO, Zhao et al. 2025 eq. 4), cispo (MiniMax-M1 2025 eq. 4), sapo "
        "(Gao et al. 2025 eqs. 5-6), dppo_tv or dppo_kl (DPPO, Qi et al. 2026 eqs. 13 and 14)")
    hybrid_mixing: str = opt(
        "averaged", "the token ratio's weight w in ratio=hybrid: averaged (w = 1/2) or entropy "
        "(the token's entropy, min-max normalised over its response); DHPO, Min et al. 2026, "
        "as postrl reconstructs it (docs/recipes.md)")
    clip_low: float = opt(
        0.2, "lower clip range ε_low of the ratio, clipped below at 1 - ε_low (PPO, Schulman et "
        "al. 2017 eq. 7); in log space for geometric; DPPO's divergence bound δ for A < 0")
    clip_high: float = opt(
        0.2, "upper clip range ε_high of the ratio, clipped above at 1 + ε_high; ε_high > ε_low "
        "is DAPO's clip-higher (Yu et al. 2025 §3.1); CISPO's weight cap 1 + ε_high "
        "(MiniMax-M1 2025 eq. 4); DPPO's divergence bound δ for A > 0")
    seq_clip_low: float = opt(
        3e-4, "lower clip range of the sequence ratio in ratio=hybrid's sequence branch (DHPO, "
        "Min et al. 2026; GSPO's range, Zheng et al. 2025 §5.1)")
    seq_clip_high: float = opt(
        4e-4, "upper clip range of the sequence ratio in ratio=hybrid's sequence branch (DHPO, "
        "Min et al. 2026; GSPO's range, Zheng et al. 2025 §5.1)")
    dual_clip: float | None = opt(
        None, "c > 1 of dual-clip PPO: for A < 0 the surrogate is at least c·A (Ye et al. 2019 "
        "eq. 5); null = off")
    sapo_tau_pos: float = opt(1.0, "SAPO's soft-gate temperature τ for tokens with A > 0 "
                              "(Gao et al. 2025 eqs. 5-6)")
    sapo_tau_neg: float = opt(1.05, "SAPO's soft-gate temperature τ for tokens with A < 0 "
                              "(Gao et al. 2025 eqs. 5-6)")
    # aggregation (§3)
    aggregation: str = opt(
        "seq_mean_token_mean", "how token losses become the batch's loss: token_mean (DAPO, Yu "
        "et al. 2025 §3.3), seq_mean_token_mean (GRPO, Shao et al. 2024 eq. 3), "
        "seq_mean_token_sum (verl's) or seq_mean_token_sum_norm (Dr. GRPO, Liu et al. 2025 §3.1)")
    norm_constant: float | None = opt(
        None, "C of seq_mean_token_sum_norm, L = Σ ℓ / (N·C), in tokens (Dr. GRPO, Liu et al. "
        "2025 §3.1); null = max_new_tokens")
    # KL and entropy (§4)
    kl_placement: str = opt(
        "none", "where the KL to the reference policy goes: none (DAPO, Yu et al. 2025 §2.3), "
        "loss (GRPO, Shao et al. 2024 eq. 4) or reward, a per-token penalty (InstructGPT, "
        "Ouyang et al. 2022 eq. 2)")
    kl_estimator: str = opt(
        "k3", "the per-token KL estimator: k1, k2 or k3 (Schulman 2020, 'Approximating KL "
        "divergence'; GRPO's k3, Shao et al. 2024 eq. 4)")
    kl_coef: float = opt(0.0, "β, the KL term's weight; 0 = no KL and no reference model")
    entropy_coef: float = opt(
        0.0, "weight of the entropy bonus subtracted from each token's loss (Williams & Peng "
        "1991; PPO, Schulman et al. 2017 eq. 9)")
    # on-policy distillation (§11)
    distill_coef: float = opt(
        0.0, "λ, the weight of the per-token reverse KL to the teacher (teacher.model) in each "
        "token's advantage, -λ (log π_student - log π_teacher) on the student's own samples "
        "(GKD, Agarwal et al. 2024; Thinking Machines 2025); 0 = no distillation and no teacher")
    # critic (§5)
    critic: bool = opt(False, "train a value head for advantage=gae (PPO, Schulman et al. "
                       "2017)")
    vf_coef: float = opt(0.5, "weight of the value loss (PPO, Schulman et al. 2017 eq. 9)")
    value_clip: float | None = opt(
        0.2, "ε of the clipped value loss, in reward units: V counts within ε of V_old (PPO's "
        "value clipping, as OpenAI baselines' ppo2); null = the plain squared error")
    # batch filters and shaping (§6)
    dynamic_sampling: bool = opt(
        False, "drop groups that carry no learning signal and sample again until "
        "prompts_per_step groups are useful (DAPO, Yu et al. 2025 §3.2)")
    dynamic_sampling_by: str = opt(
        "correctness", "what makes a group useful to dynamic_sampling: correctness (the "
        "verifier marks some but not all of its G responses correct, 0 < #correct < G: DAPO "
        "§3.2, eq. 11) or reward (its total rewards, shaping included, are not all equal)")
    max_sampling_rounds: int = opt(
        3, "the most generation rounds a step takes with dynamic_sampling; then it trains on "
        "the useful groups it has (DAPO, Yu et al. 2025 §3.2)")
    overlong_filter: bool = opt(False, "mask every token of a truncated response out of the "
                                "loss (DAPO's overlong filtering, Yu et al. 2025 §3.4)")
    overlong_penalty: bool = opt(
        False, "add DAPO's soft overlong punishment to the reward, from 0 down to -1 over the "
        "last overlong_buffer tokens before max_new_tokens (Yu et al. 2025 eq. 13)")
    overlong_buffer: int = opt(
        16, "L_cache, the tokens before max_new_tokens where the overlong penalty ramps, in "
        "tokens (DAPO, Yu et al. 2025 eq. 13)")
    overlong_penalty_factor: float = opt(1.0, "scale of the overlong penalty, in reward "
                                         "units: its largest magnitude")
    # sampler-trainer mismatch correction (§9; postrl.objectives.mismatch); off in every preset
    mismatch_weight: str = opt(
        "none", "weight w = π_old / π_sampler on each token's surrogate term: none, token, "
        "sequence_product or sequence_geometric (Yao et al. 2025; Liu, Li et al. 2025)")
    mismatch_mode: str = opt(
        "truncate", "truncate w at mismatch_cap (TIS, Yao et al. 2025) or mask it to 0 outside "
        "[mismatch_low, mismatch_high] (MIS; IcePop, Ling Team 2025)")
    mismatch_cap: float = opt(2.0, "C ≥ 1 of TIS, w ← min(w, C) (Yao et al. 2025)")
    mismatch_low: float = opt(0.5, "the mask's lower bound, w ← 0 below it (MIS; IcePop, "
                              "Ling Team 2025)")
    mismatch_high: float = opt(2.0, "the mask's upper bound, w ← 0 above it (MIS; IcePop, "
                               "Ling Team 2025)")
    mismatch_reject: float | None = opt(
        None, "b > 1: w = 0 for every token of a response whose geometric-mean weight is outside "
        "[1/b, b] (geometric rejection, Liu, Li et al. 2025; verl's rollout_rs=seq_mean_k1); "
        "null = off")

    # off-policy samples (§10; postrl.train.staleness): how old they may be, and what the
    # ratio is taken against
    max_staleness: int = opt(
        0, "k: step t trains on samples drawn by the weights after update max(0, t - k), so "
        "the sampler may run k updates ahead of the trainer; 0 = synchronous (AReaL's "
        "max_head_offpolicyness, Fu et al. 2025; prime-rl's max_off_policy_steps)")
    old_policy: str = opt(
        "proximal", "π_old of the ratio: proximal (the trainer's forward at the update's start; "
        "with a mismatch correction π_old / π_sampler weighs each token: the decoupled PPO "
        "objective, Hilton et al. 2021, as AReaL uses it) or behaviour (the sampler's own "
        "log-probs, no recomputation: plain PPO on stale samples, verl's bypass mode)")

    def __post_init__(self) -> None:
        validate(self)

    def with_(self, name: str | None = None, **overrides: Any) -> Recipe:
        """A copy with some components changed, validated; ``name`` defaults to ``base(k=v)``."""
        fields = {f.name for f in dataclasses.fields(self)}
        for key in overrides:
            if key not in fields:
                close = difflib.get_close_matches(key, sorted(fields), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(f"recipe has no option {key!r}{hint}")
        if name is None:
            changes = ",".join(f"{k}={v}" for k, v in overrides.items())
            name = f"{self.name}({changes})" if changes else self.name
        return dataclasses.replace(self, name=name, **overrides)

    @property
    def needs_reference(self) -> bool:
        """A reference forward pass is needed only when a KL term is on."""
        return self.kl_placement != "none" and self.kl_coef > 0

    def check_schedule(self, group_size: int, max_new_tokens: int) -> None:
        """Errors for combinations that depend on the schedule shared by all recipes."""
        if group_size < 2 and (self.advantage in GROUP_ADVANTAGES or self.dynamic_sampling):
            what = "dynamic_sampling" if self.advantage not in GROUP_ADVANTAGES else (
                f"advantage={self.advantage!r}")
            raise ConfigError(f"{what} compares responses within a group: needs group_size "
                              f">= 2, got {group_size}")
        if self.overlong_penalty and not 0 < self.overlong_buffer < max_new_tokens:
            raise ConfigError(f"overlong_buffer must be in (0, max_new_tokens={max_new_tokens}),"
                              f" got {self.overlong_buffer}")

    def policy_loss_config(self, max_new_tokens: int) -> PolicyLossConfig:
        """The loss-side components (every field of PolicyLossConfig is one of the recipe's),
        with ``C`` resolved to max_new_tokens when unset and the KL coefficient only when the
        KL is in the loss."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(PolicyLossConfig)}
        return PolicyLossConfig(**{
            **shared,
            "norm_constant": self.norm_constant or float(max_new_tokens),
            "kl_coef": self.kl_coef if self.kl_placement == "loss" else 0.0,
        })


def _check_type(key: str, value: Any) -> None:
    field = Recipe.__dataclass_fields__[key]
    allowed = _allowed_types(field.type)
    if isinstance(value, bool) and bool not in allowed:
        ok = False
    else:
        ok = isinstance(value, allowed) or (float in allowed and isinstance(value, int))
    if not ok:
        names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
        raise ConfigError(f"recipe option {key!r} must be {names}, got {value!r}")


def _allowed_types(annotation: Any) -> tuple[type, ...]:
    names = {"str": str, "float": float, "int": int, "bool": bool, "None": type(None)}
    if isinstance(annotation, str):
        return tuple(names[p.strip()] for p in annotation.split("|"))
    return get_args(annotation) or (annotation,)


def validate(r: Recipe) -> None:
    """Raise ConfigError, naming the option, for any impossible combination of components."""
    for field in dataclasses.fields(r):
        _check_type(field.name, getattr(r, field.name))
    for key, options in CHOICES.items():
        value = getattr(r, key)
        if value not in options:
            raise ConfigError(f"recipe option {key}={value!r} is not one of {', '.join(options)}")
    if r.max_staleness < 0:
        raise ConfigError(f"max_staleness must be >= 0 updates, got {r.max_staleness}")
    if r.old_policy == "behaviour" and (r.mismatch_weight != "none"
                                        or r.mismatch_reject is not None):
        raise ConfigError("old_policy='behaviour' takes the ratio against the sampler's own "
                          "log-probs, so the mismatch correction (pi_old / pi_sampler) has "
                          "nothing left to correct: set mismatch_weight=none and "
                          "mismatch_reject=null, or old_policy=proximal")
    clips = ("clip_low", "clip_high", "seq_clip_low", "seq_clip_high")
    bad = ", ".join(f"{k}={getattr(r, k)}" for k in clips if getattr(r, k) < 0)
    if bad:
        raise ConfigError(f"clip ranges must be >= 0: {bad}")
    if r.ratio not in ("geometric", "cispo", "sapo", "dppo_tv", "dppo_kl") and r.clip_low >= 1:
        raise ConfigError(f"clip_low={r.clip_low} puts the lower ratio bound 1 - clip_low "
                          "at or below 0")
    if r.dual_clip is not None:
        if r.dual_clip <= 1:
            raise ConfigError(f"dual_clip c must be > 1 (Ye et al. 2019), got {r.dual_clip}")
        if r.ratio in NOT_PPO_CLIPPED:
            raise ConfigError(f"dual_clip applies to PPO-clipped surrogates, not ratio={r.ratio!r}")
    if r.sapo_tau_pos <= 0 or r.sapo_tau_neg <= 0:
        raise ConfigError(f"SAPO's temperatures must be > 0, got sapo_tau_pos={r.sapo_tau_pos} "
                          f"and sapo_tau_neg={r.sapo_tau_neg}")
    if r.hybrid_mixing != "averaged" and r.ratio != "hybrid":
        raise ConfigError(f"hybrid_mixing={r.hybrid_mixing!r} only applies to ratio='hybrid'")
    if r.advantage == "gae" and not r.critic:
        raise ConfigError("advantage='gae' needs a learned value function: set critic=true")
    if r.critic and r.advantage != "gae":
        raise ConfigError(f"critic=true is only used by advantage='gae', not {r.advantage!r}")
    if r.ratio == "geometric" and r.advantage in ("gae", "reinforce_pp", "reinforce_pp_baseline"):
        raise ConfigError("ratio='geometric' needs one advantage per response, not per-token "
                          f"advantage={r.advantage!r}")
    if r.ratio == "geometric" and r.distill_coef:
        raise ConfigError("ratio='geometric' needs one advantage per response, and "
                          "distill_coef > 0 gives each token its own")
    if r.kl_placement == "reward" and r.advantage not in TOKEN_REWARD_ADVANTAGES:
        raise ConfigError(f"kl_placement='reward' needs token rewards (advantage in "
                          f"{', '.join(TOKEN_REWARD_ADVANTAGES)}), not {r.advantage!r}")
    for key in ("kl_coef", "entropy_coef", "vf_coef", "adv_eps", "overlong_penalty_factor",
                "distill_coef"):
        if getattr(r, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(r, key)}")
    for key in ("gamma", "lam"):
        if not 0 <= getattr(r, key) <= 1:
            raise ConfigError(f"{key} must be in [0, 1], got {getattr(r, key)}")
    if r.value_clip is not None and r.value_clip <= 0:
        raise ConfigError(f"value_clip must be > 0 or null, got {r.value_clip}")
    if r.norm_constant is not None and r.norm_constant <= 0:
        raise ConfigError(f"norm_constant must be > 0, got {r.norm_constant}")
    if r.max_sampling_rounds < 1:
        raise ConfigError(f"max_sampling_rounds must be >= 1, got {r.max_sampling_rounds}")
    if r.overlong_buffer < 1:
        raise ConfigError(f"overlong_buffer must be >= 1, got {r.overlong_buffer}")
    if r.mismatch_cap < 1:
        raise ConfigError(f"mismatch_cap must be >= 1 (C of TIS), got {r.mismatch_cap}")
    if not 0 <= r.mismatch_low < 1 < r.mismatch_high:
        raise ConfigError(f"the mismatch mask needs 0 <= mismatch_low < 1 < mismatch_high, got "
                          f"{r.mismatch_low} and {r.mismatch_high}")
    if r.mismatch_reject is not None and r.mismatch_reject <= 1:
        raise ConfigError(f"mismatch_reject b must be > 1 (responses outside [1/b, b] are "
                          f"rejected), got {r.mismatch_reject}")


_GRPO = Recipe("grpo", kl_placement="loss", kl_estimator="k3", kl_coef=0.04)

PRESETS: dict[str, Recipe] = {
    "ppo": Recipe("ppo", advantage="gae", critic=True, aggregation="token_mean",
                  kl_placement="reward", kl_estimator="k1", kl_coef=0.05),
    "grpo": _GRPO,
    "dr_grpo": Recipe("dr_grpo", adv_scale="none", aggregation="seq_mean_token_sum_norm"),
    "dapo": Recipe("dapo", clip_high=0.28, aggregation="token_mean", dynamic_sampling=True,
                   overlong_penalty=True),
    "gspo": Recipe("gspo", ratio="sequence", clip_low=3e-4, clip_high=4e-4),
    "dhpo": Recipe("dhpo", ratio="hybrid", clip_low=0.2, clip_high=0.28),
    # optional extras; their defaults are postrl's choices, documented in docs/recipes.md
    "rloo": Recipe("rloo", advantage="rloo", aggregation="token_mean"),
    "reinforce_pp": Recipe("reinforce_pp", advantage="reinforce_pp", aggregation="token_mean",
                           kl_placement="reward", kl_estimator="k1", kl_coef=0.01),
    "reinforce_pp_baseline": Recipe("reinforce_pp_baseline", advantage="reinforce_pp_baseline",
                                    aggregation="token_mean", kl_placement="loss",
                                    kl_estimator="k2", kl_coef=0.01),
    "gmpo": Recipe("gmpo", ratio="geometric", clip_low=0.4, clip_high=0.4),
    "cispo": Recipe("cispo", ratio="cispo", clip_high=0.28, aggregation="token_mean"),
    # the 2026 trust-region variants, with their authors' defaults (docs/recipes.md)
    "sapo": Recipe("sapo", ratio="sapo"),
    "dppo": Recipe("dppo", ratio="dppo_tv", clip_low=0.15, clip_high=0.15, adv_scale="none",
                   aggregation="token_mean"),
}
CORE = ("ppo", "grpo", "dr_grpo", "dapo", "gspo", "dhpo")


def get_recipe(name: str) -> Recipe:
    """A preset by name; a clear error, with the closest names, for an unknown one."""
    try:
        return PRESETS[name]
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=2)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown recipe {name!r}{hint}; known: {', '.join(PRESETS)}") from None
