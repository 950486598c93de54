"""``Fabric(strategy="vescale")`` on 2 gloo ranks equals single-process training of the same model.

One test per behaviour (``tests.dist_pool.DistributedTest``, 2 ranks):

* ``strategy="vescale"`` resolves to :class:`VeScaleFabricStrategy`, whose collectives work (``broadcast``);
* a transformer with a tied embedding/head and a frozen parameter, set up jointly with its optimizer
  (``fabric.setup(model, optimizer)``), has one group per block and the root, the optimizer on the local pieces;
* it trains like one process on the whole batch (losses, true global gradient norms under
  ``fabric.clip_gradients``, clipping active; weights to 1e-5, not bitwise: reductions run in other orders) with
  gradient accumulation under ``fabric.no_backward_sync`` (no ReduceScatter on non-final micro-batches);
* saved with ``fabric.save`` as a sharded directory and resumed with ``fabric.load`` into a differently
  initialized model, it replays the same losses and norms (1e-6);
* ``fabric.init_module(empty_init=True)`` gives the same weights as an unsharded init (bitwise);
* bf16-mixed uses the engine's policy (fp32 pieces and outputs); 16-true is refused;
* ``VeScaleFabricStrategy(memory=...)`` trains bitwise like no offloading; a budget is refused.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

import lightning_vescale as lv
import lightning_vescale.lightning  # noqa: F401 - registers strategy="vescale"
from lightning_vescale.engine.fully_shard import sharded_groups
from lightning_vescale.lightning import VeScaleFabricStrategy
from tests.dist_pool import DistributedTest
from tests.dist_utils import max_piece_diff
from tests.toy_models import MLP, TinyTransformer

LOCAL_BATCH = 4
ACCUM = 2
CLIP = 0.05


def lm_batch(n: int):
    tokens = torch.randint(0, 53, (n, 9))
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def rs_calls() -> int:
    return lv.comm_stats.total_calls.get("reduce_scatter", 0)


def train(fabric, model, opt, ref, ref_opt, steps: int, first_step: int = 0):
    """Train the sharded model (local slices) and, if given, the reference (whole batch) side by side."""
    rank, world = fabric.global_rank, fabric.world_size
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    losses, norms, comm = [], [], []
    for step in range(first_step, first_step + steps):
        torch.manual_seed(100 + step)
        micro = [lm_batch(world * LOCAL_BATCH) for _ in range(ACCUM)]
        for i, (x, y) in enumerate(micro):
            before = rs_calls()
            with fabric.no_backward_sync(model, enabled=i < ACCUM - 1):
                loss = lm_loss(model(x[mine]), y[mine]) / ACCUM
                fabric.backward(loss)
            comm.append(rs_calls() - before)
        losses.append(fabric.all_reduce(loss.detach() * ACCUM, reduce_op="mean").item())
        norms.append(fabric.clip_gradients(model, opt, max_norm=CLIP).item())
        opt.step()
        opt.zero_grad()
        if ref is not None:
            with torch.no_grad():
                last = lm_loss(ref(micro[-1][0]), micro[-1][1]).item()
            ref_loss = sum(lm_loss(ref(x), y) / ACCUM for x, y in micro)
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            ref_opt.step()
            ref_opt.zero_grad()
            assert abs(losses[-1] - last) <= 1e-5 * max(1.0, last), (step, losses[-1], last)
            assert abs(norms[-1] - ref_norm.item()) <= 1e-5 * max(1.0, ref_norm.item()), (norms[-1], ref_norm)
            assert ref_norm.item() > CLIP, "clipping must be active for the check to mean anything"
    return losses, norms, comm


def _fabric(world: int, strategy="vescale", **kwargs) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, **kwargs)
    fabric.launch()
    return fabric


def _joint_setup(fabric: Fabric, seed: int = 0):
    """A TinyTransformer (seed ``seed``) and its unsharded copy, each with an AdamW; the copy set up jointly."""
    torch.manual_seed(seed)
    ref = TinyTransformer()
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    return model, opt, ref, ref_opt


def _strategy_resolves(rank: int, world: int) -> None:
    fabric = _fabric(world)
    assert isinstance(fabric.strategy, VeScaleFabricStrategy)
    assert fabric.broadcast(rank, src=1) == 1


def _joint_setup_points_optimizer_at_pieces(rank: int, world: int) -> None:
    # The optimizer built on the unsharded parameters is pointed at the local pieces.
    model, opt, _, _ = _joint_setup(_fabric(world))
    assert len(sharded_groups(model)) == 3, "2 blocks + the root"
    opt_params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in model.parameters()}


def _trains_like_one_process(rank: int, world: int) -> None:
    fabric = _fabric(world)
    model, opt, ref, ref_opt = _joint_setup(fabric)
    losses, norms, comm = train(fabric, model, opt, ref, ref_opt, steps=3)
    # Non-final micro-batches communicate nothing; final ones reduce each group once.
    assert comm[0::2] == [0, 0, 0] and comm[1::2] == [3, 3, 3], comm
    assert max_piece_diff(model, ref) < 1e-5


def _save_and_load_resume(rank: int, world: int, tmp: str) -> None:
    # The state after 3 steps of joint-setup training, then a sharded save, two more steps, then load into
    # another init and replay them.
    fabric = _fabric(world)
    model, opt, _, _ = _joint_setup(fabric)
    train(fabric, model, opt, None, None, steps=3)
    ckpt = os.path.join(tmp, "fabric_ckpt")
    fabric.save(ckpt, {"model": model, "optimizer": opt, "step": 3, "note": {"tag": "a"}})
    assert os.path.isdir(ckpt)
    after, after_norms, _ = train(fabric, model, opt, None, None, steps=2, first_step=3)
    torch.manual_seed(1)
    other = TinyTransformer()
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other, other_opt = fabric.setup(other, other_opt)
    state = {"model": other, "optimizer": other_opt, "step": 0, "note": None}
    remainder = fabric.load(ckpt, state)
    assert state["step"] == 3 and state["note"] == {"tag": "a"} and remainder == {}
    replay, replay_norms, _ = train(fabric, other, other_opt, None, None, steps=2, first_step=3)
    assert replay == pytest.approx(after, abs=1e-6) and replay_norms == pytest.approx(after_norms, abs=1e-6)


def _meta_init(rank: int, world: int) -> None:
    # Meta-device init equals an unsharded init with the same seed; setup_module, then the optimizer.
    fabric = _fabric(world)
    torch.manual_seed(7)
    full = MLP()
    torch.manual_seed(7)
    with fabric.init_module(empty_init=True):
        meta = MLP()
    assert next(meta.parameters()).is_meta
    meta = fabric.setup_module(meta)
    assert max_piece_diff(meta, full) == 0.0
    meta_opt = fabric.setup_optimizers(torch.optim.SGD(meta.parameters(), lr=0.1))
    meta(torch.randn(2, 7)).sum().backward()
    meta_opt.step()


def _bf16_mixed(rank: int, world: int) -> None:
    # bf16-mixed: engine policy, fp32 local pieces.
    bf16 = _fabric(world, precision="bf16-mixed")
    torch.manual_seed(0)
    net = bf16.setup_module(TinyTransformer())
    assert all(g.mp_policy.param_dtype == torch.bfloat16 for g in sharded_groups(net))
    assert all(p.dtype == torch.float32 for p in net.parameters())
    out = net(lm_batch(2)[0])
    assert out.dtype == torch.float32, "root outputs come back in fp32"


def _16_true_refused(rank: int, world: int) -> None:
    with pytest.raises(ValueError, match="does not support precision='16-true'"):
        Fabric(accelerator="cpu", devices=world, strategy="vescale", precision="16-true")


def _memory(rank: int, world: int, tmp: str) -> None:
    from lightning_vescale.memory import MemoryPolicy, resident_pieces

    policy = MemoryPolicy(params="disk", grads="disk", optimizer_states="disk", bucket_bytes=4096,
                          disk_dir=os.path.join(tmp, "swap"))
    runs = []
    for strategy in ("vescale", VeScaleFabricStrategy(memory=policy)):
        fabric = _fabric(world, strategy)
        torch.manual_seed(0)
        model = fabric.setup_module(TinyTransformer())
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses, norms, _ = train(fabric, model, opt, None, None, steps=3)
        runs.append((model, losses, norms))
    (plain, losses, norms), (offloaded, off_losses, off_norms) = runs
    assert off_losses == losses and off_norms == norms, "offloaded training differs"
    pieces = [p.to_local() for p in offloaded.parameters() if p.to_local().numel()]
    assert all(t.untyped_storage().nbytes() == 0 for t in pieces), "the weights live on disk between steps"
    with resident_pieces(offloaded):
        assert all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(plain.parameters(), offloaded.parameters()))


def _memory_budget_refused(rank: int, world: int) -> None:
    from lightning_vescale.memory import MemoryPolicy

    with pytest.raises(ValueError, match="takes explicit placements"):
        VeScaleFabricStrategy(memory=MemoryPolicy(budget="1GiB"))


class TestVeScaleFabric(DistributedTest):
    world_size = 2

    def test_strategy_string_resolves_and_broadcasts(self) -> None:
        self.run_ranks(_strategy_resolves)

    def test_joint_setup_points_the_optimizer_at_the_local_pieces(self) -> None:
        self.run_ranks(_joint_setup_points_optimizer_at_pieces)

    def test_accumulation_and_clipping_train_like_one_process(self) -> None:
        self.run_ranks(_trains_like_one_process)

    def test_sharded_save_and_load_resume_exactly(self, tmp_path) -> None:
        self.run_ranks(_save_and_load_resume, str(tmp_path))

    def test_meta_init_equals_unsharded_init(self) -> None:
        self.run_ranks(_meta_init)

    def test_bf16_mixed_uses_the_engine_policy(self) -> None:
        self.run_ranks(_bf16_mixed)

    def test_16_true_precision_is_refused(self) -> None:
        self.run_ranks(_16_true_refused)

    def test_memory_policy_trains_bitwise(self, tmp_path) -> None:
        """``VeScaleFabricStrategy(memory=...)``: weights, gradients and optimizer states on disk (the optimizer set
        up after the model), with accumulation and clipping: the same losses, norms and weights, bitwise."""
        self.run_ranks(_memory, str(tmp_path))

    def test_memory_policy_with_a_budget_is_refused(self) -> None:
        self.run_ranks(_memory_budget_refused)
