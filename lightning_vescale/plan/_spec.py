"""What a plan says: ordered rules keyed by globs on full-model names, fallback values, required fields.

A plan is data (a dict / YAML file), validated here before anything else happens: an unknown key, an
unknown value or a bad glob is a :class:`PlanError` naming the rule, with no model and no process group
involved. :mod:`~lightning_vescale.plan._resolve` then applies it to a model.

[Note: fields and their scope]
Per group (the ``fully_shard`` call of a module): ``group`` (the matched modules become groups),
``reshard_after_forward``, ``prefetch`` (how many groups ahead the AllGather is issued), ``param_dtype``,
``reduce_dtype``. A rule setting them applies to the groups whose module name its glob matches.

Per parameter: ``granularity`` (what ``fully_shard`` accepts, plus ``"muon"``: what
:func:`~lightning_vescale.optim.muon_granularity` gives under the plan's routing), ``optimizer``
(``muon`` / ``adamw`` / ``auto``: the routing of :mod:`lightning_vescale.optim.routing`), ``quantization``
and ``tier``. A rule setting them applies to the parameters its glob matches and to every parameter of
the modules it matches.

``quantization`` (``fp8_block`` / ``int8_block``: 128x128 blocks) applies to the 2-D weights and 3-D expert
stacks a rule covers (1-D tensors stay unquantized): a frozen weight is stored as codes + scales
(:func:`~lightning_vescale.quant.quantize_frozen_weights`), a trained one keeps fp32 master pieces and is
gathered as codes + scales (:func:`~lightning_vescale.quant.quantize_all_gather`).

``tier`` places the persistent state of the parameters a rule covers (see [Note: tiers in a plan]).

[Note: tiers in a plan]
``tier`` is a tier name (``device``, ``host``, ``disk``: the parameter's master-weight piece, gradient piece and
optimizer states all live there) or a mapping per class (``{params: disk, grads: device, optimizer_states:
disk}``); a class a mapping leaves out, and every class of a parameter no rule places, is placed by the run's
:class:`~lightning_vescale.memory.MemoryPolicy` (``MemoryPolicy(optimizer_states=...)``), so the plan's tier wins
where it says something and the policy applies to the rest. Rules combine per class: one rule may set
``optimizer_states`` and a later one ``params`` for the same parameters. The pieces of a group's parameters
share one DBuffer per dtype, so every parameter of a buffer must get the same ``params`` and ``grads`` tiers
(a conflict names the rules and the group); optimizer states are placed per parameter. The ``disk`` tier's
directory is the policy's ``disk_dir``: a plan never holds a machine's paths, and one that puts anything on
disk without a ``disk_dir`` is an error before any process group exists.

[Note: tensor parallelism in a plan]
``tp`` sets a module's tensor-parallel style, applied with ``torch.distributed.tensor.parallel.parallelize_module``
over the mesh's ``tp`` dimension (``("dp", "tp")`` or Lightning's ``("data_parallel", "tensor_parallel")``)
before the groups are sharded over the data-parallel dimension: ``colwise`` (``ColwiseParallel``: an
``nn.Linear``'s output features or an ``nn.Embedding``'s columns split, the output stays split),
``rowwise`` (``RowwiseParallel``: input features split, outputs summed over tp), ``sequence``
(``SequenceParallel``: a norm's input and output split on the sequence dimension; its neighbours must
produce and take sequence-split activations), ``heads`` (``SequenceParallel`` on dim 2: a per-head norm such as
Qwen3's ``q_norm`` / ``k_norm``, whose input holds this rank's heads; its weight stays whole and its gradient is
summed over tp), ``split_tokens`` (the module runs on its tp rank's share of the
sequence: its input is cut into tp sequence chunks and its output gathered over tp; its parameters stay whole, so
their gradients, which differ per tp rank, are summed over tp by the group the module becomes: a MoE feed-forward
whose routed experts sit on ``ep`` of a ``("dp", "ep", "tp")`` mesh, see :mod:`lightning_vescale.parallel.tensor_parallel`)
and ``replicate`` (no split: stops a broader rule). The mapping form
``{style: colwise, input: sequence}`` / ``{style: rowwise, output: sequence}`` sets a projection's input or output
layout (``replicate``, ``sequence``: split on dim 1, ``split``: on the last dim) as the styles' ``input_layouts`` /
``output_layouts`` do, which sequence parallelism needs (``configs/plan/llama_sp.yaml``); ``{style: split_tokens,
input: sequence, output: sequence}`` takes and leaves sequence-split activations (no communication at all). A rule
setting ``tp`` matches modules; on a mesh without a ``tp`` dimension the styles are not applied, so one
plan serves ``tp=1`` and ``tp>1``. Shapes are checked against the tp size before any process group
exists (:func:`~lightning_vescale.parallel.check_tensor_parallel`).
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, TypeGuard, Union

import torch

from lightning_vescale.engine.planner import parse_element_blocks
from lightning_vescale.plan._glob import compile_glob

if TYPE_CHECKING:
    from lightning_vescale.pipeline._spec import MPMDPlan

__all__ = [
    "GROUP_FIELDS",
    "MODULE_FIELDS",
    "PARAM_FIELDS",
    "TIER_CLASSES",
    "TP_LAYOUTS",
    "TP_STYLES",
    "Plan",
    "PlanError",
    "Rule",
    "dtype_name",
    "is_mpmd_plan",
    "parse_dtype",
    "tier_classes",
    "tp_label",
    "tp_style_name",
]

PLAN_VERSION = 1

GROUP_FIELDS = ("group", "reshard_after_forward", "prefetch", "param_dtype", "reduce_dtype")
"""Fields that configure a group (one ``fully_shard`` call)."""
PARAM_FIELDS = ("granularity", "optimizer", "quantization", "tier")
"""Fields that configure a parameter."""
MODULE_FIELDS = ("tp",)
"""Fields that configure a module itself (not a group): its tensor-parallel style."""
FIELDS = GROUP_FIELDS + PARAM_FIELDS + MODULE_FIELDS

GRANULARITY_WORDS = ("element", "row", "matrix", "tensor", "muon")
OPTIMIZER_ROUTES = ("auto", "muon", "adamw")
QUANTIZATION_FORMATS = ("none", "fp8_block", "int8_block")
"""``none``, or block quantization with 128x128 blocks."""
TP_STYLES = ("colwise", "rowwise", "sequence", "heads", "split_tokens", "replicate")
"""How a module is split over the ``tp`` mesh dimension (see [Note: tensor parallelism in a plan])."""
TP_LAYOUTS = ("replicate", "sequence", "split")
"""How an activation lies over tp at a colwise / rowwise module's input or output: whole on every rank, split on
the sequence dimension (sequence parallelism), or split on the last (features) dimension."""
TIERS = ("device", "host", "disk")
"""Where a parameter's persistent state lives (see [Note: tiers in a plan])."""
TIER_CLASSES = ("params", "grads", "optimizer_states")
"""The classes of state a ``tier`` mapping places (the names of ``MemoryPolicy``'s fields)."""

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class PlanError(ValueError):
    """A plan that cannot be applied: the message names the rule (by position and glob) and the fix."""


