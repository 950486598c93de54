"""Plans on disk: the named plans of ``configs/plan/`` (the recipes' ``plan=<name>`` group) and plan files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Union

from lightning_vescale.plan._spec import Plan, PlanError

__all__ = ["PLAN_DIR", "load_plan", "plan_names", "read_plan_file"]

PLAN_DIR = Path(__file__).resolve().parents[2] / "configs" / "plan"
"""The repository's plan presets (the Hydra group ``plan``)."""


def plan_names() -> list[str]:
    """Names of the plans in :data:`PLAN_DIR`."""
    return sorted(p.stem for p in PLAN_DIR.glob("*.yaml")) if PLAN_DIR.is_dir() else []


def read_plan_file(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The dict in a plan YAML file (safe loader: no tags, no code)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise PlanError(f"cannot read the plan file {str(path)!r}: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise PlanError(f"the plan file {str(path)!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise PlanError(f"the plan file {str(path)!r} must hold a mapping with 'rules', got {type(data).__name__}")
    return data


def load_plan(source: Union[str, os.PathLike, Mapping[str, Any], Plan]) -> Plan:
    """A plan from a :class:`Plan`, its dict form, a YAML file, or the name of a plan in ``configs/plan/``."""
    if isinstance(source, Plan):
        return source
    if isinstance(source, Mapping):
        return Plan.from_dict(source)
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.exists():
        data = read_plan_file(path)
    else:
        named = PLAN_DIR / f"{source}.yaml"
        if not named.is_file():
            raise PlanError(
                f"no plan named {str(source)!r}: give a YAML file or one of {', '.join(plan_names()) or '(none found)'} "
                f"(from {PLAN_DIR})"
            )
        data = read_plan_file(named)
    try:
        return Plan.from_dict(data)
    except PlanError as err:
        raise PlanError(f"{source}: {err}") from None
