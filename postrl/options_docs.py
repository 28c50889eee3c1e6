"""Every option of a run with its type, default and help: ``postrl options`` and docs/options.md.

The help is declared once, on the fields themselves (:func:`postrl.options.opt` in
``postrl/config.py`` and ``postrl/recipes.py``); this module only groups and prints it. Run
``python -m postrl.options_docs`` after adding or changing an option; a test fails while
``docs/options.md`` and the fields disagree, and for any field without help.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from postrl.components import COMPONENTS
from postrl.config import TrainConfig
from postrl.errors import ConfigError
from postrl.options import help_of
from postrl.recipes import PRESETS, Recipe, get_recipe

DOCS_PATH = Path(__file__).resolve().parents[1] / "docs" / "options.md"

# TrainConfig's fields by section, in the order config.py declares them (a test holds the two
# to the same order); a field missing here is still printed, under UNGROUPED.
TRAIN_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("what is trained, on what", ("recipe", "recipe_options", "model", "lora", "task",
                                  "task_options", "system_prompt", "teacher", "rewards")),
    ("the schedule shared by every recipe of a comparison",
     ("prompts_per_step", "group_size", "temperature", "top_p", "top_k", "max_new_tokens",
      "max_turns", "env_reward_at", "stop", "steps", "token_budget", "lr", "lr_schedule",
      "warmup_steps", "weight_decay", "adam_betas", "max_grad_norm")),
    ("precision and speed", ("precision", "sampler_precision", "torch_compile",
                             "gradient_checkpointing", "backend", "device",
                             "reuse_sampler_forward")),
    ("the schedule: updates on each batch", ("epochs", "minibatches", "micro_batch_size",
                                             "micro_batch_tokens", "critic_lr",
                                             "critic_warmup_steps")),
    ("evaluation during training, and frozen rollout batches for postrl replay",
     ("eval_every", "eval_n", "eval_samples", "save_rollouts_every")),
    ("reliability (docs/reliability.md)", ("save_every", "keep_last", "resume",
                                           "max_skipped_steps", "reward_errors",
                                           "reward_timeout_s")),
    ("stale samples drawn beside the trainer (the recipe's max_staleness; docs/scaling.md)",
     ("overlap_sampling",)),
    ("scaling out on Ray (docs/scaling.md)", ("launcher", "rollout_workers", "train_workers",
                                              "rollout_backend", "ray_address", "worker_cpus",
                                              "worker_gpus", "train_parallel", "weight_sync")),
    ("vLLM (rollout_backend=vllm)", ("vllm_gpu_memory_utilization", "vllm_max_model_len",
                                     "vllm_enforce_eager", "vllm_kv_cache_gb")),
    ("the run", ("seed", "sampling_seed", "out", "overwrite", "log_samples", "report_to", "threads",
                 "reuse_freed_memory", "quiet")),
)
UNGROUPED = "not yet in a group (postrl/options_docs.py: TRAIN_GROUPS)"
RECIPE_PREFIX = "recipe_options."
NO_DEFAULT = object()  # a group of options (lora), or a recipe's name


@dataclass(frozen=True)
class Option:
    name: str  # as set in YAML or key=value: lr, lora.r, recipe_options.clip_high
    type: str
    default: Any
    help: str
    presets: tuple[tuple[str, Any], ...] = ()  # recipe components: presets that set another value


def _type_name(field: dataclasses.Field) -> str:
    return field.type if isinstance(field.type, str) else getattr(field.type, "__name__",
                                                                  str(field.type))


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return NO_DEFAULT


def _options(cls: type, prefix: str = "") -> dict[str, list[Option]]:
    """Each field of ``cls`` by name: its option, and for a dataclass of options (``lora``)
    the row of the group followed by one per member."""
    found: dict[str, list[Option]] = {}
    for field in dataclasses.fields(cls):
        default = _default(field)
        nested = dataclasses.is_dataclass(default)
        row = Option(prefix + field.name, _type_name(field), NO_DEFAULT if nested else default,
                     help_of(field))
        members = [m for rows in _options(type(default), f"{row.name}.").values()
                   for m in rows] if nested else []
        found[field.name] = [row, *members]
    return found


def train_groups() -> list[tuple[str, list[Option]]]:
    """TrainConfig's options by section, as TRAIN_GROUPS orders them."""
    by_field = _options(TrainConfig)
    groups = [(title, [o for name in names if name in by_field for o in by_field[name]])
              for title, names in TRAIN_GROUPS]
    listed = {name for _, names in TRAIN_GROUPS for name in names}
    rest = [o for name, rows in by_field.items() if name not in listed for o in rows]
    return groups + ([(UNGROUPED, rest)] if rest else [])


