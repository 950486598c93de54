"""``Trainer(strategy="vescale")`` trains like ``strategy="ddp"`` on 2 gloo ranks, one test per behaviour
(``tests.dist_pool.DistributedTest``; the Trainer runs inside the ranks' pre-initialized process group).

Lightning's demo Transformer trained with DDP and with the engine (gradient accumulation, norm clipping, ``sync_dist``
logging, a StepLR schedule):

* the engine's parameters report the full model's shapes and hold ragged local pieces that add up to the model;
* the per-micro-batch losses and the true gradient norms equal DDP's (1e-5: reductions run in other orders), with
  clipping active, and so does the ``sync_dist`` logged loss;
* accumulation: no ReduceScatter on non-final micro-batches, one per group on the final one;
* validate / test (``sync_dist`` metrics, 1e-5) and predict (bitwise) agree with DDP;
* a ``ModelCheckpoint`` resume (a sharded directory) into another init equals the uninterrupted run (1e-6), and
  without the checkpoint that init trains otherwise (negative control).

These share one DDP and one engine run per rank, built by the first test that needs them (``_transformer_runs``).
An MLP built in ``configure_model`` (DDP's run likewise shared, ``_configured_ddp``):

* on the meta device under the engine, materialized after sharding, it equals DDP's real init (1e-5);
* the user's own sharding with ``self.device_mesh`` is kept; HSDP (2 replicas x 1 shard) equals DDP; the
  ``vescale_hsdp`` preset picks its replicate size itself;
* bf16-mixed (bf16 compute, fp32 pieces) is within 3e-2 of fp32 DDP, bf16-true (all bf16) within 5e-2.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.transformer import Transformer
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset

import lightning_vescale as lv
import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale.engine.fully_shard import sharded_groups
from lightning_vescale.engine.tensor import is_ragged
from lightning_vescale.lightning import ProcessGroupEnvironment, VeScaleStrategy
from tests.dist_pool import DistributedTest
from tests.toy_models import MLP

VOCAB, SEQ = 48, 8
CLIP = 0.05


class Tokens(Dataset):
    """Random token sequences from a private generator (the same on every rank and run)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


class Regression(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 7, generator=g), torch.randn(n, 5, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Recorder(LightningModule):
    """Records the rank-averaged loss of every micro-batch, the true gradient norm before clipping, and
    the engine's ReduceScatter count after every backward."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.reduce_scatters: list[int] = []

    def record(self, loss: torch.Tensor) -> None:
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())

    def on_after_backward(self) -> None:
        self.reduce_scatters.append(lv.comm_stats.total_calls.get("reduce_scatter", 0))

    def on_before_optimizer_step(self, optimizer) -> None:
        # Sharded grads: all-reduced over the shard group; DDP grads: already averaged, counted once.
        params = [p for p in self.parameters() if p.grad is not None]
        self.norms.append(lv.clip_grad_norm_(params, float("inf")).item())


class LM(Recorder):
    """Lightning's demo Transformer (nn.Transformer encoder/decoder layers become the groups)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=2, dropout=0.0)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.nll_loss(self.model(x, y), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        self.record(loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, y = batch
        return self.model(x, y).argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}

    def train_dataloader(self):
        return DataLoader(Tokens(64, seed=1), batch_size=4, shuffle=True)

    def val_dataloader(self):
        return DataLoader(Tokens(16, seed=2), batch_size=4)

    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


class ConfiguredMLP(Recorder):
    """The model is built in configure_model (on the meta device under strategy="vescale")."""

    def __init__(self, shard_myself: bool = False) -> None:
        super().__init__()
        self.model = None
        self.built_on_meta = None
        self.shard_myself = shard_myself

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = MLP()
        self.built_on_meta = next(self.model.parameters()).is_meta
        if self.shard_myself:
            for block in self.model.blocks:
                lv.fully_shard(block, mesh=self.device_mesh)
            lv.fully_shard(self.model, mesh=self.device_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.record(loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)

    def train_dataloader(self):
        return DataLoader(Regression(32, seed=3), batch_size=4)


def ddp() -> DDPStrategy:
    return DDPStrategy(cluster_environment=ProcessGroupEnvironment())


def fit(module_cls, strategy, *, init_seed: int = 0, ckpt_path=None, callbacks=(), **trainer_kwargs):
    seed_everything(init_seed)
    module = module_cls()
    seed_everything(0)  # PL_GLOBAL_SEED also seeds the DistributedSampler's shuffle
    kwargs = dict(
        accelerator="cpu", devices=dist.get_world_size(), logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks), limit_val_batches=2,
    )
    kwargs.update(trainer_kwargs)
    trainer = Trainer(strategy=strategy, **kwargs)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def assert_close(a, b, tol: float, what: str) -> None:
    assert len(a) == len(b) and len(a) > 0, (what, a, b)
    worst = max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))
    assert worst <= tol, f"{what}: {worst:.2e} > {tol}\n{a}\n{b}"


