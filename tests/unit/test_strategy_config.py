"""Configuration of the Lightning strategies: registry names, precision mapping, policies and the errors
users get before any training starts. Pure or on a one-rank gloo group; no multi-process launch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.demos.transformer import Transformer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import StrategyRegistry

import lightning_vescale as lv
import lightning_vescale.lightning  # noqa: F401 - registers the strategies
from lightning_vescale.engine.tensor import is_ragged
from lightning_vescale.lightning import (
    VeScaleFabricStrategy,
    VeScalePrecision,
    VeScaleStrategy,
)
from lightning_vescale.lightning._common import (
    build_mesh,
    mp_policy_for_precision,
    select_blocks,
    shard_module,
    top_level_roots,
)


@pytest.fixture
def single_process_pg(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trainer(**kwargs) -> Trainer:
    kwargs.setdefault("strategy", "vescale")
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kwargs)


def test_registry_names() -> None:
    assert StrategyRegistry["vescale"]["strategy"] is VeScaleStrategy
    assert StrategyRegistry["vescale_hsdp"]["init_params"] == {"replicate_size": "auto"}
    assert STRATEGY_REGISTRY["vescale"]["strategy"] is VeScaleFabricStrategy
    assert STRATEGY_REGISTRY["vescale_hsdp"]["strategy"] is VeScaleFabricStrategy
    # Registering again (a second import path) is harmless.
    VeScaleStrategy.register_strategies(StrategyRegistry)
    assert isinstance(trainer().strategy, VeScaleStrategy)
    assert trainer().strategy.is_distributed, "Lightning drops DistributedSampler and sync_dist without it"


def test_precision_mapping() -> None:
    assert mp_policy_for_precision("32-true") is None
    mixed = mp_policy_for_precision("bf16-mixed")
    assert (mixed.param_dtype, mixed.reduce_dtype, mixed.output_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    true16 = mp_policy_for_precision("bf16-true")
    assert (true16.param_dtype, true16.reduce_dtype) == (torch.bfloat16, torch.bfloat16)
    # The Trainer's generic plugin (autocast for bf16-mixed) is replaced by the engine's.
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        plugin = trainer(precision=precision).strategy.precision_plugin
        assert isinstance(plugin, VeScalePrecision) and plugin.precision == precision
    plugin = trainer(precision="bf16-true").strategy.precision_plugin
    assert plugin.convert_module(nn.Linear(2, 2)).weight.dtype == torch.bfloat16
    assert plugin.convert_input(torch.ones(2)).dtype == torch.bfloat16
    assert trainer(precision="bf16-mixed").strategy.precision_plugin.convert_input(torch.ones(2)).dtype == torch.float32


@pytest.mark.parametrize(
    ("precision", "match"),
    [("16-true", "does not support precision='16-true'.*use 'bf16-true'"),
     ("64-true", "does not support precision='64-true'"),
     ("16-mixed", None)],  # on CPU Lightning itself turns 16-mixed into bf16-mixed
)
def test_bad_precision_errors_at_construction(precision, match) -> None:
    if match is None:
        with pytest.warns(UserWarning, match="bf16-mixed"):
            assert trainer(precision=precision).strategy.precision_plugin.precision == "bf16-mixed"
        return
    with pytest.raises(ValueError, match=match):
        trainer(precision=precision)
    with pytest.raises(ValueError, match=match):
        Fabric(accelerator="cpu", devices=1, strategy="vescale", precision=precision)


def test_bad_plugin_and_policy_conflict() -> None:
    class CustomPrecision(Precision):
        precision = "32-true"

    with pytest.raises(TypeError, match="cannot map onto its mixed-precision policy"):
        trainer(plugins=[CustomPrecision()])
    policy = lv.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="both mp_policy=.* and precision='bf16-mixed'"):
        trainer(strategy=VeScaleStrategy(mp_policy=policy), precision="bf16-mixed")
    assert trainer(strategy=VeScaleStrategy(mp_policy=policy)).strategy.precision_plugin.precision == "32-true"
    with pytest.raises(TypeError, match="mp_policy must be"):
        VeScaleStrategy(mp_policy="bf16")
    with pytest.raises(ValueError, match="replicate_size"):
        VeScaleStrategy(replicate_size=0)


def test_bad_accelerator_errors() -> None:
    class TPUish(Accelerator):
        def setup_device(self, device): ...
        def teardown(self): ...
        @staticmethod
        def parse_devices(devices): return devices
        @staticmethod
        def get_parallel_devices(devices): return [torch.device("cpu")]
        @staticmethod
        def auto_device_count(): return 1
        @staticmethod
        def is_available(): return True
        def get_device_stats(self, device): return {}
        @staticmethod
        def name(): return "tpuish"

    with pytest.raises(ValueError, match=r"accelerator='cpu' \(gloo\) or accelerator='cuda'.*got TPUish"):
        VeScaleStrategy(accelerator=TPUish())
    with pytest.raises(ValueError, match="got TPUish"):
        Trainer(strategy="vescale", accelerator=TPUish(), devices=1, logger=False)


def test_sharding_policy() -> None:
    model = Transformer(vocab_size=11, ninp=8, nhead=2, nhid=8, nlayers=2)
    blocks = select_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["TransformerEncoderLayer"] * 2 + ["TransformerDecoderLayer"] * 2
    # Classes, import paths (Hydra) and callables.
    assert len(select_blocks(model, {nn.TransformerDecoderLayer})) == 2
    assert len(select_blocks(model, ["torch.nn.TransformerEncoderLayer"])) == 2
    assert all(isinstance(b, nn.Linear) for b in select_blocks(model, lambda m: isinstance(m, nn.Linear)))
    with pytest.raises(ValueError, match="not an importable class path"):
        select_blocks(model, ["torch.nn.NoSuchLayer"])
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        select_blocks(model, [3])
    # Roots of a LightningModule: its children with parameters.
    lm = BoringModel()
    assert top_level_roots(lm) == [lm.layer]

    class Direct(LightningModule):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.layer = nn.Linear(2, 2)

    direct = Direct()  # its own parameters go into its own group (shard_module), not into a root
    assert top_level_roots(direct) == [direct.layer]


def test_hydra_target() -> None:
    from hydra.utils import instantiate

    strategy = instantiate({
        "_target_": "lightning_vescale.lightning.VeScaleStrategy",
        "reshard_after_forward": False,
        "auto_wrap_policy": ["torch.nn.TransformerEncoderLayer"],
        "replicate_size": "auto",
    })
    assert isinstance(strategy, VeScaleStrategy) and strategy._reshard_after_forward is False
    assert isinstance(trainer(strategy=strategy).strategy, VeScaleStrategy)


def test_errors_on_one_rank(single_process_pg) -> None:
    # The process group exists already: its size must match devices.
    with pytest.raises(ValueError, match="process group has 1 ranks but devices \\* num_nodes = 2"):
        Trainer(strategy="vescale", accelerator="cpu", devices=2, logger=False)
    with pytest.raises(ValueError, match="positive divisor"):
        build_mesh(torch.device("cpu"), 1, 3)
    # A weight shared by two children would be cut twice, as two roots.
    class Tied(LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

    tied = Tied()
    with pytest.raises(ValueError, match="shared by two top-level modules"):
        shard_module(tied, mesh=build_mesh(torch.device("cpu"), 1), roots=top_level_roots(tied))


def test_granularity_mapping_uses_model_names(single_process_pg) -> None:
    # A strategy's glob mapping matches the LightningModule's own names, for blocks and roots alike.
    lm = BoringModel()
    mesh = build_mesh(torch.device("cpu"), 1)
    with pytest.raises(ValueError, match=r"pattern\(s\) \['layers\.\*'\] match no parameter of BoringModel"):
        shard_module(lm, mesh=mesh, roots=top_level_roots(lm), granularity={"layer.weight": 4, "layers.*": "row"})
    shard_module(lm, mesh=mesh, roots=top_level_roots(lm), granularity={"layer.weight": 4})
    lm(torch.randn(2, 32))  # the first forward checks the mapping again, across every group


def test_single_rank_fit(single_process_pg, tmp_path) -> None:
    """The whole Trainer path on one rank: fit, a sharded checkpoint directory, resume."""
    model = BoringModel()
    t = trainer(max_steps=2, default_root_dir=tmp_path, enable_model_summary=False, gradient_clip_val=0.1)
    t.fit(model)
    assert all(is_ragged(p) for p in model.parameters())
    path = tmp_path / "ckpt"
    t.save_checkpoint(path)
    assert path.is_dir() and (path / ".metadata").is_file()
    resumed = BoringModel()
    t2 = trainer(max_steps=3, default_root_dir=tmp_path, enable_model_summary=False)
    t2.fit(resumed, ckpt_path=path)
    assert t2.global_step == 3
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*missing.ckpt"):
        trainer(max_steps=3, enable_model_summary=False).fit(BoringModel(), ckpt_path=tmp_path / "missing.ckpt")
    (tmp_path / "single.ckpt").write_bytes(b"")  # a file resumes as a full checkpoint: an empty one is named
    with pytest.raises(ValueError, match="single.ckpt' is not a checkpoint file"):
        trainer(max_steps=3, enable_model_summary=False).fit(BoringModel(), ckpt_path=tmp_path / "single.ckpt")


def test_plan_typo_stops_fit_before_any_process_or_group(monkeypatch, tmp_path) -> None:
    """A plan rule whose glob matches nothing stops ``Trainer.fit`` before the launcher starts a second process
    or a process group exists; the error names the rule."""
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    started = []
    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", lambda self: started.append(1))
    plan = {"version": 1, "rules": [{"match": "**.layer.*", "group": True}]}  # the model has `layer`, no children
    trainer = Trainer(strategy=VeScaleStrategy(plan=plan), accelerator="cpu", devices=2, max_steps=1,
                      logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    with pytest.raises(lv.PlanError, match=r"\*\*\.layer\.\*"):
        trainer.fit(BoringModel())
    assert not started and not dist.is_initialized()