def recipe_groups(recipe: Recipe | None = None) -> list[tuple[str, list[Option]]]:
    """The recipe's components as ``recipe_options.<name>`` options, grouped as ``postrl
    explain`` groups them. Defaults are ``recipe``'s values; without one, Recipe's own
    defaults, each with the presets that set another value."""
    fields = {f.name: f for f in dataclasses.fields(Recipe)}

    def option(name: str) -> Option:
        field = fields[name]
        default = getattr(recipe, name) if recipe is not None else _default(field)
        presets = () if recipe is not None or default is NO_DEFAULT else tuple(
            (p.name, getattr(p, name)) for p in PRESETS.values() if getattr(p, name) != default)
        return Option(RECIPE_PREFIX + name, _type_name(field), default, help_of(field), presets)

    owned = [name for c in COMPONENTS for name in c.fields]
    groups = [("the recipe", [option(n) for n in fields if n not in owned])]
    return groups + [(c.title, [option(n) for n in c.fields]) for c in COMPONENTS]


def all_groups(recipe: Recipe | None = None) -> list[tuple[str, list[Option]]]:
    return train_groups() + recipe_groups(recipe)


def missing_help() -> list[str]:
    """Options whose field declares no help (every one must)."""
    return [o.name for _, options in all_groups() for o in options if not o.help.strip()]


