"""An ordinary Accelerate loop with ``VeScaleAccelerator`` on 2 gloo ranks equals single-process training.

One class of tests sharing 2 ranks (:class:`tests.dist_pool.DistributedTest`), one test per behaviour; each builds
its own ``VeScaleAccelerator`` (Accelerate's state is reset around every test, the ranks outlive it):

* ``prepare(model, optimizer, dataloader)`` shards a transformer with a tied embedding/head without wrapping it;
* the ordinary loop: ``accumulate()`` skips the ReduceScatter on non-final micro-batches; ``clip_grad_norm_``
  returns the true global norm (and clipping is active); per-micro-batch losses and norms equal a single-process
  reference on the whole batch (rel 1e-5: the ReduceScatter sums in another order than one backward), and so does
  the full state dict (``get_state_dict``, 1e-5, on the main process only);
* ``save_state`` writes a sharded checkpoint next to Accelerate's files; ``load_state`` into a differently
  initialized model replays the uninterrupted run's losses and norms (abs 1e-6);
* ``prepare_vescale`` builds the optimizer from a factory on a meta-device model (pieces bitwise equal to the
  model built on CPU from the same seed);
* ``VeScaleConfig(memory=...)``: weights, gradients and optimizer states on disk train bitwise like the plain run;
* AdamW8bit prepared as any optimizer trains as AdamW does (final loss within 5%), its 8-bit states sharded, and
  resumes exactly (abs 1e-6);
* errors that name the fix (a plain object as accelerator, ``cpu=False`` on several CPU ranks, config mistakes).
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader, TensorDataset

import lightning_vescale as lv
from lightning_vescale.accelerate import VeScaleAccelerator, VeScaleConfig, prepare_vescale
from lightning_vescale.engine.fully_shard import sharded_groups
from lightning_vescale.memory import MemoryPolicy
from tests.dist_pool import DistributedTest
from tests.toy_models import MLP, TinyTransformer

LOCAL_BATCH = 4
ACCUM = 2
CLIP = 0.05
MICRO = 8  # micro-batches per rank in one pass over the data


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def rs_calls() -> int:
    return lv.comm_stats.total_calls.get("reduce_scatter", 0)


def tokens(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 53, (MICRO * world * LOCAL_BATCH, 9), generator=g)


def _launch_env(rank: int, world: int) -> None:
    """The environment ``accelerate launch`` gives a rank; Accelerate's state starts afresh (the ranks outlive
    a test)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    AcceleratorState._reset_state(True)


def _accelerator(**kwargs) -> VeScaleAccelerator:
    return VeScaleAccelerator(cpu=True, gradient_accumulation_steps=ACCUM, **kwargs)


def run_loop(accelerator, model, opt, dl, *, stop_at=None, on_stop=None):
    """The ordinary Accelerate loop; returns rank-averaged losses, clip norms and ReduceScatters per micro-batch."""
    losses, norms, comm = [], [], []
    for i, (batch,) in enumerate(dl):
        with accelerator.accumulate(model):
            before = rs_calls()
            loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
            accelerator.backward(loss)
            comm.append(rs_calls() - before)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP).item())
            opt.step()
            opt.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        if stop_at is not None and i + 1 == stop_at:
            on_stop()
    return losses, norms, comm