COMMON = dict(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=CLIP)
# Runs shared by the tests of a class inside one rank process (rebuilt by whichever test needs them first, so any
# test also passes alone); what the tests read is copied out right after the fit.
_RUNS: dict = {}


def _transformer_runs(tmp: str) -> SimpleNamespace:
    """The demo Transformer fitted 2 epochs with DDP and with the engine (a ModelCheckpoint every epoch in ``tmp``)."""
    key = ("transformer", tmp)
    if key not in _RUNS:
        ref, ref_trainer = fit(LM, ddp(), **COMMON)
        ckpt_dir = os.path.join(tmp, "ckpt")
        saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1)
        mine, trainer = fit(LM, "vescale", callbacks=[saver], **COMMON)
        _RUNS[key] = SimpleNamespace(
            ref=ref, ref_trainer=ref_trainer, mine=mine, trainer=trainer, ckpt_dir=ckpt_dir,
            ref_losses=list(ref.losses), ref_norms=list(ref.norms), losses=list(mine.losses),
            norms=list(mine.norms), reduce_scatters=list(mine.reduce_scatters),
            ref_train_loss=ref_trainer.callback_metrics["train_loss"].item(),
            train_loss=trainer.callback_metrics["train_loss"].item(),
            last_epoch=trainer.lr_scheduler_configs[0].scheduler.last_epoch)
    return _RUNS[key]


def _configured_ddp() -> SimpleNamespace:
    """ConfiguredMLP fitted 4 steps with DDP."""
    if "configured_ddp" not in _RUNS:
        ref, _ = fit(ConfiguredMLP, ddp(), max_steps=4)
        _RUNS["configured_ddp"] = SimpleNamespace(built_on_meta=ref.built_on_meta, losses=list(ref.losses))
    return _RUNS["configured_ddp"]


