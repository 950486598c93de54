"""What a recipe checks before its run directory exists: the config, the checkpoint to resume, the weights to
start from, and what the run needs from the machine and its data (GPUs, memory, a usable corpus).

:class:`CheckBeforeRun` is a Hydra callback (``hydra.callbacks`` in ``configs/train.yaml`` and
``configs/finetune.yaml``): Hydra calls it after composing the config and before it creates the run
directory. A problem is printed as one message naming the key and the fix, without a traceback, and the
process exits with code 2 (as argparse does); nothing is written. :func:`preflight` is the same check as a
function (``recipe.run`` calls it again, so a config given programmatically is checked too).

[Note: what resume compares]
A run continues only with the settings it was trained with: the model (every architecture field that
shapes the weights), the optimizer, the learning-rate schedule, ``trainer.precision``, the data (all but
``num_workers``), the seed, the strategy (its class and every setting but ``timeout`` and
``process_group_backend``: an HSDP run is not continued by a plain ``strategy=vescale`` command) and the
quantization. They are compared against the run's saved ``.hydra/config.yaml`` (and ``model.json``); a difference
stops with the list of differing keys and the overrides that give them back, naming a group's option where the
class differs (``strategy=ddp``: ``strategy._target_=...`` alone would keep the other class's fields) (or, with
``resume_strict=false``, is logged as a warning). The world size, ``accumulate_grad_batches`` and
``max_steps`` may change (sharded checkpoints reshard); the run says so when it starts.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException

from lightning_vescale.export import (
    check_tokenizer_files,
    checkpoint_step,
    locate_checkpoint,
    read_run_model,
    tokenizer_source_of,
)
from lightning_vescale.models.hf import read_pretrained_config
from lightning_vescale.recipe.paths import absolute
from lightning_vescale.recipe.schema import CheckpointModelConfig, FinetuneConfig, ModelConfig, TrainConfig, validate

__all__ = [
    "CheckBeforeRun",
    "ConfigError",
    "Preflight",
    "Resume",
    "check_same_architecture",
    "compare_with_run",
    "find_last_checkpoint",
    "preflight",
    "resolve_resume",
]

T = TypeVar("T")

# Architecture fields that do not change the weights' meaning (sizes of RoPE tables, init, derivations).
ARCH_FIELDS_IGNORED = frozenset({"init_std", "max_seq_len", "multiple_of", "ffn_dim_multiplier"})
# Sections compared on resume (flattened keys); keys under these prefixes must be equal.
_MUST_MATCH_PREFIXES = ("optimizer.", "scheduler.", "data.", "strategy.", "quant.")
_MUST_MATCH_KEYS = ("seed", "trainer.precision", "quant")
_NOT_SET = "(not set)"
_MAY_CHANGE = frozenset({"data.num_workers", "strategy.timeout", "strategy.process_group_backend"})
# The option of a group that builds a given class, for a run saved without its Hydra choices.
_OPTION_OF_TARGET = {
    "lightning_vescale.lightning.VeScaleStrategy": "vescale",
    "lightning.pytorch.strategies.DDPStrategy": "ddp",
    "lightning.pytorch.strategies.ModelParallelStrategy": "fsdp2",
    "torch.optim.AdamW": "adamw",
    "lightning_vescale.optim.build_optimizer": "muon",
    "lightning_vescale.optim.AdamW8bit": "adamw8bit",
}


class ConfigError(ValueError):
    """A problem with the config or the files it names, found before the run starts; the message names the
    key and the fix."""


@dataclass
class Resume:
    """The checkpoint a run continues from."""

    checkpoint: Path
    """The checkpoint (a sharded directory, or a file for DDP)."""
    run_dir: Optional[Path]
    """The run that wrote it (``None`` for a checkpoint outside a run directory)."""
    step: Optional[int]
    """The optimizer step it was saved at (from its ``step-NNNNNN`` name), if known."""
    notes: list[str] = field(default_factory=list)
    """Settings that changed and may change (world size, ...), for the start-up log."""
    reason: str = ""
    """Which run is continued and why (the newest of its name, its settings match), for the start-up log."""


@dataclass
class Preflight:
    """A checked run: its validated config and what it resumes from."""

    config: TrainConfig
    resume: Optional[Resume]



def _run_time(checkpoints: Path) -> float:
    """When a run's ``checkpoints/`` last changed: its newest checkpoint or ``last.ckpt`` (links not followed)."""
    entries = [p for p in checkpoints.glob("step-*") if ".tmp-" not in p.name] + [checkpoints / "last.ckpt"]
    times = [os.lstat(p).st_mtime for p in entries if os.path.lexists(p)]
    if (checkpoints / "last.ckpt").exists():
        times.append(os.path.getmtime(checkpoints / "last.ckpt"))
    return max(times, default=float("-inf"))


