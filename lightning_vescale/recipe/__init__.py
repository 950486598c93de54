"""Training recipes: typed Hydra configs, the causal-LM LightningModule, callbacks, and :func:`run`.

``recipes/train.py`` and ``recipes/finetune.py`` are thin ``@hydra.main`` apps around :func:`run`::

    python recipes/train.py                                   # llama_tiny, embedded corpus, vescale, 2 CPUs
    python recipes/train.py model=moe_tiny optimizer=muon trainer.max_steps=500
    python recipes/train.py experiment=fsdp2_baseline          # the same run on torch FSDP2
    python recipes/train.py resume=true                        # continue the newest run of this name
    python recipes/finetune.py init_from=/path/to/hf_checkpoint_dir export_hf=true

Everything that can be checked on the config is checked before the run directory exists
(:mod:`~lightning_vescale.recipe.checks`). A run writes to ``{output_root}/{name}/{timestamp}/``:
``.hydra/`` (the composed config), ``model.json`` (the resolved model config), ``checkpoints/``
(``step-000100.ckpt``..., ``last.ckpt``), ``csv/metrics.csv`` (and ``tb/`` when TensorBoard is installed),
``loss_curve.png`` and ``summary.json``; a fine-tune also ``tokenizer/`` (the files of ``init_from``) and,
with ``export_hf=true``, ``hf/`` (a Hugging Face directory). SIGTERM stops every rank after the same step,
saves it (``trainer.save_on_signal``) and exits with code 143. A step whose loss or gradients are not finite on
any rank stops every rank before its optimizer step and exits with code 1, naming the step and the ranks
(``trainer.on_non_finite=skip`` skips such steps instead).
"""

from __future__ import annotations

from typing import Any

from lightning_vescale.recipe.builders import build_datamodule, build_strategy, precision_line, trainer_precision
from lightning_vescale.recipe.checks import ConfigError, find_last_checkpoint, preflight
from lightning_vescale.recipe.init_weights import load_initial_weights
from lightning_vescale.recipe.runner import SIGTERM_EXIT_CODE, run
from lightning_vescale.recipe.schema import FinetuneConfig, TrainConfig, register_configs, validate

# [Note: Lightning is imported where it is used]
# The recipes check a config (schema, checks, Hydra) before anything heavy is imported, so a typo costs the import
# of torch and not of Lightning: this package's face imports no Lightning, and the functions that build the run
# import it (and the modules that need it: callbacks, module, quant) inside.
_FROM_MODULE = ("CausalLMModule", "build_optimizer_from_config", "lr_multiplier")


def __getattr__(name: str) -> Any:
    if name in _FROM_MODULE:
        from lightning_vescale.recipe import module

        return getattr(module, name)
    raise AttributeError(f"module 'lightning_vescale.recipe' has no attribute {name!r}")


__all__ = [
    "CausalLMModule",
    "ConfigError",
    "SIGTERM_EXIT_CODE",
    "FinetuneConfig",
    "TrainConfig",
    "build_datamodule",
    "build_optimizer_from_config",
    "build_strategy",
    "find_last_checkpoint",
    "load_initial_weights",
    "lr_multiplier",
    "precision_line",
    "preflight",
    "register_configs",
    "run",
    "trainer_precision",
    "validate",
]
