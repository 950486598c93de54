"""Resolve a :class:`~lightning_vescale.plan.Plan` against a model: exactly one policy per parameter.

Pure: it reads names, shapes, dtypes and module classes only (a meta-device model does), never data, and
needs no process group, so every error surfaces before anything is created.

[Note: how values are chosen]
For each group and each parameter, and each field:

1. the rules whose glob matches it (a parameter is also matched through any module that contains it), in
   plan order: the first sets the value; a later one with a *different* value is a conflict unless it says
   ``override: true``, which replaces it (an equal value is fine);
2. else, for ``granularity`` only, the model's own declaration ``param._vescale_granularity``;
3. else the plan's ``fallback``; else the caller's (a strategy's arguments, the Trainer's precision);
4. else the library default (element granularity, ``auto`` routing, reshard after forward, prefetch 1; no
   ``tier``: the run's ``MemoryPolicy`` places that state).

``tier`` is chosen class by class (``params``, ``grads``, ``optimizer_states``), so rules placing different
classes of the same parameter combine, and the classes of one DBuffer's parameters must agree on the weights'
and gradients' tiers (see [Note: tiers in a plan] in :mod:`lightning_vescale.plan._spec`).

``granularity: muon`` then becomes what :func:`~lightning_vescale.optim.muon_granularity` gives the
parameter under the plan's routing, and ``optimizer: auto`` what
:func:`~lightning_vescale.optim.route_parameters` gives it, so the table shows the concrete values.

Groups: the roots (the model, or the modules a strategy names) and every module a rule makes a group; a
parameter belongs to the innermost group that contains every module using it (as nested ``fully_shard``
calls assign it). Rules that match nothing, parameters tied across groups, conflicts and parameters
without a required field are errors, all reported together.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

import torch.nn as nn

from lightning_vescale.engine.fully_shard import get_state
from lightning_vescale.engine.planner import granularity_numel
from lightning_vescale.engine.tensor import is_sharded_param
from lightning_vescale.plan._glob import glob_matches
from lightning_vescale.plan._spec import (
    GROUP_FIELDS,
    PARAM_FIELDS,
    TIER_CLASSES,
    Plan,
    PlanError,
    Rule,
    _check_value,
    dtype_name,
    tier_classes,
    tp_style_name,
)

__all__ = ["GroupPolicy", "ParamPolicy", "ResolvedPlan", "default_plan", "plan_from_modules", "resolve_plan"]

LIBRARY_DEFAULTS: dict[str, Any] = {
    "group": False, "reshard_after_forward": True, "prefetch": 1, "param_dtype": None, "reduce_dtype": None,
    "granularity": "element", "optimizer": "auto", "quantization": "none", "tier": None,
}
"""``tier: None``: the run's ``MemoryPolicy`` places the classes no rule places."""
_MAX_LISTED = 8

GranularityFallback = Callable[[str, str, nn.Parameter], Any]
"""``(full name, name inside its group's module, parameter) -> granularity``: a caller's legacy argument."""