def find_last_checkpoint(output_root: Union[str, Path], name: str, run_dir: Optional[Path] = None) -> Optional[Path]:
    """The ``checkpoints/last.ckpt`` of the newest run named ``name`` (in ``run_dir`` or under
    ``output_root/name``) that saved a checkpoint; ``None`` when none did.

    Raises:
        ConfigError: the newest run's ``last.ckpt`` is missing or names no checkpoint (a run killed while it
            saved): resuming never continues an older run instead without saying so.
    """
    folders = {Path(c) for c in glob.glob(os.path.join(str(output_root), name, "*", "checkpoints"))}
    if run_dir is not None:
        folders.add(run_dir / "checkpoints")
    saved = [(t, f) for f in folders if f.is_dir() and (t := _run_time(f)) > float("-inf")]
    if not saved:
        return None
    _, newest = max(saved, key=lambda tf: (tf[0], str(tf[1])))
    last = newest / "last.ckpt"
    if last.exists():  # exists() follows the link
        return last
    steps = sorted(p.name for p in newest.glob("step-*")
                   if ".tmp-" not in p.name and ((p / ".metadata").is_file() or p.is_file()))
    target = f" (it names {os.readlink(last)!r}, which does not exist)" if os.path.islink(last) else " (it is missing)"
    raise ConfigError(
        f"resume=true: the newest run named {name!r}, {newest.parent}, has no usable checkpoints/last.ckpt{target}; "
        f"it was probably killed while saving. Its complete checkpoints: {steps or 'none'}. Continue it from one of them "
        f"with ckpt_path={newest / steps[-1] if steps else '<checkpoint>'}, or continue another run with "
        f"resume=<run dir> (an older run is never picked instead)"
    )


