"""Pre-train a Llama or MoE with Lightning and lightning_vescale.

    python recipes/train.py                          # llama_tiny on the embedded corpus, 2 CPU processes
    python recipes/train.py model=moe_tiny trainer.max_steps=500
    python recipes/train.py strategy=fsdp2           # the torch FSDP2 baseline; also ddp, vescale_hsdp
    python recipes/train.py resume=true              # continue the newest run of this name
    python recipes/train.py --help                   # groups, options and every field

Config: configs/train.yaml and its groups (model, optimizer, strategy, data, trainer, precision, experiment),
validated by the dataclasses in lightning_vescale/recipe/schema.py. The command line is checked before Lightning
is imported (lightning_vescale/recipe/cli.py), so a mistake costs seconds.
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from lightning_vescale.recipe.cli import check_command_line  # registers the structured configs; no Lightning

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lightning_vescale.recipe import run

    run(cfg)


if __name__ == "__main__":
    check_command_line(CONFIG_DIR, "train")
    main()
