"""``postrl ladder FROM TO``: the recipes that turn FROM into TO one component at a time.

Each rung copies the fields of one :class:`~postrl.components.Component` from TO, so it
differs from the previous rung in exactly that component, and the last rung equals TO in every
component. The default order follows the DAPO paper's ablation (Yu et al. 2025, Table 1:
overlong filtering, clip-higher, soft overlong punishment, token-level loss, dynamic sampling),
preceded by the removal of the KL term (§2.3) and followed by any other differing component in
``COMPONENTS`` order. The rungs then run like ``postrl compare``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from postrl.components import COMPONENTS, Component, differing
from postrl.errors import ConfigError
from postrl.experiments.compare import (
    RunSpec,
    add_common_arguments,
    arm_recipe,
    run_comparison,
)
from postrl.recipes import PRESETS, Recipe, get_recipe

DAPO_ABLATION = ("KL", "overlong filtering", "clip", "overlong shaping", "aggregation",
                 "dynamic sampling")
BY_TITLE = {c.title: c for c in COMPONENTS}


@dataclass(frozen=True)
class Rung:
    """One recipe of a ladder and the components copied from TO to reach it."""

    recipe: Recipe
    applied: tuple[str, ...]  # component titles; empty for FROM itself
    changed: tuple[str, ...]  # components whose state differs from the previous rung


def slug(title: str) -> str:
    """``overlong shaping`` -> ``overlong_shaping``: a component's name in a rung's name."""
    return title.lower().replace(" ", "_").replace("-", "_")


def default_rank(titles: Sequence[str] = ()) -> Callable[[Component], int]:
    """Preference of the components: ``titles`` first, then DAPO's ablation, then the rest."""
    preferred = [*titles, *(t for t in DAPO_ABLATION if t not in titles)]
    order = preferred + [c.title for c in COMPONENTS if c.title not in preferred]
    return lambda component: order.index(component.title)


def _apply(current: Recipe, target: Recipe, components: Sequence[Component]) -> Recipe | None:
    """``current`` with the fields of ``components`` copied from ``target``; None if invalid."""
    fields = {f: getattr(target, f) for c in components for f in c.fields}
    try:
        return current.with_(name="", **fields)
    except ConfigError:
        return None


def _key(recipe: Recipe) -> tuple:
    return dataclasses.astuple(dataclasses.replace(recipe, name=""))


def _single_steps(current: Recipe, target: Recipe, rank, failed: set) -> list | None:
    """Depth-first, in preference order: a path whose every step is valid and changes exactly
    one component; None if there is none from ``current``."""
    remaining = sorted(differing(current, target), key=rank)
    if not remaining:
        return []
    if _key(current) in failed:
        return None
    for component in remaining:
        step = _apply(current, target, (component,))
        if step is None or len(differing(current, step)) != 1:
            continue
        rest = _single_steps(step, target, rank, failed)
        if rest is not None:
            return [((component,), step), *rest]
    failed.add(_key(current))
    return None


def _coupled_steps(current: Recipe, target: Recipe, rank) -> list:
    """Greedy fallback when no single-component path exists: the first valid step in
    preference order, one component if possible, else two applied together (e.g. GAE needs the
    critic); a step may then change a dependent component too (clip ranges of a new ratio)."""
    path = []
    while remaining := sorted(differing(current, target), key=rank):
        candidates = [(c,) for c in remaining] + [
            (a, b) for i, a in enumerate(remaining) for b in remaining[i + 1:]]
        for components in candidates:
            step = _apply(current, target, components)
            if step is not None and differing(current, step):
                break
        else:
            names = ", ".join(c.title for c in remaining)
            raise ConfigError(f"no valid recipe changes one or two of {names} at a time")
        path.append((components, step))
        current = step
    return path


def _exact_steps(start: Recipe, target: Recipe, titles: Sequence[str]) -> list:
    """The user's ``--order`` (then the default order), step by step; a clear error for a step
    that gives an impossible recipe."""
    rank = default_rank(titles)
    path, current = [], start
    while remaining := sorted(differing(current, target), key=rank):
        # a component whose fields already equal TO's may still differ through another one
        # (the clip state depends on the ratio unit): apply the first whose fields differ
        component = next(c for c in remaining
                         if any(getattr(current, f) != getattr(target, f) for f in c.fields))
        try:
            step = current.with_(name="", **{f: getattr(target, f) for f in component.fields})
        except ConfigError as err:
            raise ConfigError(f"--order: applying {component.title!r} at this point gives an "
                              f"invalid recipe ({err}); move it") from None
        path.append(((component,), step))
        current = step
    return path