# ----------------------------------------------------------------------------------------------------
# Comparing a run's saved config
# ----------------------------------------------------------------------------------------------------


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def _cli_value(value: Any) -> str:
    """A value as a Hydra command-line override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_cli_value(v) for v in value) + "]"
    return str(value)


def _world_size(trainer: dict[str, Any]) -> Optional[int]:
    devices = trainer.get("devices")
    per_node = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) else None
    return None if per_node is None else per_node * int(trainer.get("num_nodes", 1))


def _model_differences(model: ModelConfig, run_dir: Path) -> list[tuple[str, Any, Any]]:
    theirs, _ = read_run_model(run_dir)
    ours = model.build_config()
    if type(theirs) is not type(ours):
        return [("model", f"a {type(theirs).__name__}", f"a {type(ours).__name__}")]
    return [
        (f"model.{f.name}", getattr(theirs, f.name), getattr(ours, f.name))
        for f in dataclasses.fields(ours)
        if f.name not in ARCH_FIELDS_IGNORED and getattr(theirs, f.name) != getattr(ours, f.name)
    ]


def compare_with_run(config: TrainConfig, run_dir: Path) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """``(differences, notes)`` between ``config`` and the saved config of ``run_dir``.

    ``differences`` are ``(key, saved, now)`` for the settings a continued run must keep (see
    [Note: what resume compares]); ``notes`` describe allowed changes (world size, accumulation, max_steps).
    """
    saved_file = run_dir / ".hydra" / "config.yaml"
    if not saved_file.is_file():
        return [], [f"{run_dir} has no .hydra/config.yaml, so its settings were not compared with this run's"]
    saved_cfg = OmegaConf.load(saved_file)
    try:
        saved = OmegaConf.to_container(saved_cfg, resolve=True)
    except OmegaConfBaseException:
        saved = OmegaConf.to_container(saved_cfg, resolve=False)
    now = OmegaConf.to_container(OmegaConf.structured(config), resolve=True)
    assert isinstance(saved, dict) and isinstance(now, dict)
    try:
        differences = _model_differences(config.model, run_dir)
    except (OSError, ValueError, KeyError, TypeError):  # an older layout: compare the model section as written
        differences = [
            (k, v, _flatten(now).get(k)) for k, v in _flatten(saved.get("model", {}), "model.").items()
            if _flatten(now).get(k) != v
        ]
    flat_saved, flat_now = _flatten(saved), _flatten(now)
    for key in sorted(set(flat_saved) | set(flat_now)):
        if key in _MAY_CHANGE or not (key.startswith(_MUST_MATCH_PREFIXES) or key in _MUST_MATCH_KEYS):
            continue
        if key not in flat_saved:
            continue  # a setting newer than the saved run
        if flat_saved[key] != flat_now.get(key):
            differences.append((key, flat_saved[key], flat_now.get(key, _NOT_SET)))
    notes = []
    saved_trainer, now_trainer = saved.get("trainer", {}), now["trainer"]
    before, after = _world_size(saved_trainer), _world_size(now_trainer)
    if before is not None and after is not None and before != after:
        notes.append(
            f"the run was trained on {before} processes and continues on {after}: the sharded checkpoint reshards, "
            f"the global batch changes from {before} to {after} x data.batch_size windows per micro-batch, and the "
            f"batches after the checkpoint are not those an uninterrupted run would have seen"
        )
    for key in ("accumulate_grad_batches", "max_steps"):
        old, new = saved_trainer.get(key), now_trainer.get(key)
        if old is not None and old != new:
            notes.append(f"trainer.{key} changes from {old} to {new}"
                         + (" (the learning-rate schedule now ends there)" if key == "max_steps" else ""))
    return differences, notes


def _saved_choices(run_dir: Optional[Path]) -> dict[str, Any]:
    """The config-group options the run was composed from (``.hydra/hydra.yaml``), if it kept them."""
    hydra_file = None if run_dir is None else run_dir / ".hydra" / "hydra.yaml"
    if hydra_file is None or not hydra_file.is_file():
        return {}
    try:
        choices = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.choices", default=None)
    except (OSError, OmegaConfBaseException):
        return {}
    return dict(choices) if choices is not None else {}


def _fixes(differences: list[tuple[str, Any, Any]], run_dir: Optional[Path]) -> list[str]:
    """The overrides that give back a run's settings: ``group=option`` where the saved class differs (its
    ``_target_``, or the model family; setting ``_target_`` alone would keep the other class's fields), then
    ``key=value`` for the other keys."""
    choices = _saved_choices(run_dir)
    fixes, groups = [], set()
    for key, saved, _ in differences:
        group = key.split(".")[0]
        if key == "model" or key.endswith("._target_"):
            option = choices.get(group) or (_OPTION_OF_TARGET.get(saved) if key.endswith("._target_") else None)
            if option is not None and group not in groups:
                fixes.append(f"{group}={option}")
                groups.add(group)
    for key, saved, now in differences:
        if key == "model" or key.endswith("._target_") or (key.split(".")[0] in groups and now == _NOT_SET):
            continue  # the option brings the fields of its class
        fixes.append(f"{key}={_cli_value(saved)}")
    return fixes


def _matching_runs(config: TrainConfig, root: Path, exclude: Optional[Path]) -> list[Path]:
    runs = []
    for last in glob.glob(os.path.join(str(root), config.name, "*", "checkpoints", "last.ckpt")):
        run_dir = Path(last).parent.parent
        if run_dir == exclude or not os.path.exists(last):
            continue
        step = checkpoint_step(last)
        if step is not None and step >= config.trainer.max_steps:
            continue
        if not compare_with_run(config, run_dir)[0]:
            runs.append(run_dir)
    return sorted(runs)


def resolve_resume(config: TrainConfig, run_dir: Optional[Path] = None) -> Optional[Resume]:
    """The checkpoint ``config`` continues from (``resume`` or ``ckpt_path``), checked against its run.

    Raises:
        ConfigError: no checkpoint to resume; the run was trained with other settings (lists the differing
            keys, with the overrides that match them and other runs of this name that match); or it already
            reached ``trainer.max_steps`` (says how to extend it).
    """
    root = absolute(config.output_root)
    if config.ckpt_path:
        path = absolute(config.ckpt_path)
        if not path.exists():
            raise ConfigError(f"ckpt_path={config.ckpt_path!r} does not exist (resolved to {str(path)!r})")
        checkpoint, ckpt_run = path, (path.parent.parent if path.parent.name == "checkpoints" else None)
        what = f"ckpt_path={config.ckpt_path}"
    elif config.resume is True:
        found = find_last_checkpoint(root, config.name, run_dir)
        if found is None:
            raise ConfigError(
                f"resume=true found no checkpoint to continue: no run named {config.name!r} under {str(root)!r} has "
                f"checkpoints/last.ckpt. Start without resume, or pass resume=<run dir> or ckpt_path=<checkpoint>"
            )
        checkpoint, ckpt_run = found, found.parent.parent
        what = "resume=true"
    elif isinstance(config.resume, str):
        try:
            checkpoint, ckpt_run = locate_checkpoint(absolute(config.resume))
        except FileNotFoundError as err:
            raise ConfigError(f"resume={config.resume}: {err}") from None
        what = f"resume={config.resume}"
    else:
        return None
    checkpoint = Path(os.path.realpath(checkpoint))  # read once: a save that relinks last.ckpt cannot mix steps in
    step = checkpoint_step(checkpoint)
    differences, notes = compare_with_run(config, ckpt_run) if ckpt_run is not None else ([], [])
    where = f"{ckpt_run or checkpoint}" + (f" (checkpoint at step {step})" if step is not None else "")
    reason = f"{what} continues {where}"
    if config.resume is True:
        runs = len(glob.glob(os.path.join(str(root), config.name, "*", "checkpoints", "last.ckpt")))
        reason += (f": the newest of the {runs} run(s) named {config.name!r} under {str(root)!r} with a "
                   f"checkpoints/last.ckpt")
    reason += ("; its settings differ (resume_strict=false)" if differences else
               "; its settings match this run's" if ckpt_run is not None else "")
    reason += ". The continued run writes a new run directory"
    if differences and not config.resume_strict:
        notes = [f"{key} differs from the run's: saved {saved!r}, now {now!r} (resume_strict=false)"
                 for key, saved, now in differences] + notes
    elif differences:
        lines = [f"  {key}: saved {saved!r}, now {now!r}" for key, saved, now in differences]
        fixes = " ".join(_fixes(differences, ckpt_run))
        others = _matching_runs(config, root, ckpt_run) if config.resume is True else []
        raise ConfigError(
            f"{what} would continue {where}, which was trained with other settings:\n" + "\n".join(lines)
            + "\nContinue it with its settings" + (f" ({fixes})" if fixes else "")
            + ", start a new run (without resume), continue another run with resume=<run dir>, or continue "
            "this one with the new settings anyway (resume_strict=false)"
            + (f"; runs of {config.name!r} with matching settings: {', '.join(map(str, others))}" if others else "")
        )
    if step is not None and step >= config.trainer.max_steps:
        raise ConfigError(
            f"{what}: {where} already reached trainer.max_steps={config.trainer.max_steps}, so there is nothing left "
            f"to train. To train further, raise it (e.g. trainer.max_steps={2 * step}; the learning-rate schedule is "
            f"recomputed to end there), or start a new run without resume"
        )
    return Resume(checkpoint, ckpt_run, step, notes, reason)


# ----------------------------------------------------------------------------------------------------
# Fine-tuning: the weights to start from
# ----------------------------------------------------------------------------------------------------


def check_same_architecture(theirs: Any, ours: Any, path: Path, chosen: str) -> None:
    """Raise if a checkpoint's model config ``theirs`` differs from the chosen ``ours`` (names the fields)."""
    if type(theirs) is not type(ours):
        raise ValueError(
            f"init_from={str(path)!r} holds a {type(theirs).__name__.replace('Config', '')} model but {chosen} is a "
            f"{type(ours).__name__.replace('Config', '')}; pick a model of the checkpoint's family "
            f"(model=llama_... or model=moe_...), or model=from_checkpoint"
        )
    diffs = []
    for f in dataclasses.fields(ours):
        if f.name in ARCH_FIELDS_IGNORED:
            continue
        a, b = getattr(theirs, f.name), getattr(ours, f.name)
        if a != b:
            diffs.append(f"{f.name}: checkpoint {a!r}, {chosen.split(' with ')[0]} {b!r}")
    if diffs:
        fix = " ".join(f"model.{d.split(':')[0]}={getattr(theirs, d.split(':')[0])!r}" for d in diffs[:4])
        raise ValueError(
            f"init_from={str(path)!r} does not match {chosen}:\n  " + "\n  ".join(diffs)
            + f"\nUse model=from_checkpoint (the checkpoint's own config), pick the preset the checkpoint was made "
            f"from, or override the fields (e.g. {fix})."
        )