@dataclass(frozen=True)
class ParamPolicy:
    """How one parameter is sharded and optimized, with where each value came from."""

    name: str
    """Full-model name (the first, for a parameter used under several names)."""
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    group: str
    """Name of the module whose group holds it (``""``: the model itself)."""
    granularity: Union[str, int]
    """As ``fully_shard`` takes it: ``element``, ``row``, ``tensor`` or a number of rows."""
    optimizer: str
    """``muon``, ``adamw`` or ``none`` (no gradient)."""
    quantization: str
    tier: Mapping[str, str] = field(default_factory=dict)
    """Class (``params``, ``grads``, ``optimizer_states``) -> tier, for the classes the plan places; the run's
    ``MemoryPolicy`` places the others (see [Note: tiers in a plan] in :mod:`lightning_vescale.plan._spec`)."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Field -> where the value came from (``rule #2``, ``defaults``, ``library default`` ...)."""
    aliases: tuple[str, ...] = ()
    """Other names of the same parameter (tied weights)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def tier_of(self, cls: str) -> Optional[str]:
        """The tier the plan gives this parameter's ``cls`` state (None: the memory policy's)."""
        return self.tier.get(cls)

    @property
    def tier_setting(self) -> Union[str, dict[str, str], None]:
        """:attr:`tier` as a plan writes it: one name when it places every class alike, else the mapping."""
        values = set(self.tier.values())
        if len(self.tier) == len(TIER_CLASSES) and len(values) == 1:
            return values.pop()
        return dict(self.tier) or None

    @property
    def tier_label(self) -> str:
        """For tables: ``disk``, ``params=disk,optimizer_states=disk`` or ``-`` (the memory policy places it)."""
        setting = self.tier_setting
        if setting is None:
            return "-"
        return setting if isinstance(setting, str) else ",".join(f"{k}={v}" for k, v in setting.items())

    @property
    def route_is_explicit(self) -> bool:
        """Whether the plan chose the optimizer (rather than the routing defaults)."""
        return not self.sources.get("optimizer", "").startswith(("library default", "auto"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape), "dtype": self.dtype, "requires_grad": self.requires_grad, "group": self.group,
            "granularity": self.granularity, "optimizer": self.optimizer, "quantization": self.quantization,
            **({"tier": self.tier_setting} if self.tier else {}),
            "sources": dict(self.sources), **({"aliases": list(self.aliases)} if self.aliases else {}),
        }


@dataclass(frozen=True)
class GroupPolicy:
    """One group: a ``fully_shard`` call on the module ``name`` and its settings."""

    name: str
    """Module name (``""``: the model itself)."""
    module_type: str
    params: tuple[str, ...]
    """Full names of the parameters it holds, in module order."""
    is_root: bool
    reshard_after_forward: bool
    prefetch: int
    param_dtype: Optional[str]
    reduce_dtype: Optional[str]
    sources: Mapping[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name or "<root>"

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.module_type, "root": self.is_root, "reshard_after_forward": self.reshard_after_forward,
            "prefetch": self.prefetch, "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
            "sources": dict(self.sources), "params": list(self.params),
        }


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan applied to a model: its groups (in ``fully_shard`` order, innermost first) and one
    :class:`ParamPolicy` per parameter. Print it with :meth:`table`; serialize it with :meth:`to_yaml`."""

    plan: Plan
    model_type: str
    groups: tuple[GroupPolicy, ...]
    params: Mapping[str, ParamPolicy]
    tensor_parallel: Mapping[str, Any] = field(default_factory=dict)
    """Module name -> tensor-parallel style (``colwise``, ``rowwise``, ``sequence``, ``replicate``) from the plan's
    ``tp`` rules; applied only on a mesh with a ``tp`` dimension."""

    def group(self, name: str) -> GroupPolicy:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group named {name!r}; groups: {[g.label for g in self.groups]}")

    def policy(self, name: str) -> ParamPolicy:
        if name in self.params:
            return self.params[name]
        for p in self.params.values():
            if name in p.aliases:
                return p
        raise KeyError(f"no parameter named {name!r}")

    def group_params(self, group: GroupPolicy) -> list[ParamPolicy]:
        return [self.params[n] for n in group.params]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_type,
            "plan": self.plan.to_dict(),
            "groups": {g.label: g.to_dict() for g in self.groups},
            "params": {n: p.to_dict() for n, p in self.params.items()},
            "tensor_parallel": dict(self.tensor_parallel),
        }

    def to_yaml(self) -> str:
        """The resolved plan as YAML: the plan as written, then every group and parameter with its values and
        their sources (a file to keep next to a run, or to diff between two plans)."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False, width=120)

    def table(self, world_size: Optional[int] = None, *, params: bool = False) -> str:
        """Per group: parameters, elements, bytes, granularity, settings; with ``world_size`` also the
        planner's shard size and padding. ``params=True`` adds one line per parameter."""
        from lightning_vescale.plan._table import format_table

        return format_table(self, world_size, params=params)

    def __str__(self) -> str:
        return self.table()


# --------------------------------------------------------------------------------------------------------
# Default plans


def _is_block_list(module: nn.Module) -> bool:
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    if len({type(m) for m in module}) != 1:
        return False
    return any(True for _ in module[0].parameters())