def format_value(value: Any) -> str:
    """A value as it is written in YAML or after ``key=value``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        try:
            plain = bool(value) and yaml.safe_load(value) == value
        except yaml.YAMLError:
            plain = False
        return value if plain else repr(value)  # 'no' is false in YAML
    if isinstance(value, list | tuple):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


# ---- postrl options ------------------------------------------------------------------------


def _matching(groups, pattern: str | None):
    if not pattern:
        return groups
    return [(title, kept) for title, options in groups
            if (kept := [o for o in options if pattern in o.name])]


_KEEP_TOGETHER = ("eq. ", "eqs. ", " = ")  # never break a line inside "eq. 7" or "1 = off"


def _wrap(text: str, width: int, indent: str) -> list[str]:
    for joined in _KEEP_TOGETHER:
        text = text.replace(joined, joined.replace(" ", "\0"))
    lines = textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent,
                          break_on_hyphens=False)
    return [line.replace("\0", " ") for line in lines]


def render_text(recipe: str | None = None, pattern: str | None = None, width: int = 100) -> str:
    """What ``postrl options`` prints: every option (or those whose name contains
    ``pattern``) with its type, default and help, the recipe components as ``recipe`` sets
    them (default: TrainConfig's default recipe)."""
    preset = get_recipe(recipe or _default(TrainConfig.__dataclass_fields__["recipe"]))
    sections = [("", train_groups()),
                (f"recipe components (recipe_options.<name>), as recipe {preset.name} sets them; "
                 "postrl options --recipe NAME shows another's", recipe_groups(preset))]
    chosen = [(head, _matching(groups, pattern)) for head, groups in sections]
    if not any(groups for _, groups in chosen):
        names = {o.name.rpartition(".")[2]: o.name  # clip_high for recipe_options.clip_high
                 for _, groups in sections for _, opts in groups for o in opts}
        close = [names[n] for n in difflib.get_close_matches(pattern, names, n=3)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"no option's name contains {pattern!r}{hint}")
    lines = textwrap.wrap("Options of postrl train, set in a YAML file (--config) or as "
                          "key=value, dotted for groups (lora.r=16); values are YAML (null, "
                          "true, [a, b]). The same list: docs/options.md.", width)
    indent = " " * 6
    for head, groups in chosen:
        if head and groups:
            lines += ["", *textwrap.wrap(head.upper()[:1] + head[1:], width)]
        for title, options in groups:
            lines += ["", title]
            for o in options:
                value = "" if o.default is NO_DEFAULT else f" = {format_value(o.default)}"
                lines.append(f"  {o.name}: {o.type}{value}")
                lines += _wrap(o.help, width, indent)
    return "\n".join(lines) + "\n"


# ---- docs/options.md -----------------------------------------------------------------------

INTRO = """\
# Options

<!-- Generated by `python -m postrl.options_docs` from the fields of postrl/config.py and
     postrl/recipes.py. Edit the help there, then regenerate; do not edit this file by hand. -->

Every option of a run is a field of `TrainConfig` (`postrl/config.py`), and every component of
a recipe a field of `Recipe` (`postrl/recipes.py`); each field carries the one line of help
listed here. Set them in a YAML file (`postrl train --config run.yaml`) or as `key=value` after
`postrl train`, dotted for groups: `lora.r=16`, `recipe_options.clip_high=0.28`. Values are
YAML: `null`, `true`, `[a, b]`. A run's `config.yaml` holds every option it ran with, the
recipe's components resolved; `postrl train --config RUN/config.yaml out=AGAIN` runs it again
(the resolved components must match `recipe` and `recipe_options`).

`postrl options` prints this list in the terminal (so does `postrl train --help`, after its
flags); `postrl options clip` prints only the options whose name contains `clip`, and
`postrl options --recipe dapo` the recipe components as the `dapo` preset sets them.
"""

RECIPE_INTRO = """\
## Recipe components (`recipe_options.<name>`)

A recipe (`recipe=dapo`) is a preset of these components, and `recipe_options` changes any of
them for one run. The defaults below are `Recipe`'s; each preset sets its own, listed in the
column "presets that differ". `postrl explain NAME` shows a preset's components with their
papers and formulas, `postrl recipes --all` all presets side by side, and
[recipes.md](recipes.md) the choices postrl makes where sources differ. Groups are the
components of `postrl explain`.
"""


def _cell(text: str) -> str:
    """Text made safe inside a Markdown table cell (``<seed>`` is not an HTML tag)."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _code(value: Any) -> str:
    return f"`{format_value(value)}`".replace("|", "\\|")


def _table(options: list[Option], with_presets: bool) -> list[str]:
    head = ["option", "type", "default", *(["presets that differ"] * with_presets), "meaning"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for o in options:
        default = "" if o.default is NO_DEFAULT else _code(o.default)
        cells = [f"`{o.name}`", f"`{o.type}`".replace("|", "\\|"), default]
        if with_presets:
            cells.append(", ".join(f"{name} {_code(v)}" for name, v in o.presets))
        lines.append("| " + " | ".join([*cells, _cell(o.help)]) + " |")
    return lines


def render_markdown() -> str:
    """The whole of ``docs/options.md``."""
    lines = [INTRO, "## Training options"]
    for title, options in train_groups():
        lines += ["", f"### {title}", "", *_table(options, with_presets=False)]
    lines += ["", RECIPE_INTRO.rstrip("\n")]
    for title, options in recipe_groups():
        lines += ["", f"### {title}", "", *_table(options, with_presets=True)]
    return "\n".join(lines) + "\n"


def write_docs(path: Path = DOCS_PATH) -> Path:
    """Write :func:`render_markdown` to ``path`` and return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(), encoding="utf-8")
    return path


def write_readme_recipes(readme: Path) -> Path:
    """Replace the recipe table in ``readme`` (the block of table lines under its header row)
    with what ``postrl recipes --all --markdown`` prints."""
    from postrl.components import TABLE_COLUMNS, markdown_table

    lines = readme.read_text(encoding="utf-8").split("\n")
    header = "| " + " | ".join(TABLE_COLUMNS) + " |"
    if header not in lines:
        raise ConfigError(f"{readme}: no recipe table (a line {header!r}) to replace")
    start = end = lines.index(header)
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = markdown_table(list(PRESETS.values())).split("\n")
    readme.write_text("\n".join(lines), encoding="utf-8")
    return readme


def main(argv: list[str] | None = None) -> int:
    """``python -m postrl.options_docs [PATH] [--readme README]``: write the options page,
    and with ``--readme`` the README's recipe table."""
    args = list(sys.argv[1:] if argv is None else argv)
    readme = None
    if "--readme" in args:
        at = args.index("--readme")
        if at + 1 == len(args):
            print("--readme needs the README's path (--readme README.md)", file=sys.stderr)
            return 2
        readme, args[at:at + 2] = Path(args[at + 1]), []
    missing = missing_help()
    if missing:
        print(f"options without help: {', '.join(missing)}; give each field "
              "opt(default, \"help\")", file=sys.stderr)
        return 1
    written = write_docs(Path(args[0]) if args else DOCS_PATH)
    print(f"wrote {written}")
    if readme is not None:
        print(f"wrote the recipe table of {write_readme_recipes(readme)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