def _check_initial_weights_config(config: FinetuneConfig) -> None:
    """The chosen model against the config the initial weights carry (files' headers only, no weights)."""
    if isinstance(config.model, CheckpointModelConfig):
        _check_overrides_keep_the_shapes(config)  # the model config is the checkpoint's, plus the user's overrides
        return
    path = absolute(config.init_from)
    if path.is_file() and path.suffix == ".safetensors":
        _check_safetensors_shapes(path, config)
        return
    model = config.model
    chosen = f"model={model.family}_{model.preset}" + (f" with {model.overrides()}" if model.overrides() else "")
    if path.is_dir() and (path / "config.json").is_file():
        check_same_architecture(read_pretrained_config(path)[0], model.build_config(), path, chosen)
        return
    try:
        _, run_dir = locate_checkpoint(path)
    except FileNotFoundError:
        return
    if run_dir is not None:
        try:
            theirs, _ = read_run_model(run_dir)
        except (OSError, ValueError):
            return  # the tensors are checked when they are read
        check_same_architecture(theirs, model.build_config(), path, chosen)


def _check_tokenizer_links(config: TrainConfig, resume: Optional[Resume]) -> None:
    """The tokenizer files a run will copy (from ``init_from`` or the resumed run) hold no link out of their folder."""
    if isinstance(config, FinetuneConfig) and resume is None:
        source, what = tokenizer_source_of(absolute(config.init_from)), f"init_from={config.init_from}"
    elif resume is not None and resume.run_dir is not None:
        source, what = resume.run_dir / "tokenizer", f"the resumed run {resume.run_dir}"
    else:
        return
    if source is not None and source.is_dir():
        try:
            check_tokenizer_files(source)
        except ValueError as err:
            raise ConfigError(f"{what}: {err}") from None