def _parameters_are_sharded(rank: int, world: int, tmp: str) -> None:
    run = _transformer_runs(tmp)
    mine, ref = run.mine, run.ref
    assert isinstance(run.trainer.strategy, VeScaleStrategy)
    # Sharded: every parameter reports the full model's shape and holds a local piece; the pieces add up to
    # the model.
    assert [(n, p.shape) for n, p in mine.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    pieces = torch.tensor([sum(p.to_local().numel() for p in mine.parameters())])
    dist.all_reduce(pieces)
    assert pieces.item() == sum(p.numel() for p in ref.parameters())
    assert all(is_ragged(p) for p in mine.parameters())
    assert len(sharded_groups(mine)) == 5, "4 encoder/decoder layers + the root self.model"


def _losses_and_norms_match_ddp(rank: int, world: int, tmp: str) -> None:
    run = _transformer_runs(tmp)
    # 16 micro-batches (2 epochs x 8), 8 optimizer steps: same losses and true gradient norms as DDP.
    assert len(run.losses) == 16 and len(run.norms) == 8
    assert_close(run.losses, run.ref_losses, 1e-5, "per-micro-batch losses vs DDP")
    assert_close(run.norms, run.ref_norms, 1e-5, "gradient norms vs DDP")
    assert max(run.ref_norms) > CLIP, "clipping must be active for the comparison to mean anything"
    assert abs(run.train_loss - run.ref_train_loss) < 1e-5


def _accumulation_skips_reduce_scatter(rank: int, world: int, tmp: str) -> None:
    # Accumulation: no ReduceScatter on the first micro-batch of each pair, one per group on the second.
    calls = _transformer_runs(tmp).reduce_scatters
    steps = [calls[i] - (calls[i - 1] if i else calls[0]) for i in range(1, len(calls))]
    assert all(d == 0 for d in steps[1::2]), f"non-final micro-batches issued ReduceScatters: {steps}"
    assert all(d == 5 for d in steps[0::2]), f"final micro-batches must reduce every group once: {steps}"


def _evaluation_matches_ddp(rank: int, world: int, tmp: str) -> None:
    # validate / test / predict (sync_dist metrics) agree with DDP.
    run = _transformer_runs(tmp)
    for stage in ("validate", "test"):
        got = getattr(run.trainer, stage)(run.mine, verbose=False)[0]
        want = getattr(run.ref_trainer, stage)(run.ref, verbose=False)[0]
        for key, value in want.items():
            assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (stage, key, got[key], value)
    got = run.trainer.predict(run.mine)
    want = run.ref_trainer.predict(run.ref)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _resume_equals_uninterrupted(rank: int, world: int, tmp: str) -> None:
    # Resume from the end of epoch 0 (a sharded directory) equals the uninterrupted run, with another init.
    run = _transformer_runs(tmp)
    ckpt = os.path.join(run.ckpt_dir, "epoch=0-step=4.ckpt")
    assert os.path.isdir(ckpt), sorted(os.listdir(run.ckpt_dir))
    resumed, resumed_trainer = fit(LM, "vescale", init_seed=123, ckpt_path=ckpt, **COMMON)
    assert_close(resumed.losses, run.losses[8:], 1e-6, "resumed losses vs uninterrupted")
    assert_close(resumed.norms, run.norms[4:], 1e-6, "resumed gradient norms vs uninterrupted")
    assert resumed_trainer.lr_scheduler_configs[0].scheduler.last_epoch == run.last_epoch


def _another_init_differs(rank: int, world: int, tmp: str) -> None:
    # Negative control of the resume: without the checkpoint, the other init gives other losses.
    run = _transformer_runs(tmp)
    fresh, _ = fit(LM, "vescale", init_seed=123, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=CLIP)
    assert abs(fresh.losses[0] - run.losses[0]) > 1e-3


def _meta_init_in_configure_model(rank: int, world: int) -> None:
    ref = _configured_ddp()
    assert ref.built_on_meta is False
    # Meta init in configure_model, materialized after sharding: equal to DDP's real init.
    mine, _ = fit(ConfiguredMLP, "vescale", max_steps=4)
    assert mine.built_on_meta is True
    assert not any(p.is_meta for p in mine.parameters())
    assert_close(mine.losses, ref.losses, 1e-5, "configure_model meta init vs DDP")


def _user_sharding_kept(rank: int, world: int) -> None:
    # Sharded by the user in configure_model with self.device_mesh: kept as it is.
    ref = _configured_ddp()
    user, _ = fit(lambda: ConfiguredMLP(shard_myself=True), "vescale", max_steps=4)
    assert len(sharded_groups(user)) == 4
    assert_close(user.losses, ref.losses, 1e-5, "user-sharded vs DDP")


def _hsdp(rank: int, world: int) -> None:
    # HSDP: 2 replicas x 1 shard.
    ref = _configured_ddp()
    hsdp, hsdp_trainer = fit(ConfiguredMLP, VeScaleStrategy(replicate_size=2), max_steps=4)
    mesh = hsdp_trainer.strategy.device_mesh
    assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (2, 1)
    assert_close(hsdp.losses, ref.losses, 1e-5, "HSDP vs DDP")


def _hsdp_preset(rank: int, world: int) -> None:
    preset = Trainer(strategy="vescale_hsdp", accelerator="cpu", devices=world, logger=False)
    assert preset.strategy._replicate_size == "auto"


def _bf16_mixed(rank: int, world: int) -> None:
    # bf16-mixed: the engine's policy (bf16 compute, fp32 master pieces), within bf16 noise of fp32 DDP.
    ref = _configured_ddp()
    bf16, _ = fit(ConfiguredMLP, "vescale", max_steps=4, precision="bf16-mixed")
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    assert all(g.mp_policy.param_dtype == torch.bfloat16 for g in sharded_groups(bf16))
    assert_close(bf16.losses, ref.losses, 3e-2, "bf16-mixed vs fp32 DDP")


def _bf16_true(rank: int, world: int) -> None:
    # bf16-true: everything bf16.
    ref = _configured_ddp()
    true16, _ = fit(ConfiguredMLP, "vescale", max_steps=2, precision="bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in true16.parameters())
    assert_close(true16.losses, ref.losses[:2], 5e-2, "bf16-true vs fp32 DDP")


class TestVeScaleTrainerMatchesDDP(DistributedTest):
    world_size = 2

    @pytest.fixture(scope="class")
    def runs_dir(self, tmp_path_factory) -> str:
        """Where the shared Transformer runs write their checkpoints (one directory for the class)."""
        return str(tmp_path_factory.mktemp("transformer_runs"))

    def test_parameters_are_ragged_pieces_of_the_full_shapes(self, runs_dir: str) -> None:
        self.run_ranks(_parameters_are_sharded, runs_dir)

    def test_losses_and_gradient_norms_match_ddp(self, runs_dir: str) -> None:
        self.run_ranks(_losses_and_norms_match_ddp, runs_dir)

    def test_accumulation_reduces_only_on_the_final_micro_batch(self, runs_dir: str) -> None:
        self.run_ranks(_accumulation_skips_reduce_scatter, runs_dir)

    def test_validate_test_predict_match_ddp(self, runs_dir: str) -> None:
        self.run_ranks(_evaluation_matches_ddp, runs_dir)

    def test_checkpoint_resume_equals_uninterrupted_training(self, runs_dir: str) -> None:
        self.run_ranks(_resume_equals_uninterrupted, runs_dir)

    def test_another_init_without_the_checkpoint_trains_otherwise(self, runs_dir: str) -> None:
        self.run_ranks(_another_init_differs, runs_dir)

    def test_configure_model_on_meta_equals_ddp_init(self) -> None:
        self.run_ranks(_meta_init_in_configure_model)

    def test_user_sharding_in_configure_model_is_kept(self) -> None:
        self.run_ranks(_user_sharding_kept)

    def test_hsdp_trains_like_ddp(self) -> None:
        self.run_ranks(_hsdp)

    def test_vescale_hsdp_preset_picks_its_replicate_size(self) -> None:
        self.run_ranks(_hsdp_preset)

    def test_bf16_mixed_within_bf16_noise_of_ddp(self) -> None:
        self.run_ranks(_bf16_mixed)

    def test_bf16_true_within_bf16_noise_of_ddp(self) -> None:
        self.run_ranks(_bf16_true)
