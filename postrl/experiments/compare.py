"""``postrl compare``: every recipe x seed on the same model, prompts, sampling, verifier and
generated-token budget, one run directory each, then a report.

Each run's config is the same base (``--config`` file + ``key=value`` overrides) with only the
recipe, the seed and the output directory changed. :func:`check_fair` refuses anything else
before a single step is trained; prompt order and sampling seeds come from the trainer's
seeded prompt sampler, so the runs of one seed see the same prompts whatever the recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from postrl.cliargs import accept_intermixed
from postrl.config import TrainConfig, load_config
from postrl.config_checks import validate
from postrl.errors import ConfigError
from postrl.experiments.disk import check_free_space, disk_plan, drop_weights
from postrl.experiments.fairness import (
    check_fair,
    difference_text,
    varied_values,
    warn_indistinguishable,
    warn_several_components,
)
from postrl.experiments.paired import (
    FINAL_METRICS,
    PAIRED_HEADERS,
    Finals,
    arm_pairs,
    final_values,
    format_table,
    paired_cells,
    paired_rows,
    power_note,
    seed_rows,
)
from postrl.recipes import Recipe, get_recipe
from postrl.telemetry import RunDir, read_metrics
from postrl.train.resume import check_same_run

RECIPE_OPTIONS = frozenset(f.name for f in dataclasses.fields(Recipe)) - {"name"}
CONFIG_OPTIONS = frozenset(f.name for f in dataclasses.fields(TrainConfig))
UNBOUNDED_STEPS = 1_000_000  # steps when only a token budget stops the runs


@dataclass(frozen=True)
class RunSpec:
    """One compared recipe: a preset, component overrides, and (unfair unless varied on
    purpose) overrides of the shared config."""

    label: str  # its run directories are DIR/<label>/s<seed>
    preset: str
    recipe_options: dict[str, Any] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()  # key=value, as on the command line
    copy: int = 1  # the n-th time this recipe is compared: a noise floor when > 1


@dataclass
class PlannedRun:
    spec: RunSpec
    seed: int
    config: TrainConfig


def _safe_label(text: str) -> str:
    return re.sub(r"[^\w.=+-]", "_", text.replace(":", "+").replace(",", "+"))


def parse_recipe_spec(text: str) -> RunSpec:
    """``NAME`` or ``NAME:key=value,key=value``: recipe options go to ``recipe_options``, any
    other TrainConfig key overrides the shared config (which :func:`check_fair` refuses unless
    it is varied on purpose)."""
    name, _, rest = text.partition(":")
    get_recipe(name)  # a clear error for an unknown preset
    overrides = []
    for item in re.split(r",(?=[A-Za-z_][\w.]*=)", rest) if rest else []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"recipe {text!r}: {item!r} is not key=value")
        if key in RECIPE_OPTIONS:
            overrides.append(f"recipe_options.{key}={value}")
        elif key.split(".")[0] in CONFIG_OPTIONS - {"recipe", "seed", "out"}:
            overrides.append(f"{key}={value}")
        else:
            raise ConfigError(f"recipe {text!r}: {key!r} is neither a recipe option nor a "
                              "shared config option (recipe, seed and out are set by compare)")
    return RunSpec(label=_safe_label(text), preset=name, overrides=tuple(overrides))


def arm_recipe(text: str, where: str, config_file: str | None = None,
               overrides: Sequence[str] = ()) -> Recipe:
    """An arm that names a recipe, not a run (ladder's FROM and TO, ``explain``):
    ``NAME[:recipe options]`` as :func:`parse_recipe_spec` reads it, recipe options only, over
    the optional config file and overrides; the recipe is named by the arm's label."""
    spec = parse_recipe_spec(text)
    if any(not o.startswith("recipe_options.") for o in spec.overrides):
        raise ConfigError(f"{where} {text!r}: takes recipe options only")
    cfg = load_config(config_file, [*overrides, f"recipe={spec.preset}", *spec.overrides])
    return cfg.build_recipe().with_(name=spec.label)


NOISE_SEED_STRIDE = 1_000  # sampling_seed of a repeated recipe: seed + stride x (copy - 1)


def unique_labels(specs: list[RunSpec]) -> list[RunSpec]:
    """The same recipe given twice (a noise-floor check) gets ``-2``, ``-3``... labels; each
    copy samples its own responses (``sampling_seed``) from the same prompts, or the copies
    would be the same run, bit for bit."""
    seen: dict[str, int] = {}
    specs = list(specs)
    for index, spec in enumerate(specs):
        seen[spec.label] = count = seen.get(spec.label, 0) + 1
        if count > 1:
            specs[index] = dataclasses.replace(spec, label=f"{spec.label}-{count}", copy=count)
    return specs


def _sets_option(key: str, config_file: str | None, overrides: Sequence[str]) -> bool:
    """Whether the user set ``key`` in the config file or an override."""
    data = yaml.safe_load(Path(config_file).read_text()) if config_file else None
    return (isinstance(data, dict) and key in data) or any(
        o.partition("=")[0].strip() == key for o in overrides)


def plan_runs(specs: list[RunSpec], config_file: str | None, overrides: Sequence[str],
              seeds: int, token_budget: int | None, out: Path) -> list[PlannedRun]:
    """One validated TrainConfig per recipe x seed, from the same base."""
    base = load_config(config_file, list(overrides))
    budget = token_budget if token_budget is not None else base.token_budget
    unbounded = budget is not None and not _sets_option("steps", config_file, overrides)
    planned = []
    for spec in specs:
        for seed in range(base.seed, base.seed + seeds):
            cfg = load_config(config_file, [*overrides, f"recipe={spec.preset}", *spec.overrides])
            cfg.recipe_options = {**cfg.recipe_options, **spec.recipe_options}
            if spec.label != spec.preset:  # the resolved recipe (and the report) use the label
                cfg.recipe_options["name"] = spec.label
            cfg.seed, cfg.out, cfg.token_budget = seed, str(out / spec.label / f"s{seed}"), budget
            if spec.copy > 1:
                cfg.sampling_seed = seed + NOISE_SEED_STRIDE * (spec.copy - 1)
            if unbounded:
                cfg.steps = UNBOUNDED_STEPS
            validate(cfg, {})
            planned.append(PlannedRun(spec, seed, cfg))
    return planned


def finished(run: PlannedRun) -> bool:
    """Whether ``run`` already ran to its end here (its final policy is saved); ConfigError
    when that run was made with other options, so a resumed comparison never mixes runs."""
    run_dir = RunDir(run.config.run_dir())
    if not (run_dir.path / "final" / "config.json").is_file() or not run_dir.config_path.is_file():
        return False
    check_same_run(run_dir.read_config(), run.config.resolved(), str(run_dir.path))
    return True


def check_run_dirs_free(planned: list[PlannedRun]) -> None:
    """Refuse, before any training, run directories that hold an earlier run."""
    taken = [str(p.config.run_dir()) for p in planned
             if (p.config.run_dir() / "metrics.jsonl").exists() and not p.config.overwrite
             and getattr(p.config, "resume", "no") == "no"]
    if taken:
        raise ConfigError("these run directories already hold runs: " + ", ".join(taken)
                          + "; choose another --out, or pass overwrite=true (or resume=auto)")


def labelled_recipes(planned: list[PlannedRun]) -> list[Recipe]:
    """Each compared recipe once, named by its label."""
    recipes: dict[str, Recipe] = {}
    for run in planned:
        if run.spec.label not in recipes:
            recipes[run.spec.label] = run.config.build_recipe().with_(name=run.spec.label)
    return list(recipes.values())


def varied_settings(planned: list[PlannedRun], vary: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each arm's values of the fields varied on purpose (``--vary``), by label."""
    settings: dict[str, dict[str, Any]] = {}
    for run in planned:
        if run.spec.label not in settings:
            settings[run.spec.label] = varied_values(run.config.resolved(), vary)
    return settings


def describe_plan(planned: list[PlannedRun],
                  settings: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """What will run: what each arm changes from the first arm (``settings``: the fields
    varied on purpose, :func:`varied_settings`)."""
    recipes = labelled_recipes(planned)
    by_name, settings = {r.name: r for r in recipes}, settings or {}
    seeds = sorted({run.seed for run in planned})
    cfg = planned[0].config
    stop = (f"token budget {cfg.token_budget}" if cfg.token_budget is not None
            else f"{cfg.steps} steps")
    lines = [f"{len(recipes)} recipes x {len(seeds)} seeds {seeds}, model {cfg.model}, "
             f"task {cfg.task}, {cfg.prompts_per_step} prompts x {cfg.group_size} samples per "
             f"step, max_new_tokens {cfg.max_new_tokens}, stop at {stop}"]
    for recipe in recipes:
        what = difference_text(by_name, settings, recipes[0].name, recipe.name)
        lines.append(f"  {recipe.name}: " + (what if recipe is not recipes[0] else "baseline"))
    return lines


COST_HEADERS = ("arm", "seed", "steps", "tokens generated", "of which wasted")
COST_METRICS = ("step", "rollout/tokens_generated", "rollout/tokens_wasted")


def finals_of(planned: list[PlannedRun]) -> Finals:
    """Label -> seed -> each summary metric's and cost metric's last logged value."""
    finals: Finals = {}
    for run in planned:
        records = read_metrics(run.config.run_dir() / "metrics.jsonl")
        finals.setdefault(run.spec.label, {})[run.seed] = final_values(
            records, FINAL_METRICS + COST_METRICS)
    return finals


def cost_rows(planned: list[PlannedRun], finals: Finals) -> list[list[Any]]:
    """Each run's optimizer steps and generated tokens, wasted ones included, as logged."""
    rows = []
    for run in planned:
        last = finals[run.spec.label][run.seed]
        rows.append([run.spec.label, run.seed, *(None if last[m] is None else int(last[m])
                                                 for m in COST_METRICS)])
    return rows


def summarize(planned: list[PlannedRun], consecutive: bool = False,
              settings: dict[str, dict[str, Any]] | None = None) -> str:
    """Every seed's final values, then each pair of arms' paired differences with the
    components (and fields varied on purpose) that differ between the two."""
    finals = finals_of(planned)
    headers, rows = seed_rows(finals, FINAL_METRICS)
    parts = ["cost per run (the budget each spent; wasted: groups dynamic sampling dropped):",
             format_table(COST_HEADERS, cost_rows(planned, finals)),
             "", "final values per seed:", format_table(headers, rows)]
    recipes = {recipe.name: recipe for recipe in labelled_recipes(planned)}
    settings = settings or {}
    paired = paired_rows(finals, FINAL_METRICS, consecutive)
    for first, second in arm_pairs(list(finals), consecutive):
        what = (difference_text(recipes, settings, first, second)
                or "no component; only the sampled responses, a noise floor")
        parts += ["", f"{second} - {first}, paired by seed (differs in: {what}):",
                  format_table(PAIRED_HEADERS, [paired_cells(row) for row in paired
                                                if (row.first, row.second) == (first, second)])]
    if len(finals) > 1:
        parts += ["", power_note(finals)]
    return "\n".join(parts)


def run_comparison(specs: list[RunSpec], args: argparse.Namespace) -> int:
    """Plan, check fairness, warn, train every run, summarise and report."""
    from postrl.train.trainer import Trainer

    check_arguments(args)
    specs = unique_labels(specs)
    out = Path(args.out or f"runs/{args.command_name}-" + "-".join(s.label for s in specs)[:80])
    planned = plan_runs(specs, args.config, args.overrides, args.seeds, args.token_budget, out)
    noise_floor = {"sampling_seed"} if any(spec.copy > 1 for spec in specs) else set()
    check_fair([run.config.resolved() for run in planned], set(args.vary or ()) | noise_floor)
    done = [run for run in planned if finished(run)] if args.resume else []
    if args.resume:  # unfinished runs continue from their newest checkpoint, if they have one
        for run in planned:
            run.config.resume = "auto"
    check_run_dirs_free(planned)
    settings = varied_settings(planned, args.vary or ())
    print("\n".join(describe_plan(planned, settings)))
    to_train = [run.config for run in planned if run not in done]
    if to_train:
        needed, disk_line = disk_plan(to_train, args.keep_checkpoints, not args.drop_weights)
        print(disk_line)
        if not args.dry_run:
            check_free_space(out, needed, disk_line)
    recipes = labelled_recipes(planned)
    warnings = (warn_several_components(recipes, consecutive=args.command_name == "ladder")
                + warn_indistinguishable(recipes, planned[0].config.updates_per_batch, settings))
    if planned[0].config.token_budget is None:
        warnings.append("no token budget: runs stop on steps, so a recipe that generates more "
                        "per step (longer answers, dynamic sampling) also spends more tokens; "
                        "pass --token-budget")
    for warning in warnings:
        print(f"warning: {warning}")
    if args.dry_run:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"command": args.command_name, "vary": list(args.vary or ()), "warnings": warnings,
                "runs": [{"label": r.spec.label, "seed": r.seed, "dir": r.config.out}
                         for r in planned]}
    (out / "comparison.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for index, run in enumerate(planned, 1):
        print(f"[{index}/{len(planned)}] {run.spec.label} seed {run.seed} -> {run.config.out}"
              + (" (finished: kept)" if run in done else ""), flush=True)
        if run in done:
            continue
        Trainer(run.config).train()
        if not args.keep_checkpoints:  # a finished run resumes from nothing: its final policy
            shutil.rmtree(run.config.run_dir() / "checkpoints", ignore_errors=True)
        if args.drop_weights:
            drop_weights(run.config.run_dir() / "final")
        gc.collect()  # free the finished run's model, optimizer and reference before the next
    print(summarize(planned, consecutive=args.command_name == "ladder", settings=settings))
    from postrl.experiments.report import write_report  # matplotlib: only when reporting

    written = write_report([out], out)  # reads comparison.json: arm order, ladder pairs
    print("report: " + ", ".join(str(p) for p in written))
    return 0


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``compare`` and ``ladder`` share."""
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds per recipe, starting at the config's seed (default 3)")
    parser.add_argument("--token-budget", type=int, default=None, metavar="N",
                        help="generated tokens per run; steps stays an upper bound (set large "
                             "unless you give steps=)")
    parser.add_argument("--out", help="directory of the runs and the report "
                                      "(default runs/<command>-<recipes>)")
    parser.add_argument("--config", help="YAML file of TrainConfig options shared by every run")
    parser.add_argument("--vary", action="append", metavar="FIELD",
                        help="a config field allowed to differ between runs (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs that finished in --out and continue the others from "
                             "their newest checkpoint (set save_every); refuses runs made with "
                             "other options")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each finished run's checkpoints (by default they are "
                             "removed once it has saved its final policy: nothing resumes "
                             "from them)")
    parser.add_argument("--drop-weights", action="store_true",
                        help="remove each finished run's final weights too (its config, logs "
                             "and metrics stay: enough for the report, and for --resume to "
                             "know it finished)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check fairness and print the plan, the disk it will use and "
                             "the warnings; train nothing")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                        help="TrainConfig options shared by every run")
    accept_intermixed(parser)




def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """``postrl compare RECIPE... [flags] [key=value ...]``."""
    parser.add_argument("recipes", nargs="+", metavar="RECIPE",
                        help="a preset, optionally with component overrides: "
                             "dapo:clip_high=0.3,overlong_buffer=8")
    add_common_arguments(parser)
    parser.set_defaults(command_name="compare")


def split_positionals(args: argparse.Namespace) -> None:
    """argparse cannot tell ``RECIPE...`` from ``key=value...``: items with ``=`` before any
    ``:`` are overrides."""
    items = [*args.recipes, *args.overrides]
    args.recipes = [i for i in items if not _is_override(i)]
    args.overrides = [i for i in items if _is_override(i)]


def _is_override(item: str) -> bool:
    return "=" in item and ("=" in item.split(":")[0])


def check_arguments(args: argparse.Namespace) -> None:
    """ConfigError for a flag value no run could use."""
    if args.seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {args.seeds}")
    if args.token_budget is not None and args.token_budget < 1:
        raise ConfigError(f"--token-budget must be >= 1, got {args.token_budget}")
    for name in args.vary or ():
        if name.split(".")[0] not in CONFIG_OPTIONS:
            raise ConfigError(f"--vary {name}: not a TrainConfig option")


def run_compare(args: argparse.Namespace) -> int:
    """Entry point of ``postrl compare``."""
    split_positionals(args)
    if not args.recipes:
        raise ConfigError("compare needs at least one RECIPE")
    return run_comparison([parse_recipe_spec(r) for r in args.recipes], args)