def _check_initial_weights_verifiable(config: FinetuneConfig) -> None:
    """A sharded ``init_from`` without ``checksums.json`` is refused here unless ``allow_unverified=true``."""
    if config.allow_unverified:
        return
    try:
        checkpoint, _ = locate_checkpoint(absolute(config.init_from))
    except FileNotFoundError:
        return
    if checkpoint.is_dir() and (checkpoint / ".metadata").is_file() and not (checkpoint / "checksums.json").is_file():
        raise ConfigError(
            f"init_from={config.init_from}: the checkpoint {os.path.realpath(checkpoint)} has no checksums.json, so "
            f"its bytes cannot be verified (a save that did not complete, a removed file, or another library's "
            f"checkpoint). Start from another checkpoint, or set allow_unverified=true if you trust these files"
        )


def _meta_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    import torch

    from lightning_vescale.models.families import FAMILIES, family_of

    with torch.device("meta"):
        built = FAMILIES[family_of(model)].model_cls(model)
    return {k: tuple(v.shape) for k, v in built.state_dict().items()}


def _check_overrides_keep_the_shapes(config: FinetuneConfig) -> None:
    """``model.<field>=...`` on ``model=from_checkpoint`` may change what does not shape the weights (``rope_theta``,
    ``max_seq_len``, ...), not what does: the checkpoint's tensors would not fit the model."""
    model = config.model
    assert isinstance(model, CheckpointModelConfig)  # the caller checked
    theirs = model._source_arch
    changed = {k: v for k, v in model.overrides().items() if getattr(theirs, k, v) != v}
    if not changed:
        return
    from lightning_vescale.state_dict.report import mismatch_report

    report = mismatch_report(_meta_shapes(model.build_config()), _meta_shapes(theirs), ours="model",
                             theirs="checkpoint")
    if report is None:
        return
    fields = ", ".join(f"model.{k}={_cli_value(v)} (the checkpoint's: {_cli_value(getattr(theirs, k))})"
                       for k, v in changed.items())
    raise ConfigError(
        f"{fields} contradicts init_from={config.init_from}: the checkpoint's weights do not fit that model:\n{report}"
        f"\nDrop the override (model=from_checkpoint takes the checkpoint's config), or start from weights of that "
        f"shape"
    )


def _check_safetensors_shapes(path: Path, config: FinetuneConfig) -> None:
    """The tensors' names and shapes of a ``.safetensors`` file (its header) against the chosen model."""
    from safetensors import safe_open

    from lightning_vescale.state_dict.report import mismatch_report

    with safe_open(str(path), framework="pt") as f:
        given = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    report = mismatch_report(_meta_shapes(config.model.build_config()), given, ours="model", theirs="checkpoint")
    if report is not None:
        model = config.model
        raise ConfigError(
            f"init_from={config.init_from!r} does not match model={model.family}_{model.preset}:\n{report}\n"
            f"Pick the model the weights were saved from (model=...), or override its fields (model.<field>=...)."
        )


