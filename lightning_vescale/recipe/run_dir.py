"""A run's folder is its own: created exclusively, before anything is written into it.

Hydra creates ``hydra.run.dir`` with ``mkdir(exist_ok=True)``, so two runs of the same name started in the same
second (the default folder is ``{output_root}/{name}/{time to the second}``) would share one folder:
interleaved metrics, overwritten checkpoints. :func:`claim_run_dir` runs first (from the recipes'
``CheckBeforeRun`` callback, after the config checks passed) and creates the folder with an exclusive
``mkdir``: a default (timestamped) folder that exists already becomes ``<time>_2``, ``<time>_3``, ... (said on
stderr); a folder given with ``hydra.run.dir=...`` that exists is refused. The ranks a launcher started (Lightning
passes its other ranks ``hydra.run.dir`` of the first) use the folder as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from lightning.fabric.utilities.rank_zero import _get_rank
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

__all__ = ["claim_run_dir", "claim_new_folder"]


def claim_new_folder(path: Path, *, may_rename: bool, option: str = "hydra.run.dir") -> Path:
    """Create ``path`` exclusively and return it; if it exists, create ``<path>_2``, ``<path>_3``, ... when
    ``may_rename`` (saying so on stderr), else raise ``FileExistsError`` naming ``option``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir()
        return path
    except FileExistsError:
        if not may_rename:
            raise FileExistsError(
                f"{option}={path} already exists (another run's folder: runs never share one); pick a new folder, or "
                f"leave {option} unset for a new timestamped one"
            ) from None
    for i in range(2, 10_000):
        candidate = path.with_name(f"{path.name}_{i}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        sys.stderr.write(f"run folder {path} exists already (another run started in the same second): this run writes "
                         f"to {candidate}\n")
        return candidate
    raise FileExistsError(f"could not create a new run folder next to {path}")


def claim_run_dir(config: DictConfig) -> Optional[Path]:
    """Create the Hydra run folder of ``config`` (the full config, ``hydra`` included) exclusively and point
    ``hydra.run.dir`` at the folder created. ``None`` in a process a launcher started (Lightning's other ranks,
    torchrun, SLURM: every rank starts the app, so none can rename the folder alone; they use Hydra's).

    Raises:
        FileExistsError: an explicit ``hydra.run.dir`` exists already.
    """
    if _get_rank() is not None:
        return None
    run = OmegaConf.to_container(config.hydra.run, resolve=False)
    assert isinstance(run, dict)
    raw = run["dir"]
    generated = isinstance(raw, str) and "${now:" in raw
    claimed = claim_new_folder(Path(str(config.hydra.run.dir)), may_rename=generated)
    with read_write(config), open_dict(config):
        config.hydra.run.dir = str(claimed)
    return claimed
