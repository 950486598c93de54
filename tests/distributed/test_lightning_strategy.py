"""``Trainer(strategy="vescale")`` trains like ``strategy="ddp"`` on 2 gloo ranks.

One process group runs every check (starting one costs seconds): the Lightning demo Transformer trained
with DDP and with the engine reaches the same per-step losses (~1e-5) and gradient norms with gradient
accumulation (no ReduceScatter on non-final micro-batches), norm clipping (active), ``sync_dist``
logging, validate/test/predict; a ``ModelCheckpoint`` resume equals uninterrupted training; a model
built in ``configure_model`` on the meta device equals DDP's; the user's own sharding in
``configure_model``, HSDP and bf16-mixed. The Trainer runs inside the pre-initialized process group.
"""

from __future__ import annotations

import os

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
from tests.dist_utils import run_distributed
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


def _transformer_checks(rank: int, world: int, tmp: str) -> None:
    common = dict(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=CLIP)
    ref, ref_trainer = fit(LM, ddp(), **common)
    ckpt_dir = os.path.join(tmp, "ckpt")
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1)
    mine, trainer = fit(LM, "vescale", callbacks=[saver], **common)
    assert isinstance(trainer.strategy, VeScaleStrategy)

    # Sharded: every parameter reports the full model's shape and holds a local piece; the pieces add up to
    # the model.
    assert [(n, p.shape) for n, p in mine.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    pieces = torch.tensor([sum(p.to_local().numel() for p in mine.parameters())])
    dist.all_reduce(pieces)
    assert pieces.item() == sum(p.numel() for p in ref.parameters())
    assert all(is_ragged(p) for p in mine.parameters())
    assert len(sharded_groups(mine)) == 5, "4 encoder/decoder layers + the root self.model"

    # 16 micro-batches (2 epochs x 8), 8 optimizer steps: same losses and true gradient norms as DDP.
    assert len(mine.losses) == 16 and len(mine.norms) == 8
    assert_close(mine.losses, ref.losses, 1e-5, "per-micro-batch losses vs DDP")
    assert_close(mine.norms, ref.norms, 1e-5, "gradient norms vs DDP")
    assert max(ref.norms) > CLIP, "clipping must be active for the comparison to mean anything"
    assert abs(trainer.callback_metrics["train_loss"].item() - ref_trainer.callback_metrics["train_loss"].item()) < 1e-5

    # Accumulation: no ReduceScatter on the first micro-batch of each pair, one per group on the second.
    calls = mine.reduce_scatters
    steps = [calls[i] - (calls[i - 1] if i else calls[0]) for i in range(1, len(calls))]
    assert all(d == 0 for d in steps[1::2]), f"non-final micro-batches issued ReduceScatters: {steps}"
    assert all(d == 5 for d in steps[0::2]), f"final micro-batches must reduce every group once: {steps}"

    # validate / test / predict (sync_dist metrics) agree with DDP.
    for stage in ("validate", "test"):
        got = getattr(trainer, stage)(mine, verbose=False)[0]
        want = getattr(ref_trainer, stage)(ref, verbose=False)[0]
        for key, value in want.items():
            assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (stage, key, got[key], value)
    got = trainer.predict(mine)
    want = ref_trainer.predict(ref)
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    # Resume from the end of epoch 0 (a sharded directory) equals the uninterrupted run, with another init.
    ckpt = os.path.join(ckpt_dir, "epoch=0-step=4.ckpt")
    assert os.path.isdir(ckpt), sorted(os.listdir(ckpt_dir))
    resumed, resumed_trainer = fit(LM, "vescale", init_seed=123, ckpt_path=ckpt, **common)
    assert_close(resumed.losses, mine.losses[8:], 1e-6, "resumed losses vs uninterrupted")
    assert_close(resumed.norms, mine.norms[4:], 1e-6, "resumed gradient norms vs uninterrupted")
    assert resumed_trainer.lr_scheduler_configs[0].scheduler.last_epoch == trainer.lr_scheduler_configs[0].scheduler.last_epoch
    # Negative control: without the checkpoint, the other init gives other losses.
    fresh, _ = fit(LM, "vescale", init_seed=123, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=CLIP)
    assert abs(fresh.losses[0] - mine.losses[0]) > 1e-3


def _configure_model_checks(rank: int, world: int) -> None:
    ref, _ = fit(ConfiguredMLP, ddp(), max_steps=4)
    assert ref.built_on_meta is False

    # Meta init in configure_model, materialized after sharding: equal to DDP's real init.
    mine, _ = fit(ConfiguredMLP, "vescale", max_steps=4)
    assert mine.built_on_meta is True
    assert not any(p.is_meta for p in mine.parameters())
    assert_close(mine.losses, ref.losses, 1e-5, "configure_model meta init vs DDP")

    # Sharded by the user in configure_model with self.device_mesh: kept as it is.
    user, user_trainer = fit(lambda: ConfiguredMLP(shard_myself=True), "vescale", max_steps=4)
    assert len(sharded_groups(user)) == 4
    assert_close(user.losses, ref.losses, 1e-5, "user-sharded vs DDP")

    # HSDP: 2 replicas x 1 shard.
    hsdp, hsdp_trainer = fit(ConfiguredMLP, VeScaleStrategy(replicate_size=2), max_steps=4)
    mesh = hsdp_trainer.strategy.device_mesh
    assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (2, 1)
    assert_close(hsdp.losses, ref.losses, 1e-5, "HSDP vs DDP")
    preset = Trainer(strategy="vescale_hsdp", accelerator="cpu", devices=world, logger=False)
    assert preset.strategy._replicate_size == "auto"

    # bf16-mixed: the engine's policy (bf16 compute, fp32 master pieces), within bf16 noise of fp32 DDP.
    bf16, bf16_trainer = fit(ConfiguredMLP, "vescale", max_steps=4, precision="bf16-mixed")
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    assert all(g.mp_policy.param_dtype == torch.bfloat16 for g in sharded_groups(bf16))
    assert_close(bf16.losses, ref.losses, 3e-2, "bf16-mixed vs fp32 DDP")
    # bf16-true: everything bf16.
    true16, _ = fit(ConfiguredMLP, "vescale", max_steps=2, precision="bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in true16.parameters())
    assert_close(true16.losses, ref.losses[:2], 5e-2, "bf16-true vs fp32 DDP")


def _run(rank: int, world: int, tmp: str) -> None:
    _transformer_checks(rank, world, tmp)
    _configure_model_checks(rank, world)


def test_vescale_trainer_matches_ddp(tmp_path) -> None:
    run_distributed(_run, 2, str(tmp_path), timeout=300)