# ----------------------------------------------------------------------------------------------------
# The check, and its Hydra callback
# ----------------------------------------------------------------------------------------------------


def preflight(cfg: Union[DictConfig, TrainConfig], run_dir: Optional[Path] = None) -> Preflight:
    """Validate ``cfg`` and everything it names that can be checked without starting: the schema (unknown
    keys included), the checkpoint to resume and its run's settings, the initial weights' config.

    Raises:
        ConfigError, ValueError, FileNotFoundError, omegaconf.errors.MissingMandatoryValue: the message names
            the key and the fix.
    """
    config = validate(cfg)
    resume = resolve_resume(config, run_dir)
    if isinstance(config, FinetuneConfig) and resume is None:
        _check_initial_weights_config(config)
        _check_initial_weights_verifiable(config)
    _check_tokenizer_links(config, resume)
    _check_memory_budget(config)
    _check_disk_room(config)
    check_machine(config)
    check_data(config)
    check_fits_memory(config)
    return Preflight(config, resume)


# ----------------------------------------------------------------------------------------------------
# What the run needs from this machine and its data
# ----------------------------------------------------------------------------------------------------


def check_machine(config: TrainConfig) -> None:
    """GPUs asked for exist (``trainer=gpu`` on a machine without one would fail in every process after launch),
    and an HSDP ``strategy.replicate_size`` divides the number of processes."""
    import torch

    t = config.trainer
    if t.accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"trainer.accelerator={t.accelerator} (trainer=gpu) but this machine has no CUDA GPU that torch "
                f"{torch.__version__} can use (built {'with CUDA ' + torch.version.cuda if torch.version.cuda else 'for CPU only'}): "
                f"train on CPU with trainer=default, or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        wanted = len(t.devices) if isinstance(t.devices, list) else t.devices if isinstance(t.devices, int) else None
        if wanted is not None and wanted > count:
            raise ConfigError(
                f"trainer.devices={t.devices} asks for {wanted} GPUs but this machine has {count}: set "
                f"trainer.devices={count} (or trainer.devices=auto)"
            )
    from lightning_vescale.recipe.memory import world_size_of

    r = getattr(config.strategy, "replicate_size", None)
    world = world_size_of(config)
    if isinstance(r, int) and world % r != 0:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ConfigError(
            f"strategy.replicate_size={r} does not divide the {world} processes (trainer.devices={t.devices} x "
            f"trainer.num_nodes={t.num_nodes}): HSDP needs as many ranks in every replica; pick one of "
            f"{', '.join(map(str, divisors))}, or strategy.replicate_size=null to shard over every rank"
        )


def check_data(config: TrainConfig) -> None:
    """The corpus is UTF-8 text (not binary) and long enough for a training and a validation window."""
    from lightning_vescale.data import check_windows_fit, load_text

    data = config.data
    path = None if data.path is None else absolute(data.path)
    num_bytes = len(load_text(path).encode("utf-8"))
    source = "the embedded corpus" if path is None else repr(data.path)
    if data.tokenizer == "byte" or num_bytes < 2 * (data.seq_len + 1):
        check_windows_fit(num_bytes, seq_len=data.seq_len, val_fraction=data.val_fraction, source=source)


_STATE_BYTES_PER_PARAM = {"AdamWConfig": 16, "MuonConfig": 12, "AdamW8bitConfig": 11}
"""fp32 weight, gradient and optimizer states per parameter (AdamW: m and v; Muon: one momentum; AdamW8bit: m and v
as one byte each plus their block scales, rounded up)."""


