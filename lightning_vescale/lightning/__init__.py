"""Lightning integration: ``Trainer(strategy="vescale")`` and ``Fabric(strategy="vescale")``.

Importing this package registers ``"vescale"`` and ``"vescale_hsdp"`` in Lightning's Trainer and Fabric
strategy registries (Lightning discovers strategies only through them), and lets
``LightningModule.load_from_checkpoint`` read the sharded checkpoint directories the strategy saves.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_REGISTRY

from lightning_vescale.lightning._checkpoints import install_load_from_checkpoint
from lightning_vescale.lightning._common import ProcessGroupEnvironment
from lightning_vescale.lightning._signals import agree_on_sigterm, install_deferred_sigterm
from lightning_vescale.lightning.fabric import (
    VeScaleFabricPrecision,
    VeScaleFabricStrategy,
)
from lightning_vescale.lightning.strategy import VeScalePrecision, VeScaleStrategy

VeScaleStrategy.register_strategies(_TRAINER_REGISTRY)
VeScaleFabricStrategy.register_strategies(_FABRIC_REGISTRY)
install_load_from_checkpoint()  # LightningModule.load_from_checkpoint reads sharded checkpoint directories

__all__ = [
    "ProcessGroupEnvironment",
    "VeScaleFabricPrecision",
    "VeScaleFabricStrategy",
    "VeScalePrecision",
    "VeScaleStrategy",
    "agree_on_sigterm",
    "install_deferred_sigterm",
]
