"""The recipes' command line before Hydra's app: overrides checked while composing, and ``--help``.

``recipes/train.py`` and ``recipes/finetune.py`` call :func:`check_command_line` before ``@hydra.main``. It
composes the config with Hydra's compose API (the schema registered, nothing else imported: no Lightning, no
process), so a misspelled key, an unknown option or a value of the wrong type stops in seconds with one message
naming it (``did you mean trainer.max_steps?``) and exit code 2, instead of Hydra's multi-line error (exit code 1)
and its hint ``+key=value``, which would add the misspelled key. Everything else (values, files, the checkpoint to
resume) is checked by :class:`~lightning_vescale.recipe.checks.CheckBeforeRun` right after, still before the run
directory or any process exists. ``--help`` prints every group with its options and every field of the composed
config with its type, value and description.

Processes that Lightning starts for the other local ranks (``LOCAL_RANK`` > 0) skip the check (rank 0 did it), as
do Hydra's own flags (``--cfg``, ``--multirun``, ``--hydra-help``, ...), which Hydra handles.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import os
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Union, cast

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from lightning_vescale.models.families import FAMILIES
from lightning_vescale.recipe.schema import FREE_FORM_SECTIONS, ModelConfig

__all__ = ["check_command_line", "compose_error_message", "render_help"]

_HELP_FLAGS = ("--help", "-h")


def check_command_line(config_dir: Union[str, Path], config_name: str, argv: Optional[Sequence[str]] = None) -> None:
    """Compose ``config_name`` from ``config_dir`` with the command line's overrides; on a mistake print
    ``<prog>: error: <message>`` to stderr and exit with code 2. ``--help`` prints :func:`render_help` and exits 0.

    Does nothing in a process Lightning started for another local rank, or when the command line has one of
    Hydra's own flags (Hydra handles those).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    prog = Path(sys.argv[0]).name or "recipe"
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    wants_help = any(a in _HELP_FLAGS for a in args)
    overrides = [a for a in args if a not in _HELP_FLAGS]
    if any(a.startswith("-") for a in overrides):
        return  # Hydra's flags (--cfg job, -m, --info, ...): Hydra composes and reports
    config_dir = str(Path(config_dir).resolve())
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        try:
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
        except Exception as err:  # noqa: BLE001 - every composition failure becomes one message
            message = compose_error_message(err, config_dir, config_name, overrides)
            sys.stderr.write(f"{prog}: error: {message}\n")
            raise SystemExit(2) from None
    if wants_help:
        sys.stdout.write(render_help(cfg, config_dir, f"python {sys.argv[0]}"))
        raise SystemExit(0)


# ----------------------------------------------------------------------------------------------------
# Messages
# ----------------------------------------------------------------------------------------------------


def _key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def _override_for(full_key: str, overrides: Sequence[str]) -> Optional[str]:
    return next((o for o in overrides if _key_of(o) == full_key), None)


def _first_line(err: BaseException) -> str:
    return str(err).strip().split("\n")[0].strip()


def _full_key(err: BaseException) -> Optional[str]:
    found = re.search(r"full_key: (\S+)", str(err))
    return found.group(1) if found else None


def _groups(config_dir: str) -> list[str]:
    return sorted(p.name for p in Path(config_dir).iterdir() if p.is_dir() and list(p.glob("*.yaml")))


def _keys_at(parent: str, config_dir: str, config_name: str, overrides: Sequence[str]) -> list[str]:
    """The keys of the node ``parent`` (``""``: the root, with the group names) of the config composed from
    ``overrides`` (those that compose), for suggestions."""
    try:
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    except Exception:  # noqa: BLE001 - no suggestions then
        return _groups(config_dir) if not parent else []
    node = cfg if not parent else OmegaConf.select(cfg, parent)
    keys = [str(k) for k in node] if isinstance(node, DictConfig) else []
    return sorted(set(keys) | (set(_groups(config_dir)) if not parent else set()))


def compose_error_message(err: BaseException, config_dir: str, config_name: str, overrides: Sequence[str]) -> str:
    """One message for a failure of Hydra's compose: the override, what is wrong and the fix."""
    script = "finetune.py" if config_name == "finetune" else "train.py"
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, option = err.missing_cfg_file.rsplit("/", 1)
        options = list(err.options or [])
        close = difflib.get_close_matches(option, options, n=2)
        hint = f" (did you mean {' or '.join(f'{group}={c}' for c in close)}?)" if close else ""
        return (f"{group}={option}: there is no option {option!r} in configs/{group}/{hint}; the options are "
                f"{', '.join(options)}")
    if isinstance(err, OverrideParseException):
        bad = next((o for o in overrides if not _parses(o)), None)
        return (f"cannot read the override {bad!r}: {_first_line(err)}. Write key=value (quote values with spaces "
                f"or brackets); see https://hydra.cc/docs/advanced/override_grammar/basic/")
    cause = err.__cause__ if isinstance(err, ConfigCompositionException) and err.__cause__ is not None else err
    full_key = _full_key(cause) if isinstance(cause, OmegaConfBaseException) else None
    if full_key is not None and re.match(r"Key '.*' (not in|is not in struct)", _first_line(cause)):
        parent, _, key = full_key.rpartition(".")
        rest = [o for o in overrides if _key_of(o) != full_key]
        candidates = _keys_at(parent, config_dir, config_name, rest)
        close = difflib.get_close_matches(key, candidates, n=2)
        prefix = f"{parent}." if parent else ""
        hint = f" (did you mean {' or '.join(prefix + c for c in close)}?)" if close else ""
        where = f"in {parent}" if parent else "at the top level"
        free = f"+notes.{key}=..." if key not in FREE_FORM_SECTIONS else "+notes.<key>=..."
        return (f"{full_key}: there is no key {key!r} {where}{hint}. python recipes/{script} --help lists every "
                f"key; to keep a value of your own with the run, put it under notes ({free})")
    if full_key is not None:
        override = _override_for(full_key, overrides) or full_key
        typed = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", _first_line(cause))
        if typed:
            kinds = {"Float": "a number", "Integer": "an integer", "Boolean": "true or false"}
            wanted = kinds.get(typed.group(2), typed.group(2).lower())
            return f"{override}: {full_key} must be {wanted}, got {typed.group(1)!r}"
        return f"{override}: {_first_line(cause)}"
    if isinstance(err, ConfigCompositionException) and err.__cause__ is not None:
        return f"{_first_line(err)}: {_first_line(err.__cause__)}"
    return _first_line(err)


