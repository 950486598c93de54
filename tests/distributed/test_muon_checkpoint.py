"""Muon's momentum survives a sharded checkpoint saved on 2 ranks and loaded on 3 (a reshard N -> M).

Two process groups (they cost seconds): the 2 saving ranks run once for the module (a fixture), the 3 loading
ranks are one class of tests (:class:`tests.dist_pool.DistributedTest`), one test per behaviour and sharding,
for two shardings of the toy MLP (sizes that divide by neither 2 nor 3):

* ``"muon"``: ``muon_granularity(model)`` keeps each Muon matrix whole on one rank (Muon's local path);
* ``"element"``: the default element granularity splits matrices over ranks (Muon's gather path).

2 ranks (``_save2``): train ``SAVED_STEPS`` steps with ``build_optimizer`` on a deterministic global
batch split over the ranks, ``checkpoint.save``, export the full parameters and optimizer states, then
keep training ``MORE_STEPS`` steps (the run that never stopped), recording the gathered gradients of each
of those steps and the final full parameters and states. Also saves a checkpoint of an MLP with another
hidden size, and each rank's plain ``optimizer.state_dict()`` (local pieces).

3 ranks, per sharding, on freshly built (differently initialized) models and optimizers, each test loading the
checkpoint itself:

1. ``checkpoint.load`` gives bitwise the saved full parameters and optimizer states (every
   ``momentum_buffer``, AdamW's moments and steps, the param groups).
2. The never-stopped continuation on the same gradients is bitwise: each step gets this rank's piece of
   the gradients the 2-rank run computed. Sharded Muon is bitwise ``torch.optim.Muon`` given the same
   gradients (see ``lightning_vescale.optim.muon``), so the resharded run must match bit for bit.
3. The continuation with its own backward on the same global batch, split over 3 ranks, matches to a
   tolerance (why not bitwise: see ``CONTINUE_TOL``).
4. Negative control: a fresh optimizer (model loaded, optimizer not) has no momentum and, on the same
   gradients, ends visibly elsewhere; so the comparisons above can see a momentum that was not restored.
5. Mismatches are refused with a clear error: the other-shape checkpoint (``checkpoint.load``), its full
   optimizer state whose momentum has another shape (``set_optimizer_state_dict``), and a 2-rank local
   ``state_dict`` loaded into the 3-rank Muon (``Muon.load_state_dict``), each leaving the optimizer empty.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.engine.tensor import RaggedTensor, is_ragged
from lightning_vescale.optim import build_optimizer, muon_granularity
from tests.asserts import assert_equal_tree
from tests.dist_pool import DistributedPool, DistributedTest
from tests.toy_models import MLP

GLOBAL_BATCH = 12  # divisible by 2 and 3 ranks: every rank's slice has the same size
SAVED_STEPS = 3
MORE_STEPS = 2
SHARDINGS = ("muon", "element")
HYPER = dict(lr=3e-3, muon_lr=2e-2, weight_decay=0.1, adamw_betas=(0.9, 0.95))
# MLP sizes: with element granularity inp.weight straddles the 2 ranks and every matrix straddles 3 ranks,
# so the gather path runs on both sides of the reshard (the default MLP's matrices fit whole on 2 ranks).
DIM, HIDDEN = 16, 50
OTHER_HIDDEN = 41  # the mismatching checkpoint's MLP hidden size
# The data-parallel gradient is the sum of per-rank means, reduced by gloo in its own order: on 3 ranks it
# rounds differently (~1 ulp) from 2 ranks, and Newton-Schulz runs in bf16, where a 1-ulp fp32 difference
# can flip a rounding of the update (~lr * 2^-8 * |O|). The gradients themselves are checked to GRAD_TOL.
# One such flip per continued step is the bound: adjusted lr (muon_lr * sqrt(rows / cols) for the 50x16 matrices)
# times one bf16 ulp (2^-8) of an orthogonalized element (|O| <= 1). Measured: ~1e-8 without a flip, 6.9e-5 with
# one; the negative control (no momentum) is ~3e-2.
CONTINUE_TOL = MORE_STEPS * HYPER["muon_lr"] * math.sqrt(HIDDEN / DIM) * 2**-8  # 2.8e-4
GRAD_TOL = 1e-6


def make(sharding: str, seed: int, hidden: int = HIDDEN):
    torch.manual_seed(seed)
    model = MLP(dim=DIM, hidden=hidden)
    granularity = muon_granularity(model) if sharding == "muon" else None
    for block in model.blocks:
        lv.fully_shard(block, granularity=granularity)
    lv.fully_shard(model, granularity=granularity)
    return model, build_optimizer(model, **HYPER)


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def backward(model: nn.Module, step: int) -> None:
    """This rank's equal slice of the global batch: the mean of the per-rank means is the global mean."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(step)
    per = GLOBAL_BATCH // world
    mine = slice(rank * per, (rank + 1) * per)
    F.mse_loss(model(x[mine]), y[mine]).backward()