def default_plan(model: nn.Module) -> Plan:
    """The plan used when none is given: every element of an ``nn.ModuleList`` of identical blocks (e.g.
    transformer layers) is a group, as FSDP2 users apply ``fully_shard`` per block; and an untied
    ``nn.Embedding`` beside such a list (the token embedding) is a group of its own, freed after forward and not
    gathered for backward (see [Note: the embedding's own group])."""
    rules: list[dict[str, Any]] = [{"match": _escape(name), "group": True} for name in embedding_groups(model)]

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if _is_block_list(child):
                rules.append({"match": f"{full}.*", "group": True})
            else:
                visit(child, f"{full}.")

    visit(model, "")
    return Plan.from_dict({"name": "default", "rules": rules})


def embedding_groups(model: nn.Module) -> list[str]:
    """The names of the untied ``nn.Embedding`` s beside an ``nn.ModuleList`` of identical blocks (the token
    embedding), which the default plan makes groups of their own (see [Note: the embedding's own group]);
    :func:`~lightning_vescale.parallel.fully_shard_expert_parallel` does too."""
    names: list[str] = []
    tied = _tied_parameter_ids(model)

    def visit(module: nn.Module, prefix: str) -> None:
        children = list(module.named_children())
        if any(_is_block_list(child) for _, child in children):
            names.extend(f"{prefix}{name}" for name, child in children
                         if isinstance(child, nn.Embedding) and id(child.weight) not in tied)
        for name, child in children:
            if not _is_block_list(child):
                visit(child, f"{prefix}{name}.")

    visit(model, "")
    return names


# [Note: the embedding's own group]
# In the root group, the token embedding's gradient buffer is allocated at the root's first gradient (the
# head's, at the start of backward) but is written only at its very end, so it adds its full size to the
# backward peak; as a group of its own its gradient buffer exists only for the embedding's backward. Its
# backward reads no weight (autograd keeps the indices), so the group is freed after forward and not gathered
# again (``ParamGroup.backward_reads_params``): one AllGather per step, as in the root, and no gathered
# embedding in the forward's or the backward's peak. Measured: benchmarks/results/train.md.


