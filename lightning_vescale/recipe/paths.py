"""Where a recipe run's files go: Hydra's run folder when Hydra started the run, else one the recipe claims."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import hydra.utils

if TYPE_CHECKING:
    from lightning_vescale.recipe.schema import TrainConfig

__all__ = ["absolute", "hydra_on", "run_dir_for", "run_dir_if_known"]


def hydra_on() -> bool:
    """Whether Hydra started this run (its config and output folder are set)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized()


def run_dir_for(config: TrainConfig) -> Path:
    """The run's folder: Hydra's, or ``{output_root}/{name}/{time}`` claimed exclusively (a launched rank's as given)."""
    known = run_dir_if_known()
    if known is not None:
        return known
    path = Path(config.output_root) / config.name / time.strftime("%Y-%m-%d_%H-%M-%S")
    from lightning.fabric.utilities.rank_zero import _get_rank

    if _get_rank() is not None:
        return path  # a process a launcher started (see lightning_vescale.recipe.run_dir)
    from lightning_vescale.recipe.run_dir import claim_new_folder

    return claim_new_folder(path, may_rename=True)


def absolute(path: Union[str, Path]) -> Path:
    """A path given on the command line, relative to the launch directory (the recipes never chdir)."""
    return Path(hydra.utils.to_absolute_path(str(path))) if hydra_on() else Path(path).absolute()


def run_dir_if_known() -> Optional[Path]:
    """Hydra's run folder, or None outside Hydra."""
    if not hydra_on():
        return None
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)
