"""Fine-tune a Llama or MoE from a Hugging Face checkpoint directory or a full state-dict file.

    python recipes/finetune.py init_from=/path/to/hf_dir export_hf=true
    python recipes/finetune.py init_from=weights.safetensors model=moe_tiny data=text_file data.path=my.txt

``model=from_checkpoint`` (the default) reads the model config from ``init_from``; a chosen model must match the
weights (a mismatch stops before training and lists the differing fields). Config: configs/finetune.yaml
(train.yaml's groups, plus init_from and a smaller learning rate). The command line is checked before Lightning
is imported (lightning_vescale/recipe/cli.py).
"""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from lightning_vescale.recipe.cli import check_command_line  # registers the structured configs; no Lightning

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@hydra.main(config_path="../configs", config_name="finetune", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lightning_vescale.recipe import run

    run(cfg)


if __name__ == "__main__":
    check_command_line(CONFIG_DIR, "finetune")
    main()