def _check_order(order: Sequence[str], start: Recipe, target: Recipe) -> None:
    known = [c.title for c in COMPONENTS]
    changing = [c.title for c in differing(start, target)]
    for title in order:
        if title not in known:
            raise ConfigError(f"--order: unknown component {title!r}; components: "
                              + ", ".join(known))
        if title not in changing:
            raise ConfigError(f"--order: {title!r} is the same in {start.name} and "
                              f"{target.name}; they differ in " + ", ".join(changing))


def ladder_rungs(from_recipe: Recipe | str, to_recipe: Recipe | str,
                 order: Sequence[str] | None = None) -> list[Rung]:
    """FROM, then one rung per component change, ending at a recipe named TO."""
    start = get_recipe(from_recipe) if isinstance(from_recipe, str) else from_recipe
    target = get_recipe(to_recipe) if isinstance(to_recipe, str) else to_recipe
    if order:
        _check_order(order, start, target)
        path = _exact_steps(start, target, order)
    else:
        rank = default_rank()
        path = _single_steps(start, target, rank, set())
        if path is None:
            path = _coupled_steps(start, target, rank)
    rungs, previous, applied = [Rung(start, (), ())], start, []
    for index, (components, recipe) in enumerate(path):
        applied += [slug(c.title) for c in components]
        last = index == len(path) - 1
        name = target.name if last else "+".join([start.name, *applied])
        named = recipe.with_(name=name)
        rungs.append(Rung(named, tuple(c.title for c in components),
                          tuple(c.title for c in differing(previous, named))))
        previous = named
    return rungs


def build_ladder(from_recipe: Recipe | str, to_recipe: Recipe | str,
                 order: Sequence[str] | None = None) -> list[Recipe]:
    """The recipes from FROM to TO, each differing from the previous in one component."""
    return [rung.recipe for rung in ladder_rungs(from_recipe, to_recipe, order)]


def rung_spec(recipe: Recipe, preset: str) -> RunSpec:
    """A rung as the trainer builds it: a preset plus the fields that differ from it."""
    base = PRESETS[preset]
    options = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)
               if f.name != "name" and getattr(recipe, f.name) != getattr(base, f.name)}
    return RunSpec(label=recipe.name, preset=preset, recipe_options=options)


def describe_ladder(rungs: list[Rung]) -> list[str]:
    """One line per rung: the component(s) it changes, before -> after."""
    lines = [f"ladder {rungs[0].recipe.name} -> {rungs[-1].recipe.name}: {len(rungs) - 1} steps"]
    width = max(len(r.recipe.name) for r in rungs)
    lines.append(f"  {rungs[0].recipe.name.ljust(width)}  (start)")
    for previous, rung in zip(rungs, rungs[1:], strict=False):
        parts = [f"{t}: {BY_TITLE[t].describe(previous.recipe)} -> "
                 f"{BY_TITLE[t].describe(rung.recipe)}" for t in rung.changed]
        lines.append(f"  {rung.recipe.name.ljust(width)}  " + "; ".join(parts))
    return lines


def _endpoint(text: str, args: argparse.Namespace) -> Recipe:
    """FROM or TO (``NAME[:recipe options]``) with the shared recipe_options applied."""
    return arm_recipe(text, "ladder", args.config, args.overrides)


def add_ladder_arguments(parser: argparse.ArgumentParser) -> None:
    """``postrl ladder FROM TO [--order a,b,c] [compare's flags] [key=value ...]``."""
    parser.add_argument("from_recipe", metavar="FROM")
    parser.add_argument("to_recipe", metavar="TO")
    parser.add_argument("--order", help="component titles in the order to apply them, comma "
                                        "separated (default: DAPO's ablation order)")
    add_common_arguments(parser)
    parser.set_defaults(command_name="ladder")


def run_ladder(args: argparse.Namespace) -> int:
    """Entry point of ``postrl ladder``: build the rungs, print them, run them like compare."""
    start, target = _endpoint(args.from_recipe, args), _endpoint(args.to_recipe, args)
    order = [t.strip() for t in args.order.split(",") if t.strip()] if args.order else None
    rungs = ladder_rungs(start, target, order)
    if len(rungs) < 2:
        raise ConfigError(f"{start.name} and {target.name} have the same components")
    print("\n".join(describe_ladder(rungs)))
    preset = args.from_recipe.partition(":")[0]
    return run_comparison([rung_spec(r.recipe, preset) for r in rungs], args)