def check_fits_memory(config: TrainConfig) -> None:
    """A model whose training state cannot fit this machine is refused before launch (the real-size presets,
    ``model=deepseek_v3_671b``, are for the dry run). Checked when everything stays on the device (no ``memory``,
    ``quant`` or MPMD); the sharded state per rank is compared with this machine's memory per process."""
    if config.memory is not None or config.quant is not None or config.mpmd is not None:
        return
    import torch

    from lightning_vescale.models import num_params
    from lightning_vescale.recipe.memory import replicate_of, world_size_of
    from lightning_vescale.recipe.schema import DDPStrategyConfig

    with torch.device("meta"):
        params = num_params(config.model.build_model())
    world = world_size_of(config)
    shards = 1 if isinstance(config.strategy, DDPStrategyConfig) else world // replicate_of(config, world)
    per_param = _STATE_BYTES_PER_PARAM.get(type(config.optimizer).__name__, 16)
    if config.trainer.precision == "bf16-true":
        per_param //= 2
    need = params * per_param / shards
    gpu = config.trainer.accelerator in ("gpu", "cuda") and torch.cuda.is_available()
    have: float
    if gpu:
        have, where = torch.cuda.get_device_properties(0).total_memory, "one GPU's memory"
    else:
        processes = max(1, world // config.trainer.num_nodes)
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / processes
        where = f"this machine's memory / {processes} processes"
    if need <= have:
        return
    from lightning_vescale.recipe.numbers import format_bytes, format_count

    model = f"model={config.model.family}_{config.model.preset}"
    raise ConfigError(
        f"{model} has {format_count(params)} parameters: training them holds about {format_bytes(need)} per rank "
        f"({per_param} B of weight, gradient and optimizer state per parameter, sharded over {shards} rank"
        f"{'s' if shards > 1 else ''}), more than the {format_bytes(have)} a rank has here ({where}). Size it with "
        f"the dry run (python -m lightning_vescale.plan model={config.model.family}_{config.model.preset} "
        f"world_size=...), train a small preset here (e.g. model={config.model.family}_tiny), or move state off "
        f"the device (memory=offload_disk, memory=budget)"
    )


def _check_memory_budget(config: TrainConfig) -> None:
    """A ``memory.budget`` that no placement fits is refused here, before any process starts. The disk's speed
    only changes which fitting placement is cheapest, so a nominal bandwidth stands in for the measured one."""
    if config.memory is None or config.memory.budget is None:
        return
    from lightning_vescale.memory import choose_placement
    from lightning_vescale.recipe.memory import estimate_for, world_size_of

    estimate = estimate_for(config, world_size_of(config))
    try:
        choose_placement(estimate, config.memory.budget, disk_bandwidth=1e9)
    except ValueError as err:
        raise ConfigError(f"memory.budget={config.memory.budget}: {err}") from None


def _check_disk_room(config: TrainConfig) -> None:
    """A disk tier too small for what the memory placement puts there (activations included) is refused here."""
    from lightning_vescale.recipe.memory import check_disk_room

    try:
        check_disk_room(config)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def config_error_message(err: BaseException) -> str:
    """The one-line (or few-line) message of a config problem, without OmegaConf's internals."""
    missing = re.search(r"Missing mandatory value: (\S+)", str(err)) or re.search(r"full_key: (\S+)", str(err))
    if isinstance(err, (MissingMandatoryValue, InterpolationToMissingValueError)) and missing:
        key = missing.group(1)
        if key == "data.path":
            return ("data=text_file trains on your own text, so it needs data.path: set data.path=/path/to/corpus.txt "
                    "(a UTF-8 text file), or use data=embedded for the built-in corpus")
        return f"{key} is required (it is ??? in the config): set it, e.g. {key}=..."
    if isinstance(err, OmegaConfBaseException):
        return str(err).split("\n    full_key:")[0].strip()
    return str(err)


def exit_on_config_error(check: Callable[[], T]) -> T:
    """Run ``check``; on a config problem print ``<prog>: error: <message>`` to stderr and exit with code 2."""
    try:
        return check()
    except (ValueError, OSError, OmegaConfBaseException) as err:
        prog = Path(sys.argv[0]).name or "recipe"
        sys.stderr.write(f"{prog}: error: {config_error_message(err)}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None


class CheckBeforeRun(Callback):
    """Hydra callback: :func:`preflight` after composing and before the run directory is created.

    Enabled in ``configs/train.yaml`` and ``configs/finetune.yaml``::

        hydra:
          callbacks:
            check_before_run:
              _target_: lightning_vescale.recipe.checks.CheckBeforeRun
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        task = copy.deepcopy(config)
        with read_write(task), open_dict(task):
            del task["hydra"]
        exit_on_config_error(lambda: preflight(task))
        from lightning_vescale.recipe.run_dir import claim_run_dir

        exit_on_config_error(lambda: claim_run_dir(config))  # a folder of its own, never another run's
