"""What makes a comparison of recipes fair, and when compared components cannot differ.

A fair comparison changes only the recipe's components (docs/algorithms.md §7): the model, the
prompts, the sampling, the verifier and the generated-token budget are shared.
:func:`check_fair` refuses anything else unless the extra field is varied on purpose.
:func:`warn_indistinguishable` says when the schedule makes compared components inert: with
one update per batch every importance ratio is exactly 1 (docs/recipes.md, "On-policy
behaviour"), so ratio units, clip ranges and dual-clip cannot change the gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from postrl.components import COMPONENTS, differing
from postrl.errors import ConfigError
from postrl.recipes import TOKEN_REWARD_ADVANTAGES, Recipe

RECIPE_FIELDS = frozenset({"recipe", "recipe_options", "resolved_recipe"})
# per-run bookkeeping: where a run writes and what it logs or checkpoints, never what it learns
BOOKKEEPING_FIELDS = frozenset({"out", "seed", "overwrite", "quiet", "report_to", "log_samples",
                                "save_rollouts_every", "save_every", "keep_last", "resume"})
IGNORED_FIELDS = RECIPE_FIELDS | BOOKKEEPING_FIELDS

# Ratio units whose on-policy gradient equals the token ratio's (tests/experiments/
# test_compare.py checks each): per-token advantages break the equivalence for the units
# that spread one response-level ratio over the tokens.
ON_POLICY_TOKEN_EQUIVALENT = frozenset({"token", "sequence_token", "cispo"})
ON_POLICY_PER_RESPONSE_EQUIVALENT = frozenset({"sequence", "hybrid", "geometric"})
INERT_REASONS = {
    "ratio": ("every ratio is exactly 1, and token, sequence (GSPO), sequence-token, "
              "averaged-hybrid (DHPO), geometric (GMPO) and CISPO surrogates then have the same "
              "gradient (entropy-guided hybrid mixing is the exception)"),
    "clip": "every ratio is exactly 1, strictly inside any clip range, so no clip is active",
    "dual-clip": "dual-clip bounds ratios above c > 1 with A < 0; every ratio is exactly 1",
}


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"lora": {"r": 0}}`` -> ``{"lora.r": 0}`` so a difference names the exact option."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _run_name(config: Mapping[str, Any], index: int) -> str:
    """``label/s0`` from ``out=DIR/label/s0``; ``run N`` without an output directory."""
    out = config.get("out")
    if not out:
        return f"run {index}"
    parts = str(out).rstrip("/").split("/")
    return "/".join(parts[-2:])


def _is_varied(field: str, vary: Iterable[str]) -> bool:
    return any(field == v or field.startswith(f"{v}.") for v in vary)


def differing_fields(configs: list[Mapping[str, Any]]) -> dict[str, dict[str, list[str]]]:
    """Fields (dotted) outside the recipe and bookkeeping whose values differ between runs:
    ``{field: {repr(value): [run names]}}``."""
    flat = [_flatten({k: v for k, v in c.items() if k not in IGNORED_FIELDS}) for c in configs]
    names = [_run_name(c, i) for i, c in enumerate(configs)]
    result: dict[str, dict[str, list[str]]] = {}
    for field in dict.fromkeys(k for f in flat for k in f):  # config order
        values = [repr(f.get(field, "<unset>")) for f in flat]
        if len(set(values)) > 1:
            holders: dict[str, list[str]] = {}
            for value, name in zip(values, names, strict=True):
                holders.setdefault(value, []).append(name)
            result[field] = holders
    return result


def check_fair(configs: list[Mapping[str, Any]], vary: Iterable[str] = frozenset()) -> None:
    """ConfigError unless the resolved configs (``TrainConfig.resolved()``) differ only in the
    recipe's components and per-run bookkeeping, or in fields named in ``vary``."""
    vary = set(vary)
    unfair = {field: holders for field, holders in differing_fields(configs).items()
              if not _is_varied(field, vary)}
    if not unfair:
        return
    lines = [f"  {field}: " + "; ".join(f"{value} in {', '.join(names)}"
                                        for value, names in holders.items())
             for field, holders in unfair.items()]
    flags = " ".join(f"--vary {field}" for field in unfair)
    raise ConfigError(
        "unfair comparison: the runs differ in more than the recipe's components\n"
        + "\n".join(lines)
        + "\nA fair comparison shares model, prompts, sampling, verifier, schedule and token "
          f"budget. To vary these on purpose, pass {flags}"
    )


def _ratio_key(recipe: Recipe) -> tuple:
    """The ratio component as far as an on-policy gradient can tell (docs/recipes.md)."""
    if recipe.ratio == "hybrid" and recipe.hybrid_mixing == "entropy":
        return ("hybrid", "entropy")
    per_token_advantages = recipe.advantage in TOKEN_REWARD_ADVANTAGES
    if recipe.ratio in ON_POLICY_TOKEN_EQUIVALENT or (
            not per_token_advantages and recipe.ratio in ON_POLICY_PER_RESPONSE_EQUIVALENT):
        return ("token-equivalent",)
    return (recipe.ratio,)


def on_policy_key(recipe: Recipe) -> tuple:
    """The components' states with the on-policy-inert ones (ratio unit where equivalent,
    clip ranges, dual-clip) collapsed: equal keys mean equal gradients with one update."""
    key = []
    for component in COMPONENTS:
        if component.title == "ratio":
            key.append(_ratio_key(recipe))
        elif component.title in ("clip", "dual-clip"):
            key.append(("inert",))
        else:
            key.append(component.state(recipe))
    return tuple(key)


