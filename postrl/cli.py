"""The ``postrl`` command.

Subcommands: train, eval, compare, ladder, replay, report, diagnose, recipes, explain, options.

Errors a user can fix (``PostRLError``) are printed without a traceback.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys

from rich.console import Console
from rich.table import Table

from postrl.cliargs import accept_intermixed, append_to_help
from postrl.components import COMPONENTS, TABLE_COLUMNS, differing, markdown_table, summary_row
from postrl.errors import PostRLError
from postrl.recipes import CORE, PRESETS


def _console() -> Console:
    # a terminal gets its own width; piped output gets one wide enough for the whole table
    console = Console(highlight=False)
    return console if console.is_terminal else Console(width=200, highlight=False)


def cmd_recipes(args: argparse.Namespace) -> int:
    recipes = list(PRESETS.values()) if args.all else [PRESETS[n] for n in CORE]
    if args.markdown:
        print(markdown_table(recipes))
        return 0
    table = Table(title="postrl recipes (components; every field overridable)")
    for column in TABLE_COLUMNS:
        table.add_column(column)
    for recipe in recipes:
        table.add_row(*summary_row(recipe))
    _console().print(table)
    if not args.all:
        extras = ", ".join(n for n in PRESETS if n not in CORE)
        print(f"optional extras (postrl recipes --all): {extras}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from postrl.experiments.compare import arm_recipe  # arms as compare and ladder read them

    recipe = arm_recipe(args.recipe, "explain")
    if args.vs is None:
        print(f"{recipe.name}: its components")
        components = list(COMPONENTS)
    else:
        base = arm_recipe(args.vs, "explain --vs")
        components = differing(base, recipe)
        count = len(components)
        print(f"{recipe.name} = {base.name} + {count} component change{'s' * (count != 1)}")
    for component in components:
        print()
        if args.vs is None:
            print(f"{component.title}: {component.describe(recipe)}")
        else:
            before, after = component.describe(base), component.describe(recipe)
            print(f"{component.title}: {before}  ->  {after}")
        print(f"    from:    {component.source(recipe)}")
        print(f"    formula: {component.formula(recipe)}")
    return 0


def cmd_options(args: argparse.Namespace) -> int:
    from postrl.options_docs import render_text

    print(render_text(args.recipe, args.pattern, width=_help_width()), end="")
    return 0


def _help_width() -> int:
    return min(shutil.get_terminal_size((100, 24)).columns, 100)


def _options_listing() -> str:
    from postrl.options_docs import render_text

    return "\n" + render_text(width=_help_width())


TRAIN_FLAGS = ("recipe", "model", "task", "steps", "out", "seed")


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _signal_name(stop: KeyboardInterrupt) -> str:
    """The signal that stopped a command: SIGTERM from ``_interrupt``, else Ctrl-C's SIGINT
    (a KeyboardInterrupt raised by other code counts as Ctrl-C)."""
    signalled = stop.args and stop.args[0] in signal.Signals.__members__
    return stop.args[0] if signalled else "SIGINT"


# How an interrupted command's work continues, for the commands whose work can
_RESUMABLE = ("finished runs are kept; the same command with --resume skips them and "
              "continues the others from their newest checkpoint, if they saved one")
CONTINUE_HINTS = {"compare": _RESUMABLE, "ladder": _RESUMABLE}


def cmd_train(args: argparse.Namespace) -> int:
    from postrl.config import load_config
    from postrl.train.trainer import Trainer

    overrides = [f"{key}={getattr(args, key)}" for key in TRAIN_FLAGS
                 if getattr(args, key) is not None] + list(args.overrides)
    cfg = load_config(args.config, overrides)
    trainer = None
    try:
        trainer = Trainer(cfg)
        metrics = trainer.train()
    except KeyboardInterrupt as stop:
        from postrl.train.resume import interrupted_note

        name = _signal_name(stop)
        note = (interrupted_note(None, cfg.save_every) if trainer is None else
                interrupted_note(trainer.run, cfg.save_every, trainer.restored_earlier))
        print(f"postrl: interrupted ({name}); {note}", file=sys.stderr)
        return 128 + signal.Signals[name]
    final = cfg.run_dir() / "final"
    print(f"saved {final}  (reward/mean {metrics.get('reward/mean', float('nan')):.3f}, "
          f"{int(metrics.get('rollout/tokens_generated', 0))} tokens generated)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from postrl.train.evaluate import run_eval

    return run_eval(args)


def _add_experiment_commands(sub) -> None:
    """Commands of postrl.experiments, each defined next to what it runs."""
    from postrl.experiments import compare, diagnose, ladder, replay, report

    commands = [
        ("compare", "train recipes x seeds under one schedule and token budget, then report",
         compare.add_compare_arguments, compare.run_compare),
        ("ladder", "turn one recipe into another one component at a time, and compare the rungs",
         ladder.add_ladder_arguments, ladder.run_ladder),
        ("replay", "several recipes' losses and gradients on one frozen rollout batch",
         replay.add_replay_arguments, replay.run_replay),
        ("report", "plots and tables of runs against generated tokens (HTML + Markdown)",
         report.add_report_arguments, report.run_report),
        ("diagnose", "findings from a run's metrics, with advice",
         diagnose.add_diagnose_arguments, diagnose.run_diagnose),
    ]
    for name, help_text, add_arguments, run in commands:
        parser = sub.add_parser(name, help=help_text)
        add_arguments(parser)
        parser.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    from postrl.config import TrainConfig
    from postrl.train.evaluate import add_eval_arguments

    parser = argparse.ArgumentParser(
        prog="postrl", description="RL post-training of language models as recipes of components")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy with a recipe",
                           description="Train with a YAML config and/or key=value overrides, "
                                       "e.g. postrl train --recipe dapo --model tiny --steps 3 "
                                       "recipe_options.clip_high=0.3")
    train.add_argument("--config", help="YAML file of TrainConfig options")
    for key in TRAIN_FLAGS:
        train.add_argument(f"--{key}", help=f"same as {key}=VALUE")
    train.add_argument("overrides", nargs="*", metavar="key=value",
                       help="any TrainConfig option; dotted for groups (lora.r=8)")
    accept_intermixed(train)  # `train --steps 3 lr=1e-5`: overrides may follow flags
    append_to_help(train, _options_listing)  # `train --help` lists every option after its flags
    train.set_defaults(func=cmd_train)
    evaluate = sub.add_parser("eval", help="pass@1 (greedy) and unbiased pass@k on a task")
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=cmd_eval)
    _add_experiment_commands(sub)
    recipes = sub.add_parser("recipes", help="print the component table of every recipe")
    recipes.add_argument("--all", action="store_true", help="include the optional extras")
    recipes.add_argument("--markdown", action="store_true", help="print a Markdown table")
    recipes.set_defaults(func=cmd_recipes)
    explain = sub.add_parser("explain", help="a recipe's components, or its difference to another")
    explain.add_argument("recipe", metavar="RECIPE",
                         help="a recipe, or NAME:key=value,... as compare and ladder take it")
    explain.add_argument("--vs", metavar="OTHER", help="list only the components that differ")
    explain.set_defaults(func=cmd_explain)
    options = sub.add_parser("options", help="every option of postrl train: type, default, help")
    options.add_argument("pattern", nargs="?", help="only the options whose name contains this")
    options.add_argument("--recipe", metavar="NAME", help="the recipe components as this preset "
                         f"sets them (default: {TrainConfig.recipe})")
    options.set_defaults(func=cmd_options)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # a scheduler's SIGTERM (preemption, a time limit) stops any command as Ctrl-C does:
    # with a line saying what is kept, and the finally blocks on the way run
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.func(args)
    except PostRLError as err:
        if args.debug:
            raise
        print(f"postrl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        if args.debug:
            raise
        name = _signal_name(stop)
        hint = CONTINUE_HINTS.get(args.command)
        print(f"postrl: {args.command} interrupted ({name})" + (f"; {hint}" if hint else ""),
              file=sys.stderr)
        return 128 + signal.Signals[name]
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
