"""Pre-train a Llama or MoE with Lightning and lightning_vescale.

    python recipes/train.py                          # llama_tiny on the embedded corpus, 2 CPU processes
    python recipes/train.py model=moe_tiny trainer.max_steps=500
    python recipes/train.py strategy=fsdp2           # the torch FSDP2 baseline; also ddp, vescale_hsdp
    python recipes/train.py resume=true              # continue the newest run of this name
    python recipes/train.py --help                   # groups, options and the composed config

Config: configs/train.yaml and its groups (model, optimizer, strategy, data, trainer, precision, experiment),
validated by the dataclasses in lightning_vescale/recipe/schema.py.
"""

import hydra
from omegaconf import DictConfig

import lightning_vescale.recipe as recipe  # registers the structured configs


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    recipe.run(cfg)


if __name__ == "__main__":
    main()
