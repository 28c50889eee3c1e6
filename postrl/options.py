"""``opt(default, "help")``: a dataclass field that carries its one line of help.

Every field of :class:`~postrl.config.TrainConfig`, :class:`~postrl.config.LoraConfig` and
:class:`~postrl.recipes.Recipe` is declared with it, so the help sits next to the field and is
written once. ``postrl options`` and ``docs/options.md`` (``python -m postrl.options_docs``)
print it; a test fails for a field without help. The help lives in the field's ``metadata``,
which ``dataclasses.asdict``, ``replace`` and equality ignore: declaring a field this way
changes nothing else about it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

HELP = "help"  # the metadata key


def opt(default: Any = dataclasses.MISSING, doc: str = "", *,
           factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with ``default`` (or ``factory`` for a mutable one) and help ``doc``:
    what the option is, its unit where it has one, and where it comes from."""
    metadata = {HELP: doc}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def help_of(field: dataclasses.Field) -> str:
    """The help of a field declared with :func:`opt`; "" for any other."""
    return field.metadata.get(HELP, "")