def _schedule_text(updates_per_batch: int) -> str:
    return f"with one update per batch (epochs x minibatches = {updates_per_batch})"


def warn_indistinguishable(recipes: list[Recipe], updates_per_batch: int,
                           settings: Mapping[str, Mapping[str, Any]] | None = None) -> list[str]:
    """Warnings for compared recipes that cannot differ under the schedule.

    Recipes with identical components and the same ``settings`` (each recipe's
    :func:`varied_values`, by name) only measure seed noise. With one update per batch
    (on-policy) ratio units, clip ranges and dual-clip are inert, except the entropy-guided
    hybrid mixing, which reweights tokens within a response even on-policy.
    """
    warnings = []
    on_policy = updates_per_batch == 1
    groups: dict[tuple, list[Recipe]] = {}
    for recipe in recipes:
        key = on_policy_key(recipe) if on_policy else tuple(c.state(recipe) for c in COMPONENTS)
        varied = repr(sorted((settings or {}).get(recipe.name, {}).items()))
        groups.setdefault((varied, key), []).append(recipe)
    for members in groups.values():
        if len(members) < 2:
            continue
        names = ", ".join(r.name for r in members)
        changed = sorted({c.title for a in members for b in members for c in differing(a, b)},
                         key=[c.title for c in COMPONENTS].index)
        if not changed:
            warnings.append(f"{names} have identical components: their runs differ only by "
                            "noise (useful as a noise floor, not as a comparison)")
            continue
        reasons = "; ".join(f"{title}: {INERT_REASONS[title]}" for title in changed)
        warnings.append(
            f"{names} differ only in {', '.join(changed)}, which cannot change the gradient "
            f"{_schedule_text(updates_per_batch)}: {reasons}. Expect the same training up to "
            "floating-point noise; set minibatches > 1 or epochs > 1 to take them off-policy "
            "(GSPO used 4 minibatches per rollout batch)")
    if on_policy:
        warnings += _partly_inert(recipes, groups)
    return warnings


def _partly_inert(recipes: list[Recipe], groups: dict[tuple, list[Recipe]]) -> list[str]:
    """One note per inert component that differs between otherwise distinguishable recipes."""
    group_of = {id(r): key for key, members in groups.items() for r in members}
    notes = []
    for title in INERT_REASONS:
        component = next(c for c in COMPONENTS if c.title == title)
        inert = _ratio_key if title == "ratio" else (lambda r: ("inert",))
        pairs = [(a, b) for i, a in enumerate(recipes) for b in recipes[i + 1:]
                 if group_of[id(a)] != group_of[id(b)]
                 and component.state(a) != component.state(b) and inert(a) == inert(b)]
        if pairs:
            names = ", ".join(f"{a.name} vs {b.name}" for a, b in pairs[:3])
            extra = len(pairs) - 3
            more = f" and {extra} more pair{'s' * (extra > 1)}" if extra > 0 else ""
            notes.append(f"{title} differs ({names}{more}) but is inert {_schedule_text(1)}: "
                         f"{INERT_REASONS[title]}; those runs differ through their other "
                         "components or varied fields only")
    return notes


def warn_several_components(recipes: list[Recipe], consecutive: bool = False) -> list[str]:
    """A warning for each recipe that differs in more than one component from the first (the
    baseline), or with ``consecutive`` (a ladder) from the one before it: its effect cannot
    be put down to any one of them (``postrl ladder`` walks them one at a time)."""
    pairs = (zip(recipes, recipes[1:], strict=False) if consecutive
             else [(recipes[0], recipe) for recipe in recipes[1:]])
    warnings = []
    for before, recipe in pairs:
        changed = [c.title for c in differing(before, recipe)]
        if len(changed) > 1:
            warnings.append(
                f"{recipe.name} differs from {before.name} in {len(changed)} components "
                f"({', '.join(changed)}): a difference between them cannot be put down to one "
                f"component; compare one change at a time, or walk them with postrl ladder "
                f"{before.name} {recipe.name}")
    return warnings


def changes_text(base: Recipe, recipe: Recipe) -> str:
    """``recipe``'s components that differ from ``base``'s, each as ``title: state``."""
    return "; ".join(f"{c.title}: {c.describe(recipe)}" for c in differing(base, recipe))


def varied_values(config: Mapping[str, Any], vary: Iterable[str]) -> dict[str, Any]:
    """``config``'s fields varied on purpose (``--vary``; a name covers its dotted fields), as
    ``{dotted field: value}``."""
    return {field: value for field, value in _flatten(config).items() if _is_varied(field, vary)}


def difference_text(recipes: Mapping[str, Recipe], settings: Mapping[str, Mapping[str, Any]],
                    first: str, second: str) -> str:
    """What arm ``second`` changes from arm ``first``: its components, then the fields varied
    on purpose (``settings``: each arm's :func:`varied_values`)."""
    mine, theirs = settings.get(first, {}), settings.get(second, {})
    varied = [f"{field}={value}" for field, value in theirs.items()
              if field not in mine or mine[field] != value]
    return "; ".join(filter(None, [changes_text(recipes[first], recipes[second]), *varied]))