def parse_dtype(value: Union[str, torch.dtype, None], what: str) -> Optional[torch.dtype]:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` ... -> the dtype (None stays None)."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise PlanError(f"{what}: {value} is not a floating dtype")
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise PlanError(f"{what}: unknown dtype {value!r}; use one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _check_granularity(value: Any, what: str) -> Union[str, int]:
    try:
        blocks = parse_element_blocks(value)
    except ValueError as err:
        raise PlanError(f"{what}: {err}") from None
    if blocks is None and (isinstance(value, bool) or not (value in GRANULARITY_WORDS or (isinstance(value, int) and value > 0))):
        raise PlanError(
            f"{what}: granularity must be one of {', '.join(GRANULARITY_WORDS)}, elements:<n> (blocks of n elements, "
            f"AdamW8bit's) or a positive number of rows, got {value!r}"
        )
    return value


def _check_value(name: str, value: Any, what: str) -> Any:
    """``value`` of field ``name`` as stored (dtypes as their names), or a PlanError."""
    if value is None:
        return None
    if name in ("group", "reshard_after_forward"):
        if not isinstance(value, bool):
            raise PlanError(f"{what}: {name} must be true or false, got {value!r}")
        return value
    if name == "prefetch":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise PlanError(f"{what}: prefetch must be a number of groups >= 0 (0: no prefetch), got {value!r}")
        return value
    if name in ("param_dtype", "reduce_dtype"):
        return dtype_name(parse_dtype(value, f"{what}: {name}"))
    if name == "granularity":
        return _check_granularity(value, what)
    if name == "optimizer":
        if value not in OPTIMIZER_ROUTES:
            raise PlanError(f"{what}: optimizer must be one of {', '.join(OPTIMIZER_ROUTES)}, got {value!r}")
        return value
    if name == "tier":
        return _check_tier(value, what)
    if name == "tp":
        return _check_tp(value, what)
    if value not in QUANTIZATION_FORMATS:
        raise PlanError(f"{what}: {name} must be one of {', '.join(QUANTIZATION_FORMATS)}, got {value!r}")
    return value


def _check_tp(value: Any, what: str) -> Union[str, dict[str, str]]:
    """A tp style, or ``{style: colwise | rowwise | split_tokens, input: <layout>, output: <layout>}`` (stored in that
    key order; split_tokens takes the layouts replicate and sequence)."""
    if isinstance(value, Mapping):
        _unknown_keys(value, ("style", "input", "output"), f"{what}: tp")
        style = value.get("style")
        if style not in ("colwise", "rowwise", "split_tokens"):
            raise PlanError(f"{what}: tp as a mapping needs style: colwise, rowwise or split_tokens (the styles with input "
                            f"and output layouts), got {dict(value)!r}")
        layouts = TP_LAYOUTS if style != "split_tokens" else ("replicate", "sequence")
        bad = {k: v for k, v in value.items() if k != "style" and v not in layouts}
        if bad:
            raise PlanError(f"{what}: tp input / output{' of split_tokens' if style == 'split_tokens' else ''} must be one of {', '.join(layouts)}, got {bad!r}")
        return {k: value[k] for k in ("style", "input", "output") if k in value}
    if value not in TP_STYLES:
        raise PlanError(f"{what}: tp must be one of {', '.join(TP_STYLES)} (or {{style: colwise | rowwise, input: ..., "
                        f"output: ...}}), got {value!r}")
    return value


def tp_style_name(value: Union[str, Mapping[str, str]]) -> str:
    """The style of a ``tp`` value (``colwise`` for ``{style: colwise, input: sequence}``)."""
    return value if isinstance(value, str) else value["style"]


def tp_label(value: Union[str, Mapping[str, str]]) -> str:
    """For tables: ``colwise``, ``colwise(in=sequence)``, ``rowwise(out=sequence)``."""
    if isinstance(value, str):
        return value
    extra = ",".join(f"{k[:3] if k == 'output' else 'in'}={v}" for k, v in value.items() if k != "style")
    return f"{value['style']}({extra})" if extra else value["style"]


def _check_tier(value: Any, what: str) -> Union[str, dict[str, str]]:
    """A tier name, or a mapping class -> tier name (stored in :data:`TIER_CLASSES` order)."""
    if isinstance(value, Mapping):
        _unknown_keys(value, TIER_CLASSES, f"{what}: tier")
        bad = {k: v for k, v in value.items() if v not in TIERS}
        if bad or not value:
            raise PlanError(f"{what}: tier must map some of {', '.join(TIER_CLASSES)} to one of {', '.join(TIERS)}, "
                            f"got {dict(value)!r}")
        return {k: value[k] for k in TIER_CLASSES if k in value}
    if value not in TIERS:
        raise PlanError(f"{what}: tier must be one of {', '.join(TIERS)} or a mapping of "
                        f"{', '.join(TIER_CLASSES)} to them (e.g. {{optimizer_states: disk}}), got {value!r}")
    return value


def tier_classes(value: Union[str, Mapping[str, str], None]) -> dict[str, str]:
    """A ``tier`` value as class -> tier for the classes it places (a name places all three)."""
    if value is None:
        return {}
    if isinstance(value, str):
        return dict.fromkeys(TIER_CLASSES, value)
    return dict(value)


def _unknown_keys(given: Mapping, allowed: tuple, what: str) -> None:
    unknown = [k for k in given if k not in allowed]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), allowed, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise PlanError(f"{what}: unknown key(s) {', '.join(hints)}; allowed: {', '.join(allowed)}")


@dataclass(frozen=True)
class Rule:
    """One rule of a plan: a glob on full-model names and the fields it sets (``None``: not set)."""

    match: str
    """Glob on full-model names of modules and parameters (``layers.*``, ``**.experts``, ``**.weight``)."""
    group: Optional[bool] = None
    """``true``: every matched module becomes a group (its own AllGather and ReduceScatter)."""
    reshard_after_forward: Optional[bool] = None
    """Free the matched groups' gathered parameters after forward (ZeRO-3); ``false`` keeps them for backward."""
    prefetch: Optional[int] = None
    """How many groups ahead of the matched groups the next AllGathers are issued (0: none, 1: FSDP2's)."""
    param_dtype: Optional[str] = None
    """dtype of the matched groups' gathered parameters and compute (``bfloat16``, ``float32``)."""
    reduce_dtype: Optional[str] = None
    """dtype of the matched groups' gradient ReduceScatter."""
    granularity: Optional[Union[str, int]] = None
    """``element``, ``row``, ``tensor``, a number of rows, ``elements:<n>`` (blocks of n elements, AdamW8bit) or
    ``muon`` (whole matrices where Muon steps them)."""
    optimizer: Optional[str] = None
    """``muon`` or ``adamw`` (with :func:`~lightning_vescale.optim.build_optimizer`), or ``auto``."""
    quantization: Optional[str] = None
    """``none``, ``fp8_block`` or ``int8_block``."""
    tier: Optional[Union[str, dict[str, str]]] = None
    """``device``, ``host``, ``disk``, or a mapping per class (``{optimizer_states: disk}``); see
    [Note: tiers in a plan]."""
    tp: Optional[Union[str, dict[str, str]]] = None
    """``colwise``, ``rowwise``, ``sequence`` or ``replicate``, or ``{style: colwise | rowwise, input: <layout>,
    output: <layout>}``: how the matched modules are split over the mesh's ``tp`` dimension; see
    [Note: tensor parallelism in a plan]."""
    override: bool = False
    """Replace values that earlier rules set for the same names; otherwise a different value is a conflict."""
    index: int = field(default=-1, compare=False)
    """Position in the plan (0-based), for messages."""

    def __post_init__(self) -> None:
        what = self.describe()
        if not isinstance(self.match, str):
            raise PlanError(f"{what}: match must be a glob string, got {self.match!r}")
        try:
            compile_glob(self.match)
        except ValueError as err:
            raise PlanError(f"{what}: {err}") from None
        if not isinstance(self.override, bool):
            raise PlanError(f"{what}: override must be true or false, got {self.override!r}")
        for name in FIELDS:
            object.__setattr__(self, name, _check_value(name, getattr(self, name), what))
        if not self.settings():
            raise PlanError(f"{what} sets nothing: give it at least one of {', '.join(FIELDS)}")

    def describe(self) -> str:
        return f"rule #{self.index + 1} (match: {self.match!r})" if self.index >= 0 else f"rule (match: {self.match!r})"

    def settings(self) -> dict[str, Any]:
        """The fields this rule sets."""
        return {name: getattr(self, name) for name in FIELDS if getattr(self, name) is not None}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"match": self.match, **self.settings()}
        if self.override:
            out["override"] = True
        return out


_PLAN_KEYS = ("version", "name", "description", "fallback", "rules", "require")
_RULE_KEYS = ("match",) + FIELDS + ("override",)
_FALLBACK_KEYS = tuple(f for f in FIELDS if f not in ("group", "tp"))


@dataclass(frozen=True)
class Plan:
    """A declarative sharding plan (see :mod:`lightning_vescale.plan`).

    Build it from a dict or YAML (:meth:`from_dict`, :func:`~lightning_vescale.plan.load_plan`); resolve it
    against a model with :func:`~lightning_vescale.plan.resolve_plan`; apply it with
    :func:`lightning_vescale.parallelize`.
    """

    rules: tuple[Rule, ...] = ()
    """Ordered rules; a later rule may replace an earlier one's values only with ``override: true``."""
    fallback: dict = field(default_factory=dict)
    """Values for every group / parameter that no rule sets (any field but ``group``). (Not named ``defaults``:
    Hydra reads that key of a config file as its defaults list.)"""
    require: tuple[str, ...] = ()
    """Fields every parameter must get from a rule (not from ``fallback``): an uncovered parameter is an error."""
    name: str = ""
    """A name for messages and the printed table."""
    description: str = ""
    """Free text kept with the plan."""
    version: int = PLAN_VERSION
    """Plan format version (1)."""

    def __post_init__(self) -> None:
        what = f"plan {self.name!r}" if self.name else "plan"
        if self.version != PLAN_VERSION:
            raise PlanError(f"{what}: version {self.version!r} is not supported (this library reads version {PLAN_VERSION})")
        if not isinstance(self.fallback, Mapping):
            raise PlanError(f"{what}: fallback must be a mapping of field -> value, got {self.fallback!r}")
        _unknown_keys(self.fallback, _FALLBACK_KEYS, f"{what} fallback")
        fallback = {k: _check_value(k, v, f"{what} fallback") for k, v in self.fallback.items() if v is not None}
        object.__setattr__(self, "fallback", fallback)
        require = (self.require,) if isinstance(self.require, str) else tuple(self.require or ())
        _unknown_keys({r: None for r in require}, FIELDS, f"{what} require")
        object.__setattr__(self, "require", require)
        rules = []
        for i, rule in enumerate(self.rules):
            if isinstance(rule, Rule):
                rule = dataclasses.replace(rule, index=i)
            else:
                rule = _rule_from_dict(rule, i)
            rules.append(rule)
        object.__setattr__(self, "rules", tuple(rules))

    # -- (de)serialization ----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Union[Plan, Mapping[str, Any]]) -> Plan:
        """A plan from its dict form (as in YAML); unknown keys and values are errors naming the rule."""
        if isinstance(data, Plan):
            return data
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a mapping with 'rules' (and optionally {', '.join(_PLAN_KEYS)}), got {data!r}")
        _unknown_keys(data, _PLAN_KEYS, "plan")
        rules = data.get("rules") or []
        if not isinstance(rules, (list, tuple)):
            raise PlanError(f"plan: rules must be a list of rules, got {rules!r}")
        return cls(
            rules=tuple(rules), fallback=dict(data.get("fallback") or {}), require=data.get("require") or (),
            name=str(data.get("name") or ""), description=str(data.get("description") or ""),
            version=data.get("version", PLAN_VERSION),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version}
        if self.name:
            out["name"] = self.name
        if self.description:
            out["description"] = self.description
        if self.fallback:
            out["fallback"] = dict(self.fallback)
        if self.require:
            out["require"] = list(self.require)
        out["rules"] = [r.to_dict() for r in self.rules]
        return out

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def tier_settings(self) -> list[tuple[str, dict[str, str]]]:
        """Where the plan places state off the device: ``(rule or 'fallback', class -> tier)`` for each rule (and
        the fallback) whose ``tier`` names ``host`` or ``disk`` for some class. Read from the plan alone (no
        model), so a run can be checked against its memory policy before anything starts."""
        found = [(r.describe(), tier_classes(r.tier)) for r in self.rules]
        found.append(("the plan's fallback", tier_classes(self.fallback.get("tier"))))
        return [(who, {k: v for k, v in classes.items() if v != "device"}) for who, classes in found
                if any(v != "device" for v in classes.values())]


def _rule_from_dict(data: Any, index: int) -> Rule:
    what = f"rule #{index + 1}"
    if not isinstance(data, Mapping):
        raise PlanError(f"{what}: a rule must be a mapping with 'match' and the fields it sets, got {data!r}")
    _unknown_keys(data, _RULE_KEYS, f"{what}" + (f" (match: {data['match']!r})" if "match" in data else ""))
    if "match" not in data:
        raise PlanError(f"{what} has no 'match' (the glob on full-model names it applies to): {dict(data)}")
    return Rule(**dict(data), index=index)


def is_mpmd_plan(plan: Any) -> TypeGuard[Union[MPMDPlan, Mapping[str, Any]]]:
    """True for an MPMD plan (:class:`~lightning_vescale.pipeline.MPMDPlan`) or its dict form (a mapping with
    ``stages``). Does not import the pipeline package (``torch.distributed.pipelining``, checkpointing: code a
    plain plan does not need): an ``MPMDPlan`` exists only once its module has been imported."""
    if isinstance(plan, Mapping) and "stages" in plan:
        return True
    spec = sys.modules.get("lightning_vescale.pipeline._spec")
    return spec is not None and isinstance(plan, spec.MPMDPlan)