def full(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of sharded ``p`` from every rank's piece ``local`` (of ``p`` or of its grad), on every rank."""
    return local.full_tensor()


def gathered_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p, p.grad) for n, p in model.named_parameters()}


def set_grads(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Give every parameter this rank's piece of the full gradient ``grads[name]``."""
    for n, p in model.named_parameters():
        start, end = p.local_range
        p.grad = RaggedTensor.from_full(grads[n], p.layout_info)


def muon_names(opt) -> list[str]:
    return [n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]]


def max_diff(got: dict, want: dict) -> float:
    assert list(got) == list(want)
    return max((got[k].float() - want[k].float()).abs().max().item() for k in want)


def plan_modes(opt) -> dict:
    return opt.plan_report()["modes"]


# --------------------------------------------------------------------------------------------------------
# 2 ranks: train, save, keep going (the run that never stopped)


def _save2(rank: int, world: int, tmp: str) -> None:
    for sharding in SHARDINGS:
        model, opt = make(sharding, seed=0)
        modes = plan_modes(opt)
        # The two shardings take Muon's two paths (3-rank plans are checked in _load3).
        assert modes.get("gather", 0) > 0 if sharding == "element" else modes == {"local": len(muon_names(opt))}, modes
        for step in range(SAVED_STEPS):
            backward(model, step)
            opt.step()
            opt.zero_grad()
        ckpt.save(os.path.join(tmp, f"ck_{sharding}"), model, opt, extra={"step": SAVED_STEPS})
        params = ckpt.export_full_state_dict(model, rank0_only=False)
        optim = ckpt.export_full_optimizer_state_dict(model, opt, rank0_only=False)
        # Momentum exists for every Muon matrix and is not trivially zero.
        for name in muon_names(opt):
            assert optim["state"][name]["momentum_buffer"].abs().sum() > 0, name
        # A sharded optimizer state is not pickled (a piece alone would reload as something else) ...
        with pytest.raises(TypeError, match="is not pickled"):
            torch.save(opt.state_dict(), os.path.join(tmp, "never.pt"))
        # ... but its pieces can be, by asking for them: what 5c loads on another world size.
        local = opt.state_dict()
        local["state"] = {i: {k: (v.to_local() if is_ragged(v) else v) for k, v in entries.items()}
                          for i, entries in local["state"].items()}
        torch.save(local, os.path.join(tmp, f"local_{sharding}_rank{rank}.pt"))
        grads = []
        for step in range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS):
            backward(model, step)
            grads.append(gathered_grads(model))
            opt.step()
            opt.zero_grad()
        next_params = ckpt.export_full_state_dict(model)
        next_optim = ckpt.export_full_optimizer_state_dict(model, opt)
        if rank == 0:
            torch.save({"params": params, "optim": optim, "grads": grads, "next_params": next_params,
                        "next_optim": next_optim}, os.path.join(tmp, f"ref_{sharding}.pt"))

    # A checkpoint of another model shape (hidden 41): its up/down matrices and their momentum differ.
    other, o_opt = make("element", seed=2, hidden=OTHER_HIDDEN)
    backward(other, 0)
    o_opt.step()
    o_opt.zero_grad()
    ckpt.save(os.path.join(tmp, "ck_other"), other, o_opt)
    o_optim = ckpt.export_full_optimizer_state_dict(other, o_opt)
    if rank == 0:
        torch.save(o_optim, os.path.join(tmp, "ref_other_optim.pt"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """The 2-rank run (its checks of the saved state included), once for the module."""
    tmp = str(tmp_path_factory.mktemp("muon_ckpt"))
    pool = DistributedPool(2)
    try:
        pool.run(_save2, tmp)
    finally:
        pool.close()
    return tmp


# --------------------------------------------------------------------------------------------------------
# 3 ranks: load, compare, continue


def _check_loaded(model, opt, ref: dict, what: str) -> None:
    assert_equal_tree(ckpt.export_full_state_dict(model, rank0_only=False), ref["params"], f"{what} params")
    got = ckpt.export_full_optimizer_state_dict(model, opt, rank0_only=False)
    for name in muon_names(opt):  # the momentum first, by name, for a readable failure
        assert_equal_tree(got["state"][name]["momentum_buffer"], ref["optim"]["state"][name]["momentum_buffer"],
                          f"{what} momentum of {name}")
    assert_equal_tree(got, ref["optim"], f"{what} optimizer")


def _load_restores_state_bitwise(rank: int, world: int, tmp: str, sharding: str) -> None:
    """1. Load into a fresh model (another init) and a fresh optimizer: bitwise the saved state."""
    ref = torch.load(os.path.join(tmp, f"ref_{sharding}.pt"))
    model, opt = make(sharding, seed=1)
    assert not opt.state
    assert ckpt.load(os.path.join(tmp, f"ck_{sharding}"), model, opt) == {"step": SAVED_STEPS}
    _check_loaded(model, opt, ref, f"{sharding}, loaded on {world} ranks")
    modes = plan_modes(opt)
    if sharding == "element":
        assert modes.get("gather", 0) > 0, modes  # matrices straddle ranks: Muon gathers them


def _continuation_on_saved_gradients(rank: int, world: int, tmp: str, sharding: str) -> None:
    """2. The continuation on the never-stopped run's gradients is bitwise that run."""
    ref = torch.load(os.path.join(tmp, f"ref_{sharding}.pt"))
    model, opt = make(sharding, seed=1)
    assert ckpt.load(os.path.join(tmp, f"ck_{sharding}"), model, opt) == {"step": SAVED_STEPS}
    for grads in ref["grads"]:
        set_grads(model, grads)
        opt.step()
        opt.zero_grad()
    next_params = ckpt.export_full_state_dict(model, rank0_only=False)
    assert_equal_tree(next_params, ref["next_params"], f"{sharding} continued params")
    assert_equal_tree(ckpt.export_full_optimizer_state_dict(model, opt, rank0_only=False), ref["next_optim"],
                      f"{sharding} continued optimizer")


def _continuation_with_own_backward(rank: int, world: int, tmp: str, sharding: str) -> None:
    """3. Its own backward on the same global batch, split over 3 ranks: equal up to summation order."""
    ref = torch.load(os.path.join(tmp, f"ref_{sharding}.pt"))
    model, opt = make(sharding, seed=3)
    ckpt.load(os.path.join(tmp, f"ck_{sharding}"), model, opt)
    for k, step in enumerate(range(SAVED_STEPS, SAVED_STEPS + MORE_STEPS)):
        backward(model, step)
        grad_diff = max_diff(gathered_grads(model), ref["grads"][k])
        assert grad_diff < GRAD_TOL, (sharding, step, grad_diff)
        opt.step()
        opt.zero_grad()
    diff = max_diff(ckpt.export_full_state_dict(model, rank0_only=False), ref["next_params"])
    assert diff < CONTINUE_TOL, (sharding, diff)


def _loaded_model_fresh_optimizer(tmp: str, sharding: str):
    """The model loaded, the optimizer not: no momentum."""
    control, c_opt = make(sharding, seed=1)
    ckpt.load(os.path.join(tmp, f"ck_{sharding}"), control)
    assert ckpt.export_full_optimizer_state_dict(control, c_opt, rank0_only=False)["state"] == {}
    return control, c_opt


def _local_state_dict_of_other_world_refused(rank: int, world: int, tmp: str, sharding: str) -> None:
    """5c. A rank-local state_dict of the 2-rank Muon holds pieces of other sizes (on every rank, for both
    shardings): Muon.load_state_dict refuses it instead of loading it silently."""
    _, c_opt = _loaded_model_fresh_optimizer(tmp, sharding)
    local = torch.load(os.path.join(tmp, f"local_{sharding}_rank{min(rank, 1)}.pt"))
    ids = [i for g in local["param_groups"] for i in g["params"]]
    mismatched = [
        n for i, p, n in zip(ids, [p for g in c_opt.param_groups for p in g["params"]],
                             [n for g in c_opt.param_groups for n in g["param_names"]])
        if local["state"].get(i, {}).get("momentum_buffer", p.to_local()).shape != p.to_local().shape
    ]
    assert mismatched, "pieces on 3 ranks differ in size from those on 2 ranks"
    with pytest.raises(ValueError, match=r"cannot load optimizer state 'momentum_buffer' of .*saved with "
                                         r"another sharding.*reshard it through a full or DCP checkpoint"):
        c_opt.load_state_dict(local)
    assert not c_opt.state


def _control_without_momentum_ends_elsewhere(rank: int, world: int, tmp: str, sharding: str) -> None:
    """4. Negative control: the model loaded, the optimizer not. No momentum, and on the very same gradients it
    ends elsewhere: the bitwise checks of the continuation would catch a momentum that was not restored."""
    ref = torch.load(os.path.join(tmp, f"ref_{sharding}.pt"))
    control, c_opt = _loaded_model_fresh_optimizer(tmp, sharding)
    for grads in ref["grads"]:
        set_grads(control, grads)
        c_opt.step()
        c_opt.zero_grad()
    c_optim = ckpt.export_full_optimizer_state_dict(control, c_opt, rank0_only=False)
    c_params = ckpt.export_full_state_dict(control, rank0_only=False)
    for name in muon_names(c_opt):
        assert not torch.equal(c_optim["state"][name]["momentum_buffer"],
                               ref["next_optim"]["state"][name]["momentum_buffer"]), name
        assert not torch.equal(c_params[name], ref["next_params"][name]), name
    assert max_diff(c_params, ref["next_params"]) > 30 * CONTINUE_TOL  # measured: ~3e-2


def _other_shape_checkpoint_refused(rank: int, world: int, tmp: str) -> None:
    """5a. A checkpoint of another model shape: refused before anything changes, naming the difference."""
    model, opt = make("element", seed=5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="does not match the model") as err:
        ckpt.load(os.path.join(tmp, "ck_other"), model, opt)
    named = f"blocks.0.up.weight: checkpoint ({OTHER_HIDDEN}, {DIM}), model ({HIDDEN}, {DIM})"
    assert named in str(err.value), err.value
    assert not opt.state
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def _other_shape_optimizer_state_refused(rank: int, world: int, tmp: str) -> None:
    """5b. The other shape's full optimizer state: the momentum of the wrong shape is named."""
    model, opt = make("element", seed=5)
    other_optim = torch.load(os.path.join(tmp, "ref_other_optim.pt"))
    wrong_momentum = (rf"optimizer state 'momentum_buffer' of blocks\.0\.up\.weight has shape "
                      rf"\({OTHER_HIDDEN}, {DIM}\); expected the parameter's global shape \({HIDDEN}, {DIM}\)")
    with pytest.raises(ValueError, match=wrong_momentum):
        ckpt.set_optimizer_state_dict(model, opt, other_optim)
    assert not opt.state


class TestMuonMomentumReshard2To3(DistributedTest):
    """Saved on 2 ranks (the ``saved`` fixture), loaded on 3."""

    world_size = 3

    @pytest.mark.parametrize("sharding", SHARDINGS)
    def test_load_restores_params_and_optimizer_state_bitwise(self, saved: str, sharding: str) -> None:
        self.run_ranks(_load_restores_state_bitwise, saved, sharding)

    @pytest.mark.parametrize("sharding", SHARDINGS)
    def test_continuation_on_the_same_gradients_is_bitwise(self, saved: str, sharding: str) -> None:
        self.run_ranks(_continuation_on_saved_gradients, saved, sharding)

    @pytest.mark.parametrize("sharding", SHARDINGS)
    def test_continuation_with_its_own_backward_is_close(self, saved: str, sharding: str) -> None:
        self.run_ranks(_continuation_with_own_backward, saved, sharding)

    @pytest.mark.parametrize("sharding", SHARDINGS)
    def test_without_restored_momentum_training_ends_elsewhere(self, saved: str, sharding: str) -> None:
        self.run_ranks(_control_without_momentum_ends_elsewhere, saved, sharding)

    @pytest.mark.parametrize("sharding", SHARDINGS)
    def test_local_state_dict_of_another_world_size_is_refused(self, saved: str, sharding: str) -> None:
        self.run_ranks(_local_state_dict_of_other_world_refused, saved, sharding)

    def test_checkpoint_of_another_model_shape_is_refused(self, saved: str) -> None:
        self.run_ranks(_other_shape_checkpoint_refused, saved)

    def test_optimizer_state_of_another_shape_is_refused(self, saved: str) -> None:
        self.run_ranks(_other_shape_optimizer_state_refused, saved)