def _parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_overrides([override])
    except OverrideParseException:
        return False
    return True


# ----------------------------------------------------------------------------------------------------
# --help
# ----------------------------------------------------------------------------------------------------


def _class_field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a class's source (``name: type = value`` then ``\"\"\"doc\"\"\"``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}  # a class made by make_dataclass has no source of its own
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.replace("``", "").split())
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """Every field's description of a schema class: its own and its bases' field docstrings, and for a model
    schema those of the model families' configs (``LlamaConfig``, ...), whose fields it mirrors."""
    docs: dict[str, str] = {}
    sources = list(cls.__mro__)
    if issubclass(cls, ModelConfig):
        sources += [family.config_cls for family in FAMILIES.values()]
    for source in sources:
        for name, doc in _class_field_docs(source).items():
            docs.setdefault(name, doc)
    return docs


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp.replace("typing.", "")
    if typing.get_origin(tp) is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _type_name(args[0]) if len(args) == 1 else " | ".join(_type_name(a) for a in args)
        return f"Optional[{inner}]" if type(None) in typing.get_args(tp) else inner
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _value(node: Any, key: str) -> str:
    try:
        value = node._get_node(key)
        if value._is_missing():
            return "???"
        raw = OmegaConf.to_container(value, resolve=False) if isinstance(value, (DictConfig, ListConfig)) else \
            value._value()
    except OmegaConfBaseException:
        return "?"
    if raw is None:
        return "null"
    if isinstance(raw, bool):
        return str(raw).lower()
    if isinstance(raw, dict):
        return "{" + ", ".join(sorted(map(str, raw))) + "}" if raw else "{}"
    return str(raw)


def _preset_values(node: DictConfig) -> dict[str, Any]:
    """The model's values where the model section leaves a field null (the preset's or the checkpoint's)."""
    try:
        arch = cast(ModelConfig, OmegaConf.to_object(node)).build_config()
    except Exception:  # noqa: BLE001 - an invalid model is reported when the run is checked
        return {}
    return {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)}


def _field_lines(node: DictConfig, prefix: str, width: int) -> list[str]:
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []
    docs = field_docs(schema)
    preset = _preset_values(node) if issubclass(schema, ModelConfig) else {}
    lines = []
    for f in dataclasses.fields(schema):
        if f.name not in node:
            continue
        full = f"{prefix}{f.name}"
        child = node._get_node(f.name)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing() and \
                dataclasses.is_dataclass(OmegaConf.get_type(child)):
            lines.extend(_field_lines(child, f"{full}.", width))
            continue
        value = _value(node, f.name)
        shown = f"null (the preset's: {preset[f.name]})" if value == "null" and f.name in preset else value
        lines.append(f"  {full}: {_type_name(f.type)} = {shown}")
        if f.name in docs:
            lines.extend(textwrap.wrap(docs[f.name], width=width, initial_indent="      ", subsequent_indent="      "))
    return lines


def render_help(cfg: DictConfig, config_dir: str, prog: str, width: int = 110) -> str:
    """The groups (options, the chosen one first) and every field of ``cfg`` (composed with
    ``return_hydra_config=True``): type, current value and description."""
    choices = dict(cfg.hydra.runtime.choices)
    out = [f"usage: {prog} [group=option ...] [key=value ...] [+notes.<key>=value ...]", "",
           "Groups (configs/<group>/; pick one option with group=option; the chosen one in brackets):"]
    for group in _groups(config_dir):
        options = sorted(p.stem for p in (Path(config_dir) / group).glob("*.yaml"))
        chosen = choices.get(group)
        listed = ", ".join(f"[{o}]" if o == chosen else o for o in options)
        out.extend(textwrap.wrap(f"{group}: {listed}" + ("" if chosen else "  (none chosen: null)"), width=width,
                                 initial_indent="  ", subsequent_indent="      "))
    task = copy.deepcopy(cfg)
    with read_write(task), open_dict(task):
        task.pop("hydra", None)
    out += ["", "Fields (key: type = value as composed now; set one with key=value, e.g. trainer.max_steps=500).",
            "A group that is null (quant, memory, ...) lists its fields once chosen: --help memory=budget.", ""]
    out += _field_lines(task, "", width)
    out += ["", "notes: free-form (+notes.purpose=sweep), kept in .hydra/config.yaml and summary.json.",
            "Hydra's own flags (--cfg job, --multirun, ...): --hydra-help.", ""]
    return "\n".join(out)
