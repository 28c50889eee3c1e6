"""The ``postrl`` command.

Subcommands so far: ``recipes`` (the component table) and ``explain`` (what a recipe is made
of, or exactly how two recipes differ). Errors a user can fix are printed without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from postrl.components import COMPONENTS, TABLE_COLUMNS, differing, markdown_table, summary_row
from postrl.errors import PostRLError
from postrl.recipes import CORE, PRESETS, get_recipe


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
    recipe = get_recipe(args.recipe)
    if args.vs is None:
        print(f"{recipe.name}: its components")
        components = list(COMPONENTS)
    else:
        base = get_recipe(args.vs)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="postrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    recipes = sub.add_parser("recipes", help="print the component table of every recipe")
    recipes.add_argument("--all", action="store_true", help="include the optional extras")
    recipes.add_argument("--markdown", action="store_true", help="print a Markdown table")
    recipes.set_defaults(func=cmd_recipes)
    explain = sub.add_parser("explain", help="a recipe's components, or its difference to another")
    explain.add_argument("recipe")
    explain.add_argument("--vs", metavar="OTHER", help="list only the components that differ")
    explain.set_defaults(func=cmd_explain)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PostRLError as err:
        print(f"postrl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
