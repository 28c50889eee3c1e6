"""A config file read as YAML 1.2 reads it, with the line of each option (for errors that
name it) and a refusal of options set twice."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from postrl.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-6`` (no dot) as a string and ``no``, ``yes``, ``on``, ``off`` as
    booleans (``resume=no`` became False); read them as YAML 1.2 does: the float a user
    means, and booleans only from true and false."""


# the class's own copy of the resolvers, without YAML 1.1's yes/no/on/off booleans
_Loader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool",
                              re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+"
               r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def parse_value(text: str) -> Any:
    """``text`` as YAML 1.2 reads it (see :class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """``(options, where)``: the file's mapping, and for each option (and ``group.option``)
    the ``path:line: `` that set it; ConfigError naming the file for anything else."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = _read_text(path)
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = parse_value(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if data is None:  # an empty file (or only comments)
        return {}, {}
    if not isinstance(data, dict):  # a list, or a scalar such as `0` or `false`
        raise ConfigError(f"{path}: the top level must be a mapping of options")
    _refuse_duplicate_keys(node, path)
    where: dict[str, str] = {}
    for key_node, value_node in node.value:
        where[key_node.value] = f"{path}:{key_node.start_mark.line + 1}: "
        if isinstance(value_node, yaml.MappingNode):
            for sub_key, _ in value_node.value:
                line = sub_key.start_mark.line + 1
                where[f"{key_node.value}.{sub_key.value}"] = f"{path}:{line}: "
    return data, where


def _read_text(path: Path) -> str:
    """The file as text: UTF-8, with or without a byte-order mark; ConfigError otherwise."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[err.start]:02x}); "
                          "save the file as UTF-8") from None


def _refuse_duplicate_keys(node: yaml.Node, path: Path) -> None:
    """YAML takes the last of two equal keys in silence; a config that sets an option twice
    is more likely a mistake, so name both lines."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                raise ConfigError(f"{path}:{line}: option {key_node.value!r} is set twice "
                                  f"(also on line {seen[key_node.value]}); keep one")
            seen[key_node.value] = line
            _refuse_duplicate_keys(value_node, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path)