def _tied_parameter_ids(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def plan_from_modules(model: nn.Module, modules: Iterable[nn.Module], name: str = "auto_wrap_policy") -> Plan:
    """A plan whose groups are exactly ``modules`` (what an ``auto_wrap_policy`` selected), by name; every
    element of a ``ModuleList`` selected at once becomes one ``<list>.*`` rule."""
    chosen = {id(m) for m in modules}
    names = {id(m): n for n, m in model.named_modules()}
    rules: list[dict[str, Any]] = []
    covered: set[int] = set()
    for list_name, lst in model.named_modules():
        if isinstance(lst, (nn.ModuleList, nn.ModuleDict)) and len(lst) and all(id(c) in chosen for c in lst.children()):
            if any(id(c) in covered for c in lst.children()):
                continue
            rules.append({"match": f"{list_name}.*" if list_name else "*", "group": True})
            covered.update(id(c) for c in lst.children())
    for m in modules:
        if id(m) not in covered and id(m) in names:
            rules.append({"match": _escape(names[id(m)]), "group": True})
    return Plan.from_dict({"name": name, "rules": rules})


def _escape(name: str) -> str:
    return re.sub(r"([*?\[\]])", r"[\1]", name)


# --------------------------------------------------------------------------------------------------------
# Resolution


class _RuleLike(Protocol):
    """What choosing reads of a rule: a :class:`Rule`, or a :class:`_PartialRule` view of one."""

    @property
    def index(self) -> int: ...

    @property
    def override(self) -> bool: ...

    def settings(self) -> dict[str, Any]: ...

    def describe(self) -> str: ...


class _Chooser:
    """Field values from the rules, in plan order, with conflicts collected."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems

    def choose(self, what: str, name: str, rules: Sequence[_RuleLike]) -> dict[str, tuple[Any, str]]:
        chosen: dict[str, tuple[Any, _RuleLike]] = {}
        for rule in rules:
            for key, value in rule.settings().items():
                if key not in chosen or rule.override:
                    chosen[key] = (value, rule)
                elif chosen[key][0] != value:
                    first = chosen[key][1]
                    self.problems.append(
                        f"conflict on {what} {name!r}: {first.describe()} sets {key}={chosen[key][0]!r} but "
                        f"{rule.describe()} sets {key}={value!r}; narrow one glob, or add override: true to the "
                        f"later rule if it should win"
                    )
        return {k: (v, f"rule #{r.index + 1}") for k, (v, r) in chosen.items()}


def _suggest(pattern: str, names: Sequence[str]) -> str:
    literal = pattern.replace("**.", "").replace("*", "0")
    close = difflib.get_close_matches(literal, names, n=3, cutoff=0.5)
    return f"; close names: {', '.join(close)}" if close else ""


def _ancestors(name: str) -> list[str]:
    """Module names containing ``name``: ``a.b.c`` -> ``["a.b", "a", ""]``."""
    out = []
    while name:
        name = name.rpartition(".")[0]
        out.append(name)
    return out


def resolve_plan(
    model: nn.Module,
    plan: Union[Plan, Mapping[str, Any], None] = None,
    *,
    roots: Optional[Sequence[nn.Module]] = None,
    defaults: Optional[Mapping[str, Any]] = None,
    granularity_fallback: Optional[GranularityFallback] = None,
) -> ResolvedPlan:
    """Apply ``plan`` to ``model`` (see the module docstring); raises :class:`PlanError` listing every problem.

    Args:
        model: the model, usually unsharded (on any device, the meta device included). Modules that
            ``fully_shard`` already sharded are left out.
        plan: a :class:`Plan` or its dict form; ``None``: :func:`default_plan`.
        roots: the modules that are groups besides those the rules name, outermost (default: ``[model]``). A
            parameter under none of them puts ``model`` itself in a group too (as FSDP2's root takes it).
        defaults: the caller's values below the plan's ``fallback`` (e.g. ``{"param_dtype": "bfloat16"}``
            from the Trainer's precision).
        granularity_fallback: for parameters whose granularity nothing else sets (a strategy's legacy
            ``granularity`` mapping or callable).
    """
    plan = default_plan(model) if plan is None else Plan.from_dict(plan)
    caller = {k: _check_value(k, v, "defaults given by the caller") for k, v in (defaults or {}).items() if v is not None}
    problems: list[str] = []
    chooser = _Chooser(problems)

    # Names. Modules already sharded by fully_shard (and everything below them) are not the plan's business.
    sharded_prefixes = [n for n, m in model.named_modules() if get_state(m) is not None and m is not model]

    def excluded(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in sharded_prefixes)

    module_names: dict[int, list[str]] = {}
    modules_by_name: dict[str, nn.Module] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if excluded(name):
            continue
        module_names.setdefault(id(m), []).append(name)
        modules_by_name[name] = m
    param_names: dict[int, list[str]] = {}
    param_objs: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if excluded(name.rpartition(".")[0]) or is_sharded_param(p):
            continue
        param_names.setdefault(id(p), []).append(name)
        param_objs[id(p)] = p
    all_param_names = [n for names in param_names.values() for n in names]
    all_module_names = list(modules_by_name)

    # Which rules match which names.
    rule_modules: dict[int, set[str]] = {}
    rule_params: dict[int, set[str]] = {}
    for rule in plan.rules:
        mods = {n for n in all_module_names if glob_matches(rule.match, n)}
        pars = {n for n in all_param_names if glob_matches(rule.match, n)}
        rule_modules[rule.index], rule_params[rule.index] = mods, pars
        if not mods and not pars:
            problems.append(
                f"{rule.describe()} matches no module or parameter of {type(model).__name__} (a glob typo, or a "
                f"plan for another model? '*' stays within one name segment, '**' spans segments)"
                + _suggest(rule.match, all_module_names + all_param_names)
            )
            continue
        group_keys = [k for k in rule.settings() if k in GROUP_FIELDS]
        if group_keys and not mods:
            problems.append(
                f"{rule.describe()} sets {', '.join(group_keys)} (per group) but matches only parameters "
                f"({sorted(pars)[:3]}...): match the module that should be the group (e.g. 'layers.*')"
            )
        if rule.group:
            containers = sorted(n for n in mods if isinstance(modules_by_name[n], (nn.ModuleList, nn.ModuleDict)))
            if containers:
                problems.append(
                    f"{rule.describe()} makes {containers[:3]} groups, but a {type(modules_by_name[containers[0]]).__name__} "
                    f"is never called (its hooks would never run): make its elements groups ('{containers[0]}.*')"
                )

    def rules_for(names: Iterable[str], *, by_module: bool) -> list[Rule]:
        names = list(names)
        hits = []
        for rule in plan.rules:
            mods, pars = rule_modules.get(rule.index, set()), rule_params.get(rule.index, set())
            if by_module:
                hit = any(n in mods for n in names)
            else:
                hit = any(n in pars or any(a in mods for a in _ancestors(n)) for n in names)
            if hit:
                hits.append(rule)
        return hits

    # Groups.
    root_modules = list(roots) if roots is not None else [model]
    group_ids: dict[int, str] = {}  # id(module) -> its (first) name
    for r in root_modules:
        if id(r) in module_names:
            group_ids[id(r)] = module_names[id(r)][0]
    for mid, names in module_names.items():
        rules = [r for r in rules_for(names, by_module=True) if r.group is not None]
        if rules and chooser.choose("module", names[0], [_PartialRule(r, ("group",)) for r in rules]).get(
                "group", (False,))[0] and mid not in group_ids:
            group_ids[mid] = names[0]
    def owning_group(use_name: str) -> Optional[int]:
        for anc in _ancestors(use_name):
            m = modules_by_name.get(anc)
            if m is not None and id(m) in group_ids:
                return id(m)
        return None

    found_owners: dict[int, Optional[int]] = {}
    for pid, names in param_names.items():
        found = {owning_group(n) for n in names}
        if len(found) > 1:
            where = ", ".join(f"{n} (group {group_ids[g] or '<root>'!r})" if g is not None else f"{n} (no group)"
                              for n, g in zip(names, [owning_group(n) for n in names]))
            root_ids = {id(r) for r in root_modules}
            if len(root_ids) > 1 and found <= root_ids:
                problems.append(
                    f"parameter {names[0]} is shared by two top-level modules ({where}), which would be sharded as "
                    f"separate roots. Put both in one submodule, or apply fully_shard yourself"
                )
            else:
                problems.append(
                    f"parameter {names[0]} is tied across groups: {where}. A tied parameter must live in one group "
                    f"holding every module that uses it: make their common parent the group, or untie"
                )
        found_owners[pid] = next(iter(found))
    if any(g is None for g in found_owners.values()) and id(model) not in group_ids:
        group_ids[id(model)] = ""  # parameters no root holds go to the model's own group (FSDP2's root)
    # (with the model a group already, owning_group finds it for every parameter: no None is left)
    owners = {pid: (g if g is not None else id(model)) for pid, g in found_owners.items()}

    group_values: dict[int, dict[str, tuple[Any, str]]] = {}
    settings = [k for k in GROUP_FIELDS if k != "group"]
    for mid in group_ids:
        rules = [r for r in rules_for(module_names[mid], by_module=True) if any(k in settings for k in r.settings())]
        group_values[mid] = chooser.choose("group", module_names[mid][0], [_PartialRule(r, settings) for r in rules])
    for rule in plan.rules:
        keys = [k for k in rule.settings() if k in settings]
        mods = rule_modules.get(rule.index, set())
        if keys and mods and not any(id(modules_by_name[n]) in group_ids for n in mods):
            problems.append(
                f"{rule.describe()} sets {', '.join(keys)} (per group) but none of the modules it matches is a group "
                f"({sorted(mods)[:3]}): match a group's module, or make them groups (group: true)"
            )

    tensor_parallel = _tensor_parallel_styles(plan, module_names, modules_by_name, rules_for, rule_modules, chooser)

    # Routing first: "granularity: muon" depends on it.
    param_values: dict[int, dict[str, tuple[Any, str]]] = {}
    for pid, names in param_names.items():
        rules = [r for r in rules_for(names, by_module=False) if any(k in PARAM_FIELDS for k in r.settings())]
        param_values[pid] = chooser.choose("parameter", names[0], [_PartialRule(r, PARAM_FIELDS) for r in rules])

    def fallback(key: str, pid: Optional[int] = None) -> tuple[Any, str]:
        if key.startswith("tier."):
            cls = key.partition(".")[2]
            for where, source in ((plan.fallback, "plan fallback"), (caller, "caller")):
                if cls in tier_classes(where.get("tier")):
                    return tier_classes(where["tier"])[cls], source
            return None, "memory policy"
        if key == "granularity" and pid is not None:
            declared = getattr(param_objs[pid], "_vescale_granularity", None)
            if declared is not None:
                return declared, "parameter attribute _vescale_granularity"
        if key in plan.fallback:
            return plan.fallback[key], "plan fallback"
        if key in caller:
            return caller[key], "caller"
        if key == "granularity" and pid is not None and granularity_fallback is not None:
            name = param_names[pid][0]
            gname = group_ids[owners[pid]]
            inner = name[len(gname) + 1:] if gname else name
            value = granularity_fallback(name, inner, param_objs[pid])
            if value is not None:
                return value, "caller granularity"
        return LIBRARY_DEFAULTS[key], "library default"

    explicit_routes: dict[int, str] = {}
    for pid in param_names:
        value, source = param_values[pid].get("optimizer") or fallback("optimizer")
        param_values[pid]["optimizer"] = (value, source)
        if value != "auto":
            explicit_routes[pid] = value
    routes = _routes(model, param_names, param_objs, explicit_routes)
    muon_gran = None
    for pid in param_names:
        value, source = param_values[pid].get("granularity") or fallback("granularity", pid)
        if value == "muon":
            if muon_gran is None:
                muon_gran = _muon_granularity(model, param_names, routes, explicit_routes)
            value, source = muon_gran(param_names[pid][0], param_objs[pid]), f"{source} (muon)"
        param_values[pid]["granularity"] = (value, source)

    # Required fields.
    for key in plan.require:
        if key == "tier":  # every class from a rule
            missing = [param_names[pid][0] for pid in param_names
                       if not all(param_values[pid].get(f"tier.{c}", (None, ""))[1].startswith("rule")
                                  for c in TIER_CLASSES)]
        elif key in PARAM_FIELDS:
            missing = [param_names[pid][0] for pid in param_names
                       if not param_values[pid].get(key, (None, ""))[1].startswith("rule")
                       and (key != "optimizer" or param_objs[pid].requires_grad)]
        else:
            missing = [group_ids[g] or "<root>" for g in group_ids
                       if not group_values.get(g, {}).get(key, (None, ""))[1].startswith("rule")]
        if missing:
            problems.append(
                f"plan requires every {'parameter' if key in PARAM_FIELDS else 'group'} to get {key} from a rule, "
                f"but no rule covers {len(missing)}: {', '.join(missing[:_MAX_LISTED])}"
                + (" ..." if len(missing) > _MAX_LISTED else "") + f"; add a rule for them (or a {key} fallback and drop "
                f"it from require)"
            )

    if problems:
        raise PlanError(_report(plan, model, problems))

    # Build the policies.
    params: dict[str, ParamPolicy] = {}
    tier_sources: dict[str, dict[str, str]] = {}
    for pid, names in param_names.items():
        p = param_objs[pid]
        values = dict(param_values[pid])
        for key in PARAM_FIELDS:
            if key == "tier":
                for cls in TIER_CLASSES:
                    values.setdefault(f"tier.{cls}", fallback(f"tier.{cls}"))
            else:
                values.setdefault(key, fallback(key, pid))
        tiers = {c: values[f"tier.{c}"][0] for c in TIER_CLASSES if values[f"tier.{c}"][0] is not None}
        tier_sources[names[0]] = {c: values[f"tier.{c}"][1] for c in TIER_CLASSES}
        granularity = values["granularity"][0]
        try:
            granularity_numel(tuple(p.shape), granularity)
        except ValueError as err:
            problems.append(f"parameter {names[0]}: granularity {granularity!r} from {values['granularity'][1]}: {err}")
        route = routes.get(pid, "none")
        route_source = values["optimizer"][1] if values["optimizer"][0] != "auto" else "auto (routing defaults)"
        params[names[0]] = ParamPolicy(
            name=names[0], shape=tuple(p.shape), dtype=dtype_name(p.dtype) or "", requires_grad=p.requires_grad,
            group=group_ids[owners[pid]], granularity=granularity, optimizer=route,
            quantization=values["quantization"][0], tier=tiers,
            sources={"granularity": values["granularity"][1], "optimizer": route_source,
                     "quantization": values["quantization"][1], "tier": _tier_source(tier_sources[names[0]])},
            aliases=tuple(names[1:]),
        )
    rule_names = {f"rule #{r.index + 1}": r.describe() for r in plan.rules}
    named = {n: {c: rule_names.get(v, v) for c, v in s.items()} for n, s in tier_sources.items()}
    problems += _tier_problems(params, named)
    if problems:
        raise PlanError(_report(plan, model, problems))

    groups = []
    # fully_shard order: every group before the groups that contain it (reverse pre-order), roots last.
    order = [id(m) for _, m in model.named_modules()]
    root_ids = {id(r) for r in root_modules} | ({id(model)} if id(model) in group_ids else set())
    ordered = [g for g in reversed(order) if g in group_ids and g not in root_ids]
    ordered += [id(r) for r in root_modules if id(r) in group_ids]
    if id(model) in group_ids and id(model) not in {id(r) for r in root_modules}:
        ordered.append(id(model))
    for gid in ordered:
        values = dict(group_values.get(gid, {}))
        for key in GROUP_FIELDS[1:]:
            values.setdefault(key, fallback(key))
        gname = group_ids[gid]
        members = tuple(n for pid, n in ((pid, param_names[pid][0]) for pid in param_names) if owners[pid] == gid)
        groups.append(GroupPolicy(
            name=gname, module_type=type(modules_by_name[gname]).__name__, params=members, is_root=gid in root_ids,
            reshard_after_forward=values["reshard_after_forward"][0], prefetch=values["prefetch"][0],
            param_dtype=values["param_dtype"][0], reduce_dtype=values["reduce_dtype"][0],
            sources={k: values[k][1] for k in GROUP_FIELDS[1:]},
        ))
    return ResolvedPlan(plan=plan, model_type=type(model).__name__, groups=tuple(groups), params=params,
                        tensor_parallel=tensor_parallel)


_TP_MODULE_TYPES = {"colwise": (nn.Linear, nn.Embedding), "rowwise": (nn.Linear, nn.Embedding)}


def _tensor_parallel_styles(plan: Plan, module_names: Mapping[int, list[str]], modules_by_name: Mapping[str, nn.Module],
                            rules_for: Callable[..., list[Rule]], rule_modules: Mapping[int, set[str]],
                            chooser: _Chooser) -> dict[str, Any]:
    """Module name -> tp style for every module a ``tp`` rule matches (``replicate`` included), in module order."""
    for rule in plan.rules:
        if rule.tp is not None and not rule_modules.get(rule.index):
            chooser.problems.append(
                f"{rule.describe()} sets tp (per module) but matches only parameters: match the module to split "
                f"(e.g. '**.attention.wq', not '**.attention.wq.weight')"
            )
    styles: dict[str, Any] = {}
    for names in module_names.values():
        rules = [r for r in rules_for(names, by_module=True) if r.tp is not None]
        if not rules:
            continue
        style = chooser.choose("module", names[0], [_PartialRule(r, ("tp",)) for r in rules])["tp"][0]
        module = modules_by_name[names[0]]
        allowed = _TP_MODULE_TYPES.get(tp_style_name(style))
        if allowed is not None and not isinstance(module, allowed):
            chooser.problems.append(
                f"module {names[0]} ({type(module).__name__}) gets tp: {tp_style_name(style)}, which splits an nn.Linear or "
                f"nn.Embedding: match its Linear children instead (e.g. '{names[0]}.*')"
            )
            continue
        styles[names[0]] = style
    return styles


def _tier_source(sources: Mapping[str, str]) -> str:
    if len(set(sources.values())) == 1:
        return next(iter(sources.values()))
    return "; ".join(f"{c} {s}" for c, s in sources.items())


def _tier_problems(params: Mapping[str, ParamPolicy], sources: Mapping[str, Mapping[str, str]]) -> list[str]:
    """Tiers the engine cannot honour: weights and gradient pieces move per DBuffer (one per group, dtype and
    trainability), so a buffer's parameters must agree on them; block-quantized and integer parameters keep
    their own storage on the device (their optimizer states may still move)."""
    problems = []
    buffers: dict[tuple, list[ParamPolicy]] = {}
    for p in params.values():
        floating = p.dtype in ("float32", "float16", "bfloat16", "float64")
        if not floating or (p.quantization != "none" and len(p.shape) in (2, 3)):
            moved = {c: t for c, t in p.tier.items() if c in ("params", "grads") and t != "device"}
            if moved:
                why = f"is block-quantized ({p.quantization})" if floating else f"is not floating point ({p.dtype})"
                problems.append(
                    f"parameter {p.name} {why}: its storage stays on the device, but "
                    f"{sources[p.name][next(iter(moved))]} "
                    f"puts its {' and '.join(moved)} on {'/'.join(sorted(set(moved.values())))}; place only its "
                    f"optimizer states (tier: {{optimizer_states: ...}}), or drop the quantization"
                )
            continue
        buffers.setdefault((p.group, p.dtype, p.requires_grad), []).append(p)
    for (group, dtype, trainable), members in buffers.items():
        for cls in ("params", "grads") if trainable else ("params",):
            by_value: dict[Optional[str], list[ParamPolicy]] = {}
            for p in members:
                by_value.setdefault(p.tier.get(cls), []).append(p)
            if len(by_value) < 2:
                continue
            (t1, ps1), (t2, ps2) = sorted(by_value.items(), key=lambda kv: -len(kv[1]))[:2]
            a, b = ps1[0], ps2[0]

            def says(p: ParamPolicy, t: Optional[str]) -> str:
                src = sources[p.name][cls]
                return f"{p.name} gets {t} from {src}" if t is not None else f"{p.name} gets none (the memory policy's)"

            problems.append(
                f"conflict on the {cls} tier of group {group or '<root>'!r} ({dtype}, "
                f"{'trainable' if trainable else 'frozen'}): {says(a, t1)} but {says(b, t2)}. A group's "
                f"{'weight' if cls == 'params' else 'gradient'} pieces move as one buffer: give the whole group one "
                f"{cls} tier (match the group's module: {group or '**'!r}), or make the "
                f"parameters that differ a group of their own (group: true on their module)"
            )
    return problems


class _PartialRule:
    """A rule seen through some of its fields (a rule may set group and parameter fields at once)."""

    def __init__(self, rule: Rule, keys: Sequence[str]) -> None:
        self._rule, self._keys = rule, tuple(keys)
        self.index, self.override, self.match = rule.index, rule.override, rule.match

    def settings(self) -> dict[str, Any]:
        out = {}
        for k, v in self._rule.settings().items():
            if k == "tier" and k in self._keys:  # chosen class by class (see [Note: tiers in a plan])
                out.update({f"tier.{c}": t for c, t in tier_classes(v).items()})
            elif k in self._keys:
                out[k] = v
        return out

    def describe(self) -> str:
        return self._rule.describe()


def _routes(model: nn.Module, param_names: dict, param_objs: dict, explicit: dict[int, str]) -> dict[int, str]:
    """id(param) -> "muon" / "adamw" for trainable parameters: the plan's choice, else the routing defaults."""
    from lightning_vescale.optim.routing import route_parameters

    out = {id(p): route for route, pairs in route_parameters(model).items() for _, p in pairs if id(p) in param_objs}
    for pid, route in explicit.items():
        if pid in out:
            out[pid] = route
    return out


def _muon_granularity(model: nn.Module, param_names: dict, routes: dict[int, str], explicit: dict[int, str]) -> Callable:
    """``muon_granularity`` under the plan's routing: the routes the plan changes from the defaults are passed as
    its patterns (only those: a pattern per parameter would make it quadratic in the number of parameters)."""
    from lightning_vescale.optim.routing import muon_granularity

    defaults = _routes(model, param_names, {pid: None for pid in param_names}, {})
    changed = {pid: r for pid, r in explicit.items() if defaults.get(pid) != r}
    muon = [_escape(param_names[pid][0]) for pid, r in changed.items() if r == "muon"]
    adamw = [_escape(param_names[pid][0]) for pid, r in changed.items() if r == "adamw"]
    return muon_granularity(model, muon_patterns=muon, adamw_patterns=adamw)


def _report(plan: Plan, model: nn.Module, problems: list[str]) -> str:
    head = f"plan {plan.name!r}" if plan.name else "the plan"
    lines = [f"{head} cannot be applied to {type(model).__name__} ({len(problems)} problem(s)):"]
    lines += [f"  - {p}" for p in problems[:20]]
    if len(problems) > 20:
        lines.append(f"  ... and {len(problems) - 20} more")
    return "\n".join(lines)
