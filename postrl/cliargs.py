"""argparse helpers shared by the ``postrl`` subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def accept_intermixed(parser: argparse.ArgumentParser) -> None:
    """argparse fills positionals from one run of arguments only, so ``grpo dapo --seeds 2
    steps=3`` would reject ``steps=3``: collect such later positionals as overrides (a subparser
    is parsed with ``parse_known_args``, which this wraps)."""
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        namespace, extras = original(args, namespace)
        later = [e for e in extras if not e.startswith("-")]
        namespace.overrides = [*(namespace.overrides or []), *later]
        return namespace, [e for e in extras if e.startswith("-")]

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def append_to_help(parser: argparse.ArgumentParser, text: Callable[[], str]) -> None:
    """Print ``text()`` after the parser's own help (built only when help is asked for)."""
    original = parser.format_help

    def format_help() -> str:
        return original() + text()

    parser.format_help = format_help  # type: ignore[method-assign]