def reference(ref, data, world):
    """Single process, whole global batches: batch i of rank r is data[(i * world + r) * 4 : ...]."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, norms = [], []
    for i in range(MICRO):
        batch = data[i * world * LOCAL_BATCH : (i + 1) * world * LOCAL_BATCH]
        loss = lm_loss(ref(batch[:, :-1]), batch[:, 1:])
        losses.append(loss.item())
        (loss / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP).item())
            opt.step()
            opt.zero_grad()
    return losses, norms


def _prepared_transformer(accelerator, data, seed: int = 0):
    """A TinyTransformer from ``seed``, its AdamW and its dataloader through ``accelerator.prepare``; and a copy of
    the model as built (the single-process reference)."""
    torch.manual_seed(seed)
    ref = TinyTransformer()
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = DataLoader(TensorDataset(data), batch_size=LOCAL_BATCH)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    return ref, model, opt, dl


def _prepare_shards_without_wrapping(rank: int, world: int) -> None:
    _launch_env(rank, world)
    accelerator = _accelerator()
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes == world
    _, model, _, _ = _prepared_transformer(accelerator, tokens(world))
    assert model._is_accelerate_prepared and len(sharded_groups(model)) == 3
    assert isinstance(model, lv.VeScaleModule) and type(model).__name__ == "TinyTransformer", (
        "Accelerate must not wrap the sharded model, whose class keeps its name")
    AcceleratorState._reset_state(True)


def _loop_matches_single_process(rank: int, world: int) -> None:
    _launch_env(rank, world)
    accelerator = _accelerator()
    data = tokens(world)
    ref, model, opt, dl = _prepared_transformer(accelerator, data)
    losses, norms, comm = run_loop(accelerator, model, opt, dl)
    ref_losses, ref_norms = reference(ref, data, world)
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    assert norms == pytest.approx(ref_norms, rel=1e-5), (norms, ref_norms)
    assert min(ref_norms) > CLIP, "clipping must be active for the comparison to mean anything"
    assert comm[0::2] == [0] * (MICRO // 2) and comm[1::2] == [3] * (MICRO // 2), comm
    full = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        want = ref.state_dict()
        assert list(full) == list(want)
        assert max((full[k] - want[k]).abs().max().item() for k in want) < 1e-5
    else:
        assert full == {}
    AcceleratorState._reset_state(True)


def _save_state_then_load_state_replays(rank: int, world: int, tmp: str) -> None:
    _launch_env(rank, world)
    accelerator = _accelerator()
    data = tokens(world)
    _, model, opt, dl = _prepared_transformer(accelerator, data)
    ckpt = os.path.join(tmp, "accel_ckpt")
    losses, norms, _ = run_loop(accelerator, model, opt, dl, stop_at=4, on_stop=lambda: accelerator.save_state(ckpt))
    # The sharded checkpoint is a directory next to Accelerate's own files; no optimizer.bin from rank 0.
    assert os.path.isdir(os.path.join(ckpt, "vescale_model_0")) and not os.path.exists(os.path.join(ckpt, "optimizer.bin"))

    # load_state into another init, skip the batches already seen: the same losses as the uninterrupted run.
    accelerator.free_memory()
    _, other, other_opt, other_dl = _prepared_transformer(accelerator, data, seed=1)
    accelerator.load_state(ckpt)
    assert accelerator.step == 4
    replay, replay_norms, _ = run_loop(accelerator, other, other_opt, accelerator.skip_first_batches(other_dl, 4))
    assert replay == pytest.approx(losses[4:], abs=1e-6) and replay_norms == pytest.approx(norms[2:], abs=1e-6)
    AcceleratorState._reset_state(True)


def _prepare_vescale_on_a_meta_model(rank: int, world: int) -> None:
    """prepare_vescale: a meta-device model, the optimizer from a factory after sharding."""
    _launch_env(rank, world)
    accelerator = _accelerator()
    torch.manual_seed(7)
    full_mlp = MLP()
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = MLP()
    meta, meta_opt = prepare_vescale(accelerator, meta, functools.partial(torch.optim.SGD, lr=0.1))
    assert not any(p.is_meta for p in meta.parameters())
    for name, p in meta.named_parameters():
        start, end = p.local_range
        assert torch.equal(p.to_local().reshape(-1), dict(full_mlp.named_parameters())[name].detach().reshape(-1)[start:end])
    meta(torch.randn(2, 7)).sum().backward()
    meta_opt.step()
    AcceleratorState._reset_state(True)


def _cpu_is_the_default_and_cpu_false_is_refused(rank: int, world: int) -> None:
    _launch_env(rank, world)
    # Several ranks on a machine without CUDA: cpu defaults to True (a plain Accelerator() would run each
    # rank alone); cpu=False is refused with the fix in the message.
    assert VeScaleAccelerator().distributed_type == DistributedType.MULTI_CPU
    AcceleratorState._reset_state(True)
    with pytest.raises(RuntimeError, match="cpu=True"):
        VeScaleAccelerator(cpu=False)
    AcceleratorState._reset_state(True)


def _memory_policy_trains_bitwise(rank: int, world: int, tmp: str) -> None:
    from lightning_vescale.memory import resident_pieces

    _launch_env(rank, world)
    data = tokens(world)
    policy = MemoryPolicy(params="disk", grads="disk", optimizer_states="disk", bucket_bytes=4096,
                          disk_dir=os.path.join(tmp, "swap"))
    runs = []
    for memory in (None, policy):
        accelerator = _accelerator(vescale=VeScaleConfig(memory=memory))
        torch.manual_seed(0)
        model = TinyTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt, dl = accelerator.prepare(model, opt, DataLoader(TensorDataset(data), batch_size=LOCAL_BATCH))
        losses, norms, _ = run_loop(accelerator, model, opt, dl)
        runs.append((model, losses, norms))
        accelerator.free_memory()
        AcceleratorState._reset_state(True)
    (plain, losses, norms), (offloaded, off_losses, off_norms) = runs
    assert off_losses == losses and off_norms == norms, "offloaded training differs"
    assert min(norms) > CLIP, "clipping must be active"
    pieces = [p.to_local() for p in offloaded.parameters() if p.to_local().numel()]
    assert all(t.untyped_storage().nbytes() == 0 for t in pieces), "the weights live on disk between steps"
    with resident_pieces(offloaded):
        assert all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(plain.parameters(), offloaded.parameters()))


def _adamw8bit_loop(data, ckpt: str, make_opt, seed: int, *, stop_at=None, load=None, skip=0):
    """AdamW8bit prepared as any optimizer (its block granularity in VeScaleConfig); saves at ``stop_at``, or
    resumes from ``load`` skipping ``skip`` batches. The losses and the optimizer states."""
    from lightning_vescale.optim import adamw8bit_granularity

    accelerator = _accelerator(vescale=VeScaleConfig(granularity=adamw8bit_granularity()))
    torch.manual_seed(seed)
    model = TinyTransformer()
    opt = make_opt(model.parameters())
    model, opt, dl = accelerator.prepare(model, opt, DataLoader(TensorDataset(data), batch_size=LOCAL_BATCH))
    if load is not None:
        accelerator.load_state(load)
        dl = accelerator.skip_first_batches(dl, skip)
    losses, _, _ = run_loop(accelerator, model, opt, dl, stop_at=stop_at,
                            on_stop=(lambda: accelerator.save_state(ckpt)) if stop_at else None)
    states = list(opt.state.values())
    accelerator.free_memory()
    AcceleratorState._reset_state(True)
    return losses, states


def _adamw8bit_trains_like_adamw(rank: int, world: int, tmp: str) -> None:
    """AdamW8bit trains as AdamW does and its 8-bit states are sharded."""
    from lightning_vescale.optim import AdamW8bit

    _launch_env(rank, world)
    data, ckpt = tokens(world), os.path.join(tmp, "a8_ckpt")
    eight, states = _adamw8bit_loop(data, ckpt, lambda ps: AdamW8bit(ps, lr=1e-2), 0)
    fp32, _ = _adamw8bit_loop(data, ckpt, lambda ps: torch.optim.AdamW(ps, lr=1e-2), 0)
    assert any(s.get("exp_avg_codes", torch.empty(0)).dtype == torch.uint8 for s in states), "no 8-bit states"
    assert eight[-1] < eight[0] and abs(eight[-1] - fp32[-1]) <= 0.05 * fp32[-1], (eight, fp32)


def _adamw8bit_resumes_exactly(rank: int, world: int, tmp: str) -> None:
    """save_state / load_state of AdamW8bit into another init replays the same losses."""
    from lightning_vescale.optim import AdamW8bit

    _launch_env(rank, world)
    data, ckpt = tokens(world), os.path.join(tmp, "a8_ckpt")
    eight, _ = _adamw8bit_loop(data, ckpt, lambda ps: AdamW8bit(ps, lr=1e-2), 0, stop_at=4)
    replay, _ = _adamw8bit_loop(data, ckpt, lambda ps: AdamW8bit(ps, lr=1e-2), 1, load=ckpt, skip=4)
    assert replay == pytest.approx(eight[4:], abs=1e-6), (replay, eight[4:])


class TestAccelerateLoop(DistributedTest):
    """The ordinary Accelerate loop on 2 ranks."""

    world_size = 2

    def test_prepare_shards_the_model_without_wrapping_it(self) -> None:
        self.run_ranks(_prepare_shards_without_wrapping)

    def test_loop_matches_single_process(self) -> None:
        self.run_ranks(_loop_matches_single_process)

    def test_save_state_then_load_state_into_another_init_replays_the_losses(self, tmp_path) -> None:
        self.run_ranks(_save_state_then_load_state_replays, str(tmp_path))

    def test_prepare_vescale_builds_a_meta_model_and_its_optimizer(self) -> None:
        self.run_ranks(_prepare_vescale_on_a_meta_model)

    def test_cpu_is_the_default_on_cpu_ranks_and_cpu_false_is_refused(self) -> None:
        self.run_ranks(_cpu_is_the_default_and_cpu_false_is_refused)

    def test_memory_policy_on_disk_trains_bitwise(self, tmp_path) -> None:
        """``VeScaleConfig(memory=...)``: weights, gradients and optimizer states on disk in the ordinary Accelerate
        loop (accumulate, clip_grad_norm_): the same losses, norms and weights, bitwise."""
        self.run_ranks(_memory_policy_trains_bitwise, str(tmp_path))

    def test_adamw8bit_trains_like_adamw_with_sharded_8bit_states(self, tmp_path) -> None:
        self.run_ranks(_adamw8bit_trains_like_adamw, str(tmp_path))

    def test_adamw8bit_save_state_then_load_state_replays_the_losses(self, tmp_path) -> None:
        self.run_ranks(_adamw8bit_resumes_exactly, str(tmp_path))


def test_prepare_vescale_refuses_a_plain_accelerator() -> None:
    with pytest.raises(TypeError, match="needs a VeScaleAccelerator"):
        prepare_vescale(object(), MLP())


def test_config_validates() -> None:
    with pytest.raises(ValueError, match="replicate_size"):
        VeScaleConfig(replicate_size=0)
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        VeScaleConfig(mp_policy="bf16")


def test_config_refuses_a_memory_budget() -> None:
    with pytest.raises(ValueError, match="takes explicit placements"):
        VeScaleConfig(memory=MemoryPolicy(budget="1GiB"))
