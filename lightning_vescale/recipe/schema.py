"""Typed configs of the training recipes, registered as Hydra structured configs.

Every option of a config group in ``configs/`` extends one of these dataclasses (its defaults list names
the schema), so Hydra rejects a misspelled key while composing, and :func:`validate` turns the composed
config into the dataclasses, whose ``__post_init__`` reject bad values with a ``ValueError`` naming the
field, what it got and what is allowed. The YAML files only pick and override.

[Note: the config tree]
::

    TrainConfig
      model      ModelConfig       LlamaModelConfig | MoEModelConfig: a preset plus field overrides;
                                   CheckpointModelConfig: the config of the weights a fine-tune starts from
      optimizer  OptimizerConfig   AdamWConfig | AdamW8bitConfig | MuonConfig: a ``_target_`` factory and its kwargs
      scheduler  SchedulerConfig   warmup, then cosine / linear / constant
      strategy   StrategyConfig    VeScaleStrategyConfig | DDPStrategyConfig | ModelParallelStrategyConfig
      data       DataConfig        corpus, tokenizer, windows
      trainer    TrainerConfig     Lightning Trainer settings (+ ``precision``, set by the precision group)
      quant      QuantConfig       block-quantized weights (QLoRA base or quantized AllGather), or null
      notes      dict              free-form: whatever the user wants kept with the run (``+notes.<key>=...``)

Components that carry ``_target_`` are built with ``hydra.utils.instantiate``, so a new optimizer or
strategy plugs in with a new YAML file (and, for validation of its keys, a schema dataclass here).

A schema holds its component's arguments in types Hydra reads; the defaults, allowed values and checks are the
component's own wherever it exposes them (``MemoryPolicy``, ``AdamW8bit``, ``build_optimizer``, ``BlockFormat``,
``LoRAConfig``, the plan's granularities), and ``tests/unit/test_recipe_schema_drift.py`` checks the names,
defaults and accepted values of every schema against its component, so the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_vescale.data import TEXT_DATA_DEFAULTS, TextDataOptions, load_text
from lightning_vescale.models.deepseek_v3 import DeepSeekV3Config
from lightning_vescale.models.families import FAMILIES, family_of
from lightning_vescale.models.llama import LlamaConfig
from lightning_vescale.models.moe import MoEConfig
from lightning_vescale.models.qwen3_moe import Qwen3MoEConfig
from lightning_vescale.optim import build_optimizer
from lightning_vescale.optim.adamw8bit import DEFAULT_BLOCK_SIZE, DEFAULT_MIN_8BIT_SIZE, check_block_args
from lightning_vescale.optim.muon import ADJUST_LR_FNS, MODES
from lightning_vescale.parallel.session import mesh_size_problem
from lightning_vescale.plan import GRANULARITY_WORDS
from lightning_vescale.quant import BlockFormat, quantize_all_gather
from lightning_vescale.quant.formats import FORMATS
from lightning_vescale.quant.lora import LoRAConfig
from lightning_vescale.recipe.mpmd import MPMDConfig
from lightning_vescale.recipe.targets import check_config_targets

__all__ = [
    "AdamW8bitConfig",
    "AdamWConfig",
    "CheckpointModelConfig",
    "DDPStrategyConfig",
    "FREE_FORM_SECTIONS",
    "DataConfig",
    "DeepSeekV3ModelConfig",
    "FinetuneConfig",
    "LlamaModelConfig",
    "MODEL_FAMILIES",
    "ModelConfig",
    "ModelParallelStrategyConfig",
    "MoEModelConfig",
    "MuonConfig",
    "OptimizerConfig",
    "PRECISIONS",
    "QuantConfig",
    "Qwen3MoEModelConfig",
    "SchedulerConfig",
    "StrategyConfig",
    "TrainConfig",
    "TrainerConfig",
    "VeScaleStrategyConfig",
    "check_known_keys",
    "register_configs",
    "source_name",
    "validate",
]

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true")
"""Values ``trainer.precision`` accepts (Lightning's names; the precision group picks one)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_target(owner: str, target: str) -> None:
    _check(
        isinstance(target, str) and "." in target and all(part.isidentifier() for part in target.split(".")),
        f"{owner}._target_ must be a dotted import path like 'torch.optim.AdamW', got {target!r}",
    )


# ----------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------

ModelArchConfig = Union[LlamaConfig, MoEConfig, Qwen3MoEConfig, DeepSeekV3Config]
_FAMILIES = FAMILIES
MODEL_FAMILIES = tuple(_FAMILIES)
"""Model families the recipes train."""


@dataclass
class ModelConfig:
    """Which model to train: a family, one of its presets, and per-field overrides of the preset.

    The concrete schemas :class:`LlamaModelConfig` and :class:`MoEModelConfig` add one optional field per
    field of :class:`~lightning_vescale.models.llama.LlamaConfig` / :class:`~lightning_vescale.models.moe.MoEConfig`
    (same name, same meaning; ``None`` keeps the preset's value), so ``model.n_layers=4`` works and
    ``model.n_layer=4`` is rejected while composing.
    """

    family: Optional[str] = MISSING
    """``"llama"``, ``"moe"``, ``"qwen3_moe"`` or ``"deepseek_v3"``; set by the schema each model option extends
    (read from the checkpoint by ``model=from_checkpoint``)."""
    preset: str = MISSING
    """A key of ``LLAMA_CONFIGS`` / ``MOE_CONFIGS`` (``tiny``, ``debug``, ``small``, ...)."""

    def __post_init__(self) -> None:
        _check(
            self.family in _FAMILIES,
            f"model.family must be one of {', '.join(MODEL_FAMILIES)}, got {self.family!r}",
        )
        self.build_config()  # validates the preset name and every override

    def overrides(self) -> dict[str, Any]:
        """The fields set to something other than ``None`` (``family`` and ``preset`` excluded)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in ("family", "preset") and value is not None:
                out[f.name] = value
        return out

    def build_config(self) -> ModelArchConfig:
        """The model's config: the preset with the overrides applied (validated by the model's config).

        Raises:
            ValueError: unknown preset (the message lists the valid ones), an override the family does not
                have, or an invalid value (the model config's message names the field).
        """
        assert self.family is not None  # checked by __post_init__
        config_cls, presets, lookup, _ = _FAMILIES[self.family]
        if self.preset not in presets:
            raise ValueError(
                f"unknown {self.family} preset model.preset={self.preset!r}; valid presets are: "
                f"{', '.join(sorted(presets))} (or pick another model: model=llama_tiny, moe_tiny, ...)"
            )
        base = lookup(self.preset)
        overrides = self.overrides()
        names = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(overrides) - names)
        _check(not unknown, f"model: {self.family} models have no field(s) {unknown}; valid: {sorted(names)}")
        # A rope_scaling dict becomes the family's scaling type in the config's own __post_init__.
        if "dense_layers" in overrides:
            overrides["dense_layers"] = tuple(overrides["dense_layers"])
        try:
            return dataclasses.replace(base, **overrides)
        except ValueError as err:
            raise ValueError(f"model={self.family}_{self.preset} with overrides {overrides}: {err}") from err

    def build_model(self):
        """Build the model (on the current default device: use ``torch.device("meta")`` for an empty one)."""
        return _FAMILIES[self.family][3](self.build_config())


def _override_fields(config_cls: type) -> list[tuple[str, Any, Any]]:
    hints = typing.get_type_hints(config_cls)
    return [(f.name, Optional[hints[f.name]], field(default=None)) for f in dataclasses.fields(config_cls)]


LlamaModelConfig = dataclasses.make_dataclass(
    "LlamaModelConfig",
    [("family", str, field(default="llama"))] + _override_fields(LlamaConfig),
    bases=(ModelConfig,),
    namespace={
        "__doc__": "A Llama preset plus optional overrides of every ``LlamaConfig`` field (``None``: the preset's).",
        "__module__": __name__,
    },
)
MoEModelConfig = dataclasses.make_dataclass(
    "MoEModelConfig",
    [("family", str, field(default="moe"))] + _override_fields(MoEConfig),
    bases=(ModelConfig,),
    namespace={
        "__doc__": "An MoE preset plus optional overrides of every ``MoEConfig`` field (``None``: the preset's).",
        "__module__": __name__,
    },
)
Qwen3MoEModelConfig = dataclasses.make_dataclass(
    "Qwen3MoEModelConfig",
    [("family", str, field(default="qwen3_moe"))] + _override_fields(Qwen3MoEConfig),
    bases=(ModelConfig,),
    namespace={
        "__doc__": "A Qwen3-MoE preset plus optional overrides of every ``Qwen3MoEConfig`` field.",
        "__module__": __name__,
    },
)
DeepSeekV3ModelConfig = dataclasses.make_dataclass(
    "DeepSeekV3ModelConfig",
    [("family", str, field(default="deepseek_v3"))] + _override_fields(DeepSeekV3Config),
    bases=(ModelConfig,),
    namespace={
        "__doc__": "A DeepSeek-V3 preset plus optional overrides of every ``DeepSeekV3Config`` field.",
        "__module__": __name__,
    },
)


def _union_override_fields(*config_classes: type) -> list[tuple[str, Any, Any]]:
    fields: dict[str, tuple[str, Any, Any]] = {}
    for config_cls in config_classes:
        for f in _override_fields(config_cls):
            fields.setdefault(f[0], f)
    return list(fields.values())


class _CheckpointModelBase(ModelConfig):
    """The behaviour of :class:`CheckpointModelConfig` (its fields are generated below)."""

    if TYPE_CHECKING:
        path: Optional[str]
        hf_model_type: Optional[str]
        _source_arch: ModelArchConfig

    def __post_init__(self) -> None:
        if self.path is None:
            raise ValueError(
                "model=from_checkpoint reads the model config from the weights the fine-tune starts from, but none "
                "were given: set init_from=<Hugging Face dir, recipe run or checkpoint> (or model.path=...), or "
                "name the model (model=llama_tiny ...)"
            )
        arch, self.hf_model_type = _read_source_config(self.path)
        family = family_of(arch)
        _check(
            self.family in (None, family),
            f"model.family={self.family!r} but the checkpoint at model.path={self.path!r} holds a {family} model; "
            f"leave model.family unset (it is read from the checkpoint)",
        )
        self.family = family
        self._source_arch = arch
        self.build_config()  # validates the overrides against the checkpoint's family

    def overrides(self) -> dict[str, Any]:
        return {k: v for k, v in super().overrides().items() if k != "path"}

    def build_config(self) -> ModelArchConfig:
        """The checkpoint's model config with the overrides applied."""
        arch = self._source_arch
        overrides = self.overrides()
        names = {f.name for f in dataclasses.fields(arch)}
        unknown = sorted(set(overrides) - names)
        _check(
            not unknown,
            f"model: the checkpoint at model.path={self.path!r} holds a {self.family} model, which has no field(s) "
            f"{unknown}; valid: {sorted(names)}",
        )
        # A rope_scaling dict becomes the family's scaling type in the config's own __post_init__.
        if "dense_layers" in overrides:
            overrides["dense_layers"] = tuple(overrides["dense_layers"])
        try:
            return dataclasses.replace(arch, **overrides)
        except ValueError as err:
            raise ValueError(f"model=from_checkpoint ({self.path}) with overrides {overrides}: {err}") from err


def _read_source_config(path: str) -> tuple[ModelArchConfig, Optional[str]]:
    from lightning_vescale.export import read_source_config

    return read_source_config(path)



CheckpointModelConfig: type[_CheckpointModelBase] = dataclasses.make_dataclass(
    "CheckpointModelConfig",
    [
        ("family", Optional[str], field(default=None)),
        ("preset", str, field(default="from_checkpoint")),
        ("path", Optional[str], field(default=None)),
    ]
    + _union_override_fields(LlamaConfig, MoEConfig, Qwen3MoEConfig, DeepSeekV3Config),
    bases=(_CheckpointModelBase,),
    namespace={
        "__doc__": "The model config of the weights a fine-tune starts from (``model=from_checkpoint``): a Hugging "
        "Face directory's ``config.json`` or a recipe run's ``model.json``, plus optional overrides of any field "
        "(``None``: the checkpoint's value). ``path`` defaults to ``init_from``; ``family`` is read from the "
        "checkpoint (and ``hf_model_type``, an attribute, from a Hugging Face ``config.json``).",
        "__module__": __name__,
    },
)


def source_name(path: str) -> str:
    """A run name for weights at ``path``: a recipe run's name for its run directory or checkpoints, else the
    file or directory name without its suffix (the ``lv.source_name`` resolver of the configs)."""
    p = Path(str(path).rstrip("/"))
    if p.parent.name == "checkpoints":  # <root>/<name>/<time>/checkpoints/step-N.ckpt
        p = p.parent.parent
    if (p / "checkpoints").is_dir() or (p / ".hydra").is_dir():  # <root>/<name>/<time>
        return p.parent.name or p.name
    return p.stem if p.is_file() else p.name


OmegaConf.register_new_resolver("lv.source_name", source_name, replace=True)


# ----------------------------------------------------------------------------------------------------
# Optimizer and schedule
# ----------------------------------------------------------------------------------------------------


@dataclass
class OptimizerConfig:
    """An optimizer factory, built with ``hydra.utils.instantiate(cfg, <params or model>)``.

    If ``_target_`` is a ``torch.optim.Optimizer`` subclass it receives ``model.parameters()``; any other
    callable (e.g. ``lightning_vescale.optim.build_optimizer``) receives the model, so it can route
    parameters by name and shape.
    """

    _target_: str = MISSING
    """Import path of the optimizer class or factory."""
    lr: float = MISSING
    """Peak learning rate (the scheduler scales it)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""

    def __post_init__(self) -> None:
        _check_target("optimizer", self._target_)
        _check(0 < self.lr < math.inf, f"optimizer.lr must be a finite number > 0, got {self.lr}")
        _check(0 <= self.weight_decay < math.inf,
               f"optimizer.weight_decay must be a finite number >= 0, got {self.weight_decay}")


@dataclass
class AdamWConfig(OptimizerConfig):
    """``torch.optim.AdamW``."""

    _target_: str = "torch.optim.AdamW"
    """Import path of the optimizer class."""
    lr: float = 3e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's moment decay rates."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(
            len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
            f"optimizer.betas must be two numbers in [0, 1), got {list(self.betas)}",
        )
        _check(0 < self.eps < math.inf, f"optimizer.eps must be a finite number > 0, got {self.eps}")


@dataclass
class AdamW8bitConfig(AdamWConfig):
    """``lightning_vescale.optim.AdamW8bit``: AdamW with both moments as 8-bit codes plus one fp32 scale per block.
    The vescale strategies then cut parameters on block boundaries (``strategy.granularity: elements:<block_size>``
    unless a plan or ``strategy.granularity`` sets another one that keeps the blocks whole)."""

    _target_: str = "lightning_vescale.optim.AdamW8bit"
    """Import path of the optimizer class."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Elements per fp32 scale (blocks of the flattened tensor, counted from its first element)."""
    min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE
    """Tensors with fewer elements (norms, biases) keep fp32 states."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_block_args(self.block_size, self.min_8bit_size, "optimizer.")  # AdamW8bit's own check


def _or(values: Sequence[str]) -> str:
    """``a, b or c``."""
    return f"{', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else "".join(values)


def _build_optimizer_default(name: str) -> Any:
    """``lightning_vescale.optim.build_optimizer``'s default for ``name``: the factory owns it."""
    return inspect.signature(build_optimizer).parameters[name].default


@dataclass
class MuonConfig(OptimizerConfig):
    """Muon for the hidden matrices and expert stacks, AdamW for embeddings, output head, norms and biases:
    one optimizer from ``lightning_vescale.optim.build_optimizer`` (keyword names as it takes them).

    The fields are the factory's keyword arguments that a YAML file can hold (not ``cost_model``, the patterns or
    the Newton-Schulz coefficients), with its defaults except the recipe's own ``lr``, ``muon_lr`` and
    ``weight_decay``; ``tests/unit/test_recipe_schema_drift.py`` keeps them so."""

    _target_: str = "lightning_vescale.optim.build_optimizer"
    """Import path of the factory; called with the model."""
    lr: float = 3e-3
    """Peak learning rate of the AdamW part."""
    muon_lr: float = 0.02
    """Peak learning rate of the Muon part (before Muon's shape adjustment ``adjust_lr_fn``)."""
    weight_decay: float = 0.0
    """Decoupled weight decay of the Muon part (and of AdamW unless ``adamw_weight_decay`` is set)."""
    adamw_weight_decay: Optional[float] = _build_optimizer_default("adamw_weight_decay")
    """Weight decay of the AdamW part; ``None``: ``weight_decay``."""
    adamw_betas: tuple[float, float] = _build_optimizer_default("adamw_betas")
    """AdamW's moment decay rates."""
    momentum: float = _build_optimizer_default("momentum")
    """Muon's momentum."""
    nesterov: bool = _build_optimizer_default("nesterov")
    """Nesterov momentum in Muon."""
    ns_steps: int = _build_optimizer_default("ns_steps")
    """Newton-Schulz iterations."""
    adjust_lr_fn: Optional[str] = _build_optimizer_default("adjust_lr_fn")
    """Muon's learning-rate scaling by shape: ``None``/``"original"`` or ``"match_rms_adamw"``."""
    mode: str = _build_optimizer_default("mode")
    """Where whole matrices are orthogonalized when sharded: ``"auto"``, ``"local"`` or ``"gather"``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(0 < self.muon_lr < math.inf, f"optimizer.muon_lr must be a finite number > 0, got {self.muon_lr}")
        _check(self.adamw_weight_decay is None or 0 <= self.adamw_weight_decay < math.inf,
               f"optimizer.adamw_weight_decay must be a finite number >= 0 or null, got {self.adamw_weight_decay}")
        _check(0.0 <= self.momentum < 1.0, f"optimizer.momentum must be in [0, 1), got {self.momentum}")
        _check(
            len(self.adamw_betas) == 2 and all(0.0 <= b < 1.0 for b in self.adamw_betas),
            f"optimizer.adamw_betas must be two numbers in [0, 1), got {list(self.adamw_betas)}",
        )
        _check(self.ns_steps >= 1, f"optimizer.ns_steps must be >= 1, got {self.ns_steps}")
        # The values Muon takes are Muon's (ADJUST_LR_FNS, MODES); the messages speak the config's words (null).
        _check(
            self.adjust_lr_fn is None or self.adjust_lr_fn in ADJUST_LR_FNS,
            f"optimizer.adjust_lr_fn must be {_or(['null', *map(repr, ADJUST_LR_FNS)])}, got {self.adjust_lr_fn!r}",
        )
        _check(self.mode in MODES, f"optimizer.mode must be {_or(MODES)}, got {self.mode!r}")


SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class SchedulerConfig:
    """Learning-rate multiplier per optimizer step: linear warmup from 0, then a decay to ``min_lr_ratio``
    at ``trainer.max_steps``."""

    warmup_steps: int = 20
    """Steps of linear warmup."""
    decay: str = "cosine"
    """``"cosine"``, ``"linear"`` or ``"constant"`` (no decay)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""

    def __post_init__(self) -> None:
        _check(self.warmup_steps >= 0, f"scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.decay in SCHEDULES, f"scheduler.decay must be one of {', '.join(SCHEDULES)}, got {self.decay!r}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, f"scheduler.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


# ----------------------------------------------------------------------------------------------------
# Strategy
# ----------------------------------------------------------------------------------------------------


@dataclass
class StrategyConfig:
    """A Lightning strategy, built with ``hydra.utils.instantiate``."""

    _target_: str = MISSING
    """Import path of the strategy class."""
    timeout: Optional[float] = None
    """Seconds a collective waits for the other ranks before it fails with an error naming the rank and the
    collective (a stopped or crashed peer); ``null``: the strategy's default (vescale: 300 on CPU, 1800 on
    GPUs; Lightning's DDP and ModelParallel strategies: 1800)."""

    def __post_init__(self) -> None:
        _check_target("strategy", self._target_)
        _check(self.timeout is None or self.timeout > 0, f"strategy.timeout must be > 0 seconds or null, got {self.timeout}")


@dataclass
class VeScaleStrategyConfig(StrategyConfig):
    """``lightning_vescale.lightning.VeScaleStrategy``: ZeRO-3 on RaggedShard placements (same argument names)."""

    # A mirror of the strategy's keyword arguments, kept on purpose: Hydra needs the values a YAML file can hold
    # (no plan objects, mp_policy or accelerator), and the checks below name the config's keys in its words
    # (null, not None) before any process starts. tests/unit/test_recipe_schema_drift.py keeps the names and
    # defaults equal to VeScaleStrategy's (restore_rng_states excepted, see there) and the checks accepting what
    # the strategy accepts.

    _target_: str = "lightning_vescale.lightning.VeScaleStrategy"
    """Import path of the strategy class."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward and gather again in backward (ZeRO-3); False keeps them."""
    granularity: Any = None
    """Cut granularity: ``null`` (element; ``elements:<block_size>`` with ``optimizer=adamw8bit``), ``"row"``, a number
    of rows, ``"matrix"``, ``"tensor"``, ``"muon"``, ``"elements:<n>"`` (blocks of n elements), or a mapping of name globs (as ``named_parameters()`` of the LightningModule names them) to those."""
    replicate_size: Any = None
    """``null``: shard over every rank. An int or ``"auto"`` (the number of nodes): HSDP replicas."""
    expert_parallel_size: int = 1
    """``1``: no expert parallelism. ``ep > 1``: split the MoE experts over ``ep`` ranks and shard them over
    ``world_size // ep`` (a ``("dp", "ep")`` mesh); must divide ``devices * num_nodes``, needs an MoE model
    and ``replicate_size: null``."""
    tensor_parallel_size: int = 1
    """``1``: no tensor parallelism. ``tp > 1``: split the modules the plan's ``tp`` rules name over ``tp``
    consecutive ranks and shard the groups over ``world_size // tp`` (a ``("data_parallel", "tensor_parallel")``
    mesh); must divide ``devices * num_nodes`` and the model's heads and hidden sizes, needs a plan with tp rules
    (``plan=llama``)."""
    sync_module_states: bool = True
    """Start every rank from rank 0's weights (meta-device init replays rank 0's RNG)."""
    meta_init: bool = True
    """Build the model on the meta device in ``configure_model`` (each rank allocates only its pieces)."""
    process_group_backend: Optional[str] = None
    """``null``: gloo on CPU, nccl on CUDA."""
    restore_rng_states: bool = True
    """Resume with every rank's saved RNG states, so the resumed run equals the uninterrupted one (the
    strategy's own default, as Lightning's strategies, is False)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # The integrations' own check (lightning_vescale.parallel.session), in the recipe's key names.
        problem = mesh_size_problem(self.replicate_size, self.expert_parallel_size, self.tensor_parallel_size,
                                    prefix="strategy.", null="null")
        _check(problem is None, problem or "")
        g = self.granularity
        _check(
            g is None or g in GRANULARITY_WORDS or (isinstance(g, int) and not isinstance(g, bool) and g >= 1)
            or isinstance(g, dict) or _is_element_blocks(g),
            f"strategy.granularity must be null, {', '.join(map(repr, GRANULARITY_WORDS))}, 'elements:<n>', a positive "
            f"number of rows or a mapping of name globs to those, got {g!r}",
        )


def _is_element_blocks(value: Any) -> bool:
    from lightning_vescale.engine.planner import parse_element_blocks

    try:
        return parse_element_blocks(value) is not None
    except ValueError:
        return False


@dataclass
class DDPStrategyConfig(StrategyConfig):
    """Lightning's ``DDPStrategy`` (replicated parameters; the simplest baseline)."""

    _target_: str = "lightning.pytorch.strategies.DDPStrategy"
    """Import path of the strategy class."""
    process_group_backend: Optional[str] = None
    """``None``: gloo on CPU, nccl on CUDA."""
    find_unused_parameters: bool = False
    """Let DDP tolerate parameters without gradients (slower)."""


@dataclass
class ModelParallelStrategyConfig(StrategyConfig):
    """Lightning's ``ModelParallelStrategy`` with FSDP2 (``torch.distributed.fsdp.fully_shard``) applied by
    the recipe's module to each block and the root; it runs on CPU, so it is the reference baseline."""

    _target_: str = "lightning.pytorch.strategies.ModelParallelStrategy"
    """Import path of the strategy class."""
    data_parallel_size: Optional[int] = None
    """FSDP ranks; ``None``: every process (``devices * num_nodes``)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks (the recipe's models apply no tensor parallelism: keep 1)."""
    save_distributed_checkpoint: bool = True
    """Sharded (DCP) checkpoints; False gathers a full checkpoint on rank 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(
            self.tensor_parallel_size == 1,
            f"strategy.tensor_parallel_size={self.tensor_parallel_size}: the recipe applies FSDP2 only; keep 1",
        )


# ----------------------------------------------------------------------------------------------------
# Data and trainer
# ----------------------------------------------------------------------------------------------------


@dataclass
class MemoryConfig:
    """Where training state lives: :class:`lightning_vescale.memory.MemoryPolicy`'s fields, with its defaults and its
    checks, in types Hydra reads (a test keeps the two equal; ``disk_dir: null`` is ``<run dir>/swap``); group
    ``memory`` (``memory=offload_disk``, ``memory=checkpoint``, ``memory=budget memory.budget=6GiB``)."""

    optimizer_states: str = "device"
    """``device``, ``host`` or ``disk`` (swapped bucket by bucket, prefetched)."""
    params: str = "device"
    """The sharded master weights: ``device``, ``host`` or ``disk`` (read back before each AllGather, the next
    group's ahead, and for the optimizer step)."""
    grads: str = "device"
    """The sharded gradient pieces: ``device``, ``host`` or ``disk`` (written out after each ReduceScatter, read
    back by the optimizer step and clipping)."""
    gathered_params: str = "device"
    """The gathered parameters of groups that reshard after forward, between forward and backward: ``device``
    (gathered again for backward) or ``disk`` (written after forward, read back for backward instead of the
    AllGather); ``host`` only on CPU-only machines, where it is the device's memory."""
    activations: str = "device"
    """``device``, ``host``, ``disk`` or ``checkpoint`` (recompute the blocks' forward in backward)."""
    activation_blocks: list[str] = field(default_factory=lambda: ["*layers.*"])
    """Globs on module names (the recipe's LightningModule's: ``model.layers.0``) of the blocks ``activations`` acts on."""
    budget: Optional[str] = None
    """Bytes per rank (``6GiB``): choose ``params``, ``grads``, ``optimizer_states`` and ``activations`` by the cost
    model instead."""
    disk_dir: Optional[str] = None
    """Directory of the disk tier (``null``: ``<run dir>/swap``)."""
    prefetch: bool = True
    """Read the next bucket / block ahead on a background thread."""
    bucket_bytes: int = 64 * 2**20
    """Optimizer states swapped per bucket."""
    prefetch_buckets: int = 5
    """Buckets of offloaded optimizer states in memory at once with prefetch: more hides more disk time, at
    ``bucket_bytes`` more peak memory each."""

    def __post_init__(self) -> None:
        # The policy owns its checks; this config only holds its fields in types Hydra can read.
        from lightning_vescale.memory.policy import check_policy_fields

        check_policy_fields({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "memory.")


@dataclass
class DataConfig:
    """The corpus, tokenizer and windows (:class:`lightning_vescale.data.TextDataModule`)."""

    # The data module's arguments (Hydra needs them as fields); their defaults and checks are the data module's
    # own (lightning_vescale.data.options, which does not import Lightning); tests/unit/test_recipe_schema_drift.py
    # keeps the names equal.

    path: Optional[str] = MISSING
    """A UTF-8 text file; ``None``: the corpus embedded in the package. Required (``???``) so that
    ``data=text_file`` without ``data.path`` stops with a message naming ``data.path``."""
    tokenizer: str = TEXT_DATA_DEFAULTS.tokenizer
    """``"byte"`` (vocab 256) or ``"bpe"`` (trained on the corpus at start-up)."""
    bpe_vocab_size: int = TEXT_DATA_DEFAULTS.bpe_vocab_size
    """Upper bound of the BPE vocabulary (must fit the model's ``vocab_size``)."""
    seq_len: int = TEXT_DATA_DEFAULTS.seq_len
    """Tokens per window (must fit the model's ``max_seq_len``)."""
    batch_size: int = TEXT_DATA_DEFAULTS.batch_size
    """Windows per micro-batch per process."""
    val_fraction: float = TEXT_DATA_DEFAULTS.val_fraction
    """Tail of the corpus held out for validation."""
    stride: Optional[int] = TEXT_DATA_DEFAULTS.stride
    """Distance between training windows; ``None``: ``seq_len`` (no overlap)."""
    num_workers: int = TEXT_DATA_DEFAULTS.num_workers
    """DataLoader worker processes."""

    def __post_init__(self) -> None:
        if self.path is not None and not Path(self.path).is_file():
            load_text(self.path)  # raises FileNotFoundError naming the path
        problem = TextDataOptions(tokenizer=self.tokenizer, bpe_vocab_size=self.bpe_vocab_size, seq_len=self.seq_len,
                                  batch_size=self.batch_size, val_fraction=self.val_fraction, stride=self.stride,
                                  num_workers=self.num_workers).problem(prefix="data.", null="null")
        _check(problem is None, problem or "")

    @property
    def vocab_size(self) -> int:
        """The largest vocabulary the tokenizer can produce."""
        return 256 if self.tokenizer == "byte" else self.bpe_vocab_size


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` settings (same names and meanings), plus the recipe's step-based intervals."""

    accelerator: str = "cpu"
    """``"cpu"``, ``"gpu"``/``"cuda"`` or ``"auto"``."""
    devices: Any = 2
    """Processes per node: an int, ``"auto"``, or a list of device ids."""
    num_nodes: int = 1
    """Number of nodes."""
    precision: str = "32-true"
    """Lightning precision; set by the ``precision`` group (fp32, bf16_mixed, bf16_true)."""
    max_steps: int = 300
    """Optimizer steps to train (the learning-rate schedule ends here)."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step."""
    gradient_clip_val: Optional[float] = 1.0
    """Clip the global gradient norm to this; ``None`` disables clipping."""
    val_every_n_steps: int = 100
    """Run validation every this many optimizer steps."""
    limit_val_batches: int = 8
    """Validation batches per validation run."""
    log_every_n_steps: int = 10
    """Write logged metrics (CSV, TensorBoard) every this many steps. The progress bar updates every step in a
    terminal; when stdout is not a terminal (a log file, a scheduler) one line is printed every this many steps."""
    checkpoint_every_n_steps: int = 100
    """Save a checkpoint every this many optimizer steps (and at the end); 0 disables checkpoints."""
    checkpoint_keep: int = -1
    """``-1``: keep every checkpoint; ``1``: keep only the latest."""
    save_on_signal: bool = True
    """When SIGTERM stops the run (a scheduler's preemption, ``timeout``), save a checkpoint of the last
    completed step before exiting (exit code 143), so ``resume=true`` continues from it."""
    num_sanity_val_steps: int = 0
    """Validation batches run before training as a smoke test."""
    deterministic: bool = False
    """``torch.use_deterministic_algorithms``."""
    enable_progress_bar: bool = True
    """Show progress (loss, tokens/s, communication bytes per step): a bar in a terminal, otherwise a line
    every ``log_every_n_steps`` steps."""
    on_non_finite: str = "stop"
    """A step whose loss or gradients are not finite (NaN, inf) on any rank: ``"stop"`` ends the run on every rank
    before the optimizer step, naming the step and the ranks (the weights and checkpoints stay those of the step
    before); ``"skip"`` skips that optimizer step on every rank and counts it (``skipped_steps`` in the logs and
    ``summary.json``)."""

    def __post_init__(self) -> None:
        _check(
            (isinstance(self.devices, (int, list)) and not isinstance(self.devices, bool)) or self.devices == "auto",
            f"trainer.devices must be an int, 'auto' or a list of ids, got {self.devices!r}",
        )
        if isinstance(self.devices, int):
            _check(self.devices >= 1, f"trainer.devices must be >= 1, got {self.devices}")
        _check(self.num_nodes >= 1, f"trainer.num_nodes must be >= 1, got {self.num_nodes}")
        _check(
            self.precision in PRECISIONS,
            f"trainer.precision must be one of {', '.join(PRECISIONS)} (pick it with precision=fp32, bf16_mixed "
            f"or bf16_true), got {self.precision!r}",
        )
        _check(self.max_steps >= 1, f"trainer.max_steps must be >= 1, got {self.max_steps}")
        for name in ("accumulate_grad_batches", "val_every_n_steps", "log_every_n_steps"):
            _check(getattr(self, name) >= 1, f"trainer.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.limit_val_batches >= 0, f"trainer.limit_val_batches must be >= 0, got {self.limit_val_batches}")
        _check(
            self.checkpoint_every_n_steps >= 0,
            f"trainer.checkpoint_every_n_steps must be >= 0 (0 disables), got {self.checkpoint_every_n_steps}",
        )
        _check(self.checkpoint_keep in (-1, 1), f"trainer.checkpoint_keep must be -1 or 1, got {self.checkpoint_keep}")
        _check(
            self.gradient_clip_val is None or 0 < self.gradient_clip_val < math.inf,
            f"trainer.gradient_clip_val must be a finite number > 0 or null, got {self.gradient_clip_val}",
        )
        _check(self.on_non_finite in ("stop", "skip"),
               f"trainer.on_non_finite must be 'stop' or 'skip', got {self.on_non_finite!r}")


# ----------------------------------------------------------------------------------------------------
# Block-quantized weights
# ----------------------------------------------------------------------------------------------------

QUANT_MODES = ("qlora", "gather")


def _quant_default(name: str) -> Any:
    """``quantize_all_gather``'s default for ``name`` (``quantize_frozen_weights`` has the same ones)."""
    return inspect.signature(quantize_all_gather).parameters[name].default


@dataclass
class QuantConfig:
    """Block-quantized weights (group ``quant``; see :mod:`lightning_vescale.quant`). Needs ``strategy=vescale``.

    ``format`` and ``block_size`` are a :class:`~lightning_vescale.quant.BlockFormat`, ``lora_*`` a
    :class:`~lightning_vescale.quant.lora.LoRAConfig`: their defaults, and their checks (after the ones below, which
    name the config's keys), are those classes' own; :meth:`block_format` and :meth:`lora_config` build them."""

    mode: str = MISSING
    """``qlora`` (``recipes/finetune.py``): the base model is frozen and stored sharded as codes + scales, LoRA
    adapters train. ``gather``: every weight trains as usual, but the AllGather moves codes + scales."""
    format: str = BlockFormat.kind
    """``fp8_e4m3`` (scale = amax / 448, as DeepSeek-V3) or ``int8`` (symmetric absmax)."""
    block_size: int = BlockFormat.block_size
    """One fp32 scale per ``block_size x block_size`` tile (e.g. 64 or 128)."""
    targets: list[str] = field(default_factory=lambda: list(_quant_default("targets")))
    """Globs over parameter names: the 2-D / 3-D weights to quantize (1-D tensors never are)."""
    exclude: list[str] = field(default_factory=lambda: ["tok_embeddings.*", "output.*", "*.router.*"])
    """Globs over parameter names left unquantized (embeddings, the head and MoE routers by default, as
    DeepSeek-V3's FP8 checkpoints keep them)."""
    lora_rank: int = LoRAConfig.rank
    """``qlora``: rank of each adapter."""
    lora_alpha: float = LoRAConfig.alpha
    """``qlora``: adapter outputs are scaled by ``lora_alpha / lora_rank``."""
    lora_targets: list[str] = field(default_factory=lambda: list(LoRAConfig.targets))
    """``qlora``: globs over module names of the ``nn.Linear`` layers that get adapters (each must match one)."""

    def __post_init__(self) -> None:
        _check(self.mode in QUANT_MODES, f"quant.mode must be one of {', '.join(QUANT_MODES)}, got {self.mode!r} "
                                         f"(pick it with quant=fp8_block, int8_block, fp8_gather or int8_gather)")
        # The recipe takes the formats' canonical names only (BlockFormat also reads aliases like fp8_block).
        _check(self.format in FORMATS, f"quant.format must be {_or(FORMATS)}, got {self.format!r}")
        _check(isinstance(self.block_size, int) and self.block_size > 0,
               f"quant.block_size must be a positive int (e.g. 128), got {self.block_size!r}")
        _check(self.lora_rank > 0, f"quant.lora_rank must be > 0, got {self.lora_rank}")
        _check(self.lora_alpha > 0, f"quant.lora_alpha must be > 0, got {self.lora_alpha}")
        _check(bool(self.targets), "quant.targets is empty: give parameter-name globs, e.g. ['*']")
        if self.mode == "qlora":
            _check(bool(self.lora_targets), "quant.lora_targets is empty: give module-name globs, e.g. ['*attention.w*']")
        # Whatever else the components refuse, they refuse here too, before the run starts.
        self.block_format()
        if self.mode == "qlora":
            self.lora_config()

    def block_format(self) -> BlockFormat:
        """The format of the quantized weights."""
        return BlockFormat(self.format, self.block_size)

    def lora_config(self) -> LoRAConfig:
        """The adapters of a ``qlora`` run."""
        return LoRAConfig(rank=self.lora_rank, alpha=self.lora_alpha, targets=tuple(self.lora_targets))


# ----------------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------------


def _check_plan(plan: Any, model: ModelConfig, strategy: StrategyConfig) -> dict:
    """The plan as a plain dict, checked: its keys and values, and against the model (built on the meta device,
    named as the recipe's LightningModule names it), so a typo stops the run before it starts."""
    import torch
    from torch import nn

    from lightning_vescale.plan import Plan, resolve_plan

    if isinstance(plan, DictConfig):
        plan = OmegaConf.to_container(plan, resolve=True)
    _check(
        isinstance(strategy, VeScaleStrategyConfig),
        f"plan= applies to strategy=vescale (the declarative plan of lightning_vescale), but the strategy is "
        f"{strategy._target_}: drop the plan or use strategy=vescale",
    )
    parsed = Plan.from_dict(plan)  # PlanError (a ValueError) names the rule and the key
    with torch.device("meta"):
        wrapper = type("CausalLMModule", (nn.Module,), {})()  # named as the recipe's LightningModule
        wrapper.model = model.build_model()  # the attribute CausalLMModule keeps it under
    assert isinstance(strategy, VeScaleStrategyConfig)
    granularity = strategy.granularity
    defaults: dict[str, Any] = {"reshard_after_forward": strategy.reshard_after_forward}
    if isinstance(granularity, (str, int)) and granularity is not None:
        defaults["granularity"] = granularity
    resolve_plan(wrapper, parsed, roots=[wrapper.model], defaults=defaults)
    return plan




@dataclass
class TrainConfig:
    """A pre-training run (``recipes/train.py``)."""

    model: ModelConfig = MISSING
    """The model (group ``model``)."""
    optimizer: OptimizerConfig = MISSING
    """The optimizer (group ``optimizer``)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The learning-rate schedule."""
    strategy: StrategyConfig = MISSING
    """The Lightning strategy (group ``strategy``)."""
    data: DataConfig = MISSING
    """The data (group ``data``)."""
    trainer: TrainerConfig = MISSING
    """Trainer settings (groups ``trainer`` and ``precision``)."""
    name: str = MISSING
    """Run name; runs are written to ``{output_root}/{name}/{timestamp}``."""
    output_root: str = "outputs"
    """Directory that holds the runs (resume searches it)."""
    seed: int = 1234
    """Seed of model initialization and data order (same on every rank)."""
    resume: Any = False
    """``true``: continue the newest run of this name (its ``checkpoints/last.ckpt``); or a run directory to
    continue. The model, optimizer, schedule, precision, data, seed and strategy settings must match the run's saved
    config (the world size may change: checkpoints reshard). The continued run writes a new run directory."""
    ckpt_path: Optional[str] = None
    """Continue from this checkpoint (exclusive with ``resume``; checked against its run's config the same way)."""
    resume_strict: bool = True
    """``false``: continue a run even if its settings differ (e.g. to lower the learning rate); the differences are
    logged as warnings instead of stopping the run."""
    expert_bias_rate: float = 1e-3
    """MoE auxiliary-loss-free balancing: expert-bias step per optimizer step; 0 disables (no effect on Llama)."""
    plan: Any = None
    """The declarative sharding plan of ``strategy=vescale`` (group ``plan``: ``plan=llama``, ``plan=moe``; files in
    ``configs/plan/``, fields overridable as ``plan.fallback.prefetch=2``); names as the recipe's LightningModule
    sees them (``model.layers.0``; ``**.layers.*`` matches them). ``null``: the strategy's default plan (every
    transformer block a group). Checked against the model before the run starts."""
    trusted_target_modules: list[str] = field(default_factory=list)
    """Your own packages whose classes and functions ``_target_`` may name (next to ``torch.optim``,
    ``lightning_vescale`` and Lightning's strategies); see :mod:`lightning_vescale.recipe.targets`."""
    allow_any_target: bool = False
    """Let ``_target_`` name anything importable (Hydra's own blocklist still applies): trusted configs only."""

    memory: Optional[MemoryConfig] = None
    """Where weights, gradients, optimizer states and activations live (group ``memory``: ``offload_disk``, ``checkpoint``, ``budget``);
    null: everything on the device."""
    quant: Optional[QuantConfig] = None
    """Block-quantized weights (group ``quant``: ``fp8_block`` / ``int8_block`` for QLoRA-style fine-tuning,
    ``fp8_gather`` / ``int8_gather`` for a quantized AllGather); null: none."""

    mpmd: Optional[MPMDConfig] = None
    """Sub-models on different groups of ranks, pipelined (``experiment=vlm_mpmd``; see
    :mod:`lightning_vescale.recipe.mpmd`); null: the Lightning Trainer with ``strategy``."""

    notes: dict[str, Any] = field(default_factory=dict)
    """Free-form: anything to keep with the run (``+notes.purpose=lr_sweep``); stored in ``.hydra/config.yaml`` and
    ``summary.json``. The only section that accepts keys the schema does not define."""

    def __post_init__(self) -> None:
        check_config_targets(self, trusted_modules=self.trusted_target_modules, allow_any=self.allow_any_target)
        _check(
            isinstance(self.resume, bool) or (isinstance(self.resume, str) and self.resume.strip() != ""),
            f"resume must be true, false or a run directory, got {self.resume!r}",
        )
        arch = self.model.build_config()
        where = f"model={self.model.family}_{self.model.preset}"
        _check(
            self.data.seq_len <= arch.max_seq_len,
            f"data.seq_len={self.data.seq_len} exceeds {where} max_seq_len={arch.max_seq_len}; lower data.seq_len "
            f"or set model.max_seq_len",
        )
        _check(
            self.data.vocab_size <= arch.vocab_size,
            f"data.tokenizer={self.data.tokenizer} can produce {self.data.vocab_size} token ids but {where} has "
            f"vocab_size={arch.vocab_size}; use a smaller tokenizer vocabulary or a larger model.vocab_size",
        )
        _check(
            not (self.resume and self.ckpt_path),
            f"set either resume=... or ckpt_path=..., not both (got resume={self.resume!r}, "
            f"ckpt_path={self.ckpt_path!r})",
        )
        _check(0 <= self.expert_bias_rate < math.inf,
               f"expert_bias_rate must be a finite number >= 0, got {self.expert_bias_rate}")
        ep = getattr(self.strategy, "expert_parallel_size", 1)
        if ep > 1:
            _check(
                hasattr(arch, "num_experts"),
                f"strategy.expert_parallel_size={ep} needs an MoE model (expert modules to split), but {where} has no "
                f"experts; pick e.g. model=moe_tiny or set strategy.expert_parallel_size=1",
            )
            devices = self.trainer.devices
            per_node = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) else None
            if per_node is not None:
                world = per_node * self.trainer.num_nodes
                _check(
                    world % ep == 0,
                    f"strategy.expert_parallel_size={ep} does not divide the world size {world} "
                    f"(trainer.devices={devices} * trainer.num_nodes={self.trainer.num_nodes})",
                )
                tp = getattr(self.strategy, "tensor_parallel_size", 1)
                _check(
                    world % (ep * tp) == 0,
                    f"strategy.expert_parallel_size={ep} times strategy.tensor_parallel_size={tp} does not divide the "
                    f"world size {world} (the ('dp', 'ep', 'tp') mesh; trainer.devices={devices} * trainer.num_nodes="
                    f"{self.trainer.num_nodes})",
                )
            assert not isinstance(arch, LlamaConfig)  # it has experts
            _check(
                arch.num_experts % ep == 0,
                f"strategy.expert_parallel_size={ep} does not divide the {arch.num_experts} experts of {where}",
            )
        self._check_tensor_parallel(arch, where)
        _check(bool(self.name) and not any(c in self.name for c in "/\\\0") and self.name not in (".", ".."),
               f"name must be a directory name (not empty, '.' or '..', without '/'), so the run stays under "
               f"output_root/<name>/; got {self.name!r}")
        if self.quant is not None:
            _check(isinstance(self.strategy, VeScaleStrategyConfig),
                   f"quant={self.quant.format} ({self.quant.mode}) needs strategy=vescale (block-quantized weights are "
                   f"stored and gathered by its engine), got {type(self.strategy).__name__}")
            _check(self.quant.mode != "qlora" or isinstance(self, FinetuneConfig),
                   "quant mode qlora trains adapters on frozen weights: run recipes/finetune.py init_from=... (use "
                   "quant=fp8_gather or int8_gather for a quantized AllGather while pre-training)")
        if self.plan is not None:
            self.plan = _check_plan(self.plan, self.model, self.strategy)
        if self.mpmd is not None:
            # An MPMD run reads mpmd.*, optimizer, scheduler, seed and trainer (lightning_vescale/recipe/mpmd.py);
            # these would be silently ignored there.
            ignored = [f"{name}=..." for name, value in (("plan", self.plan), ("quant", self.quant),
                                                         ("memory", self.memory)) if value is not None]
            ignored += [f"precision={self.trainer.precision}"] if self.trainer.precision != "32-true" else []
            _check(not ignored, f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} not applied to MPMD runs "
                   f"yet (stages are sharded by mpmd.plan's stage plans, in fp32, every state on the device): drop "
                   f"{'it' if len(ignored) == 1 else 'them'}, or set mpmd=null to train one model over every rank")
            if isinstance(self.trainer.devices, int):
                self.mpmd.check_world_size(self.trainer.devices * self.trainer.num_nodes)
        if self.memory is not None:
            _check(isinstance(self.strategy, VeScaleStrategyConfig),
                   f"memory=... needs strategy=vescale (its engine owns the buffers that move between tiers), got "
                   f"{type(self.strategy).__name__}")

    def _check_tensor_parallel(self, arch: Any, where: str) -> None:
        """``strategy.tensor_parallel_size``: divides the world size and the model's heads, and a plan splits it."""
        tp = getattr(self.strategy, "tensor_parallel_size", 1)
        if tp == 1:
            return
        devices = self.trainer.devices
        per_node = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) else None
        if per_node is not None:
            world = per_node * self.trainer.num_nodes
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            _check(world % tp == 0, f"strategy.tensor_parallel_size={tp} does not divide the world size {world} "
                   f"(trainer.devices={devices} * trainer.num_nodes={self.trainer.num_nodes}); use one of "
                   f"{', '.join(map(str, divisors))}")
        for attr in ("n_heads", "n_kv_heads"):
            heads = getattr(arch, attr, None)
            _check(heads is None or heads % tp == 0,
                   f"strategy.tensor_parallel_size={tp} does not divide {where}'s {attr}={heads}: each tensor-parallel "
                   f"rank holds whole attention heads; use a tp size dividing {attr}")
        _check(self.plan is not None, f"strategy.tensor_parallel_size={tp} needs a plan whose tp rules say which modules "
               f"to split: add plan=llama (plan=moe, plan=deepseek_v3 for those families; or a plan of your own with "
               f"tp rules)")
        _check(self.mpmd is None, f"strategy.tensor_parallel_size={tp} is not applied to MPMD runs yet: set mpmd=null "
               f"or strategy.tensor_parallel_size=1")


@dataclass
class FinetuneConfig(TrainConfig):
    """A fine-tuning run (``recipes/finetune.py``): like :class:`TrainConfig`, starting from given weights."""

    init_from: str = MISSING
    """A Hugging Face checkpoint directory (``config.json`` + safetensors), a recipe run directory or one of its
    checkpoints, or a full state-dict file (``.pt``/``.pth``/``.bin``: ``torch.save`` of a ``state_dict``; or
    ``.safetensors``). ``model=from_checkpoint`` (the default) takes the model config from it."""
    export_hf: bool = False
    """At the end, write the final weights as a Hugging Face directory ``<run>/hf`` (``config.json``,
    ``model.safetensors`` and the tokenizer files of ``init_from``), as ``python -m lightning_vescale.export``."""
    allow_unverified: bool = False
    """Start from a sharded checkpoint (``init_from``) whose ``checksums.json`` is missing, so its bytes cannot be
    verified; by default such a checkpoint is refused before the run starts."""

    def __post_init__(self) -> None:
        super().__post_init__()
        path = Path(self.init_from)
        _check(
            path.exists(),
            f"init_from={self.init_from!r} does not exist (resolved to {str(path.resolve())!r}); pass a Hugging "
            "Face checkpoint directory, a recipe run or checkpoint, or a full state-dict file",
        )


# ----------------------------------------------------------------------------------------------------
# Registration and validation
# ----------------------------------------------------------------------------------------------------


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent).

    The top-level schemas are ``train_schema`` / ``finetune_schema``; a group's schemas live in
    ``schema/<group>/<name>`` (not in the group itself, so they are not listed as options), and each
    YAML option extends one with ``- /schema/<group>/<name>@_here_`` in its defaults list.
    """
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="finetune_schema", node=FinetuneConfig)
    cs.store(group="schema/model", name="llama", node=LlamaModelConfig)
    cs.store(group="schema/model", name="moe", node=MoEModelConfig)
    cs.store(group="schema/model", name="qwen3_moe", node=Qwen3MoEModelConfig)
    cs.store(group="schema/model", name="deepseek_v3", node=DeepSeekV3ModelConfig)
    cs.store(group="schema/model", name="from_checkpoint", node=CheckpointModelConfig)
    cs.store(group="schema/optimizer", name="adamw", node=AdamWConfig)
    cs.store(group="schema/optimizer", name="muon", node=MuonConfig)
    cs.store(group="schema/optimizer", name="adamw8bit", node=AdamW8bitConfig)
    cs.store(group="schema/strategy", name="vescale", node=VeScaleStrategyConfig)
    cs.store(group="schema/strategy", name="ddp", node=DDPStrategyConfig)
    cs.store(group="schema/strategy", name="model_parallel", node=ModelParallelStrategyConfig)
    cs.store(group="schema/data", name="data", node=DataConfig)
    cs.store(group="schema/trainer", name="trainer", node=TrainerConfig)
    cs.store(group="schema/quant", name="quant", node=QuantConfig)
    cs.store(group="schema/memory", name="memory", node=MemoryConfig)


FREE_FORM_SECTIONS = ("notes",)
"""Top-level sections that accept any key (``+notes.<key>=...``); every other key must be a schema field."""


def check_known_keys(cfg: DictConfig) -> None:
    """Reject keys the schema does not define (added with ``+key=value``), outside :data:`FREE_FORM_SECTIONS`.

    Hydra's ``+`` adds a key even to a typed config, and the dataclasses would carry it silently.

    Raises:
        ValueError: names every unknown key, the closest valid names, and the free-form section.
    """
    import difflib

    problems: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        schema = OmegaConf.get_type(node)
        fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
        for key, value in node.items_ex(resolve=False):
            full = f"{prefix}{key!s}"
            if not prefix and full in FREE_FORM_SECTIONS:
                continue
            if fields is not None and key not in fields:
                close = difflib.get_close_matches(str(key), sorted(fields), n=2)
                hint = f" (did you mean {' or '.join(prefix + c for c in close)}?)" if close else ""
                problems.append(full + hint)
            elif isinstance(value, DictConfig) and not (value._is_none() or value._is_missing()):
                walk(value, f"{full}.")

    walk(cfg, "")
    if problems:
        raise ValueError(
            f"unknown config key(s): {', '.join(problems)}. Every key is checked against the schema "
            f"(python recipes/train.py --help lists them); to keep your own values with the run, put them under "
            f"notes, e.g. +notes.{problems[0].split(' ')[0].rsplit('.', 1)[-1]}=..."
        )


def validate(cfg: Union[DictConfig, TrainConfig]) -> TrainConfig:
    """The composed config as validated dataclasses (a :class:`TrainConfig` or :class:`FinetuneConfig`).

    Raises:
        omegaconf.errors.MissingMandatoryValue: a required value (``???``) was not given; names the key.
        ValueError: a bad value or a key the schema does not define; the message names the field, the value
            and what is allowed.
        FileNotFoundError: ``data.path`` or ``init_from`` does not exist; names the path.
    """
    if isinstance(cfg, TrainConfig):
        return cfg
    check_known_keys(cfg)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise TypeError(
            f"expected a config composed from train.yaml or finetune.yaml (schema TrainConfig), "
            f"got {type(obj).__name__}"
        )
    return obj


register_configs()
