"""Fine-tune a Llama or MoE from a Hugging Face checkpoint directory or a full state-dict file.

    python recipes/finetune.py init_from=/path/to/hf_dir model=llama_tiny
    python recipes/finetune.py init_from=weights.safetensors model=moe_tiny data=text_file data.path=my.txt

The chosen model must match the weights (a mismatch stops before training and lists the differing
fields). Config: configs/finetune.yaml (train.yaml's groups, plus init_from and a smaller learning rate).
"""

import hydra
from omegaconf import DictConfig

import lightning_vescale.recipe as recipe  # registers the structured configs


@hydra.main(config_path="../configs", config_name="finetune", version_base="1.3")
def main(cfg: DictConfig) -> None:
    recipe.run(cfg)


if __name__ == "__main__":
    main()
