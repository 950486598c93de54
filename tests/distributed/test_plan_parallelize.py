"""``parallelize(model, plan, mesh)`` on gloo ranks: training equals the single-process reference under a plan
that mixes granularities, prefetch depths and resharding; the dry run's layouts and bytes per step are the
engine's; the optimizer routing follows the plan; and nothing waits on the default group.

* 2 ranks: one plan mixing granularities, prefetch depths and resharding: its resolution, the dry run's layouts,
  the optimizer routing, parity (1e-5), bytes per step (exact) and prefetch, one test each.
* 4 ranks: two disjoint 2-rank meshes, each training and checkpointing its own sub-module, one pair at a time
  while the other waits outside any collective; a collective over the default group would make the running
  pair wait for the idle one until the process-group timeout, and the test would fail saying which. Then the
  same 2-D mesh as HSDP (replicate over the pairs, shard within them): bytes per step equal the dry run's
  with ``replicate=2``.
* 2 ranks, quantized plan: the plan's quantization equals the quant API's, and the dry run's quantized buffers,
  bytes per rank and bytes per step are the engine's; training with it is bitwise the quant API's.

One class per process group of the former single runs (:class:`tests.dist_pool.DistributedTest`), one test per
behaviour; a test that needs the trained model trains it again (``_train_mixed``, ``_two_steps``).
"""

from __future__ import annotations

import copy
import uuid
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale as lv
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.engine.fully_shard import get_state
from lightning_vescale.optim import route_parameters
from lightning_vescale.plan import policy_of, resolve_plan
from lightning_vescale.plan._dry_run import Workload, dry_run
from lightning_vescale.plan._hardware import load_profile
from lightning_vescale.plan._layout import group_layouts
from lightning_vescale.quant import parse_format, quantize_all_gather, quantize_frozen_weights
from lightning_vescale.quant._gather import QuantizedGatherBuffer
from lightning_vescale.quant._storage import QuantizedStorage
from tests.dist_pool import DistributedTest
from tests.dist_utils import max_piece_diff
from tests.toy_models import MLP, TinyTransformer

LOCAL_BATCH = 3

PLAN = {
    "name": "mixed",
    "rules": [
        {"match": "layers.*", "group": True},
        {"match": "layers.0", "prefetch": 2},
        {"match": "layers.1", "reshard_after_forward": False, "prefetch": 0},
        {"match": "layers.*.mlp.**", "granularity": "row"},
        {"match": "layers.2.attn.qkv.weight", "granularity": "tensor"},
        {"match": "layers.3.attn.proj.weight", "optimizer": "adamw"},
    ],
}


def lm_batch(n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 53, (n, 9), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))



def _parallelized(world: int):
    """The reference, its copy under PLAN over every rank, and the model on the meta device."""
    torch.manual_seed(0)
    ref = TinyTransformer(n_layers=4)
    with torch.device("meta"):
        meta = TinyTransformer(n_layers=4)  # (Module.to("meta") would untie the embedding and the head)
    model = copy.deepcopy(ref)
    lv.parallelize(model, PLAN, init_device_mesh("cpu", (world,)))
    return ref, meta, model


def _plan_resolution(rank: int, world: int) -> None:
    _, _, model = _parallelized(world)
    resolved = lv.resolved_plan_of(model)
    assert resolved is not None and resolved.plan.name == "mixed"
    assert policy_of(model.layers[2].attn.qkv.weight).granularity == "tensor"
    assert policy_of(model.layers[0].mlp.up.weight).granularity == "row"


def _dry_run_buffers(rank: int, world: int) -> None:
    """The dry run's buffers are the engine's, group by group."""
    _, _, model = _parallelized(world)
    resolved = lv.resolved_plan_of(model)
    for g in resolved.groups:
        module = model.get_submodule(g.name) if g.name else model
        engine = [p.fingerprint() for p in get_state(module).group.plans]
        predicted = [lay.plan.fingerprint() for lay in group_layouts(resolved, g, world)]
        assert engine == predicted, g.name


def _optimizer_routing(rank: int, world: int) -> None:
    """Routing: the plan's explicit choice wins over the default (a 2-D matrix would go to Muon)."""
    _, _, model = _parallelized(world)
    routes = {route: [n for n, _ in pairs] for route, pairs in route_parameters(model).items()}
    assert "layers.3.attn.proj.weight" in routes["adamw"] and "layers.2.attn.proj.weight" in routes["muon"]


def _train_mixed(rank: int, world: int):
    """3 clipped AdamW steps under PLAN beside the reference on the whole batch; the bytes sent per step and what
    the prefetch hooks saw."""
    ref, meta, model = _parallelized(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gathered_during_block0: list[list[bool]] = []
    states = [get_state(b).group for b in model.layers]
    model.layers[0].register_forward_pre_hook(lambda m, a: gathered_during_block0.append(
        [g.is_unsharded or any(b._gather_handle is not None for b in g.buffers.values()) for g in states]))
    block1_kept: list[bool] = []
    model.layers[2].register_forward_pre_hook(lambda m, a: block1_kept.append(states[1].is_unsharded))
    sent_per_step = []
    lv.comm_stats.step()  # what parallelize sent is not a step's
    for step in range(3):
        x, y = lm_batch(world * LOCAL_BATCH, step)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        lm_loss(model(x[mine]), y[mine]).backward()
        lm_loss(ref(x), y).backward()
        lv.clip_grad_norm_(model.parameters(), 0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        sent_per_step.append(dict(lv.comm_stats.step()))
    return ref, meta, model, sent_per_step, gathered_during_block0, block1_kept


def _trains_like_the_reference(rank: int, world: int) -> None:
    ref, _, model, _, _, _ = _train_mixed(rank, world)
    assert max_piece_diff(model, ref) < 1e-5


def _bytes_per_step(rank: int, world: int) -> None:
    _, meta, _, sent_per_step, _, _ = _train_mixed(rank, world)
    predicted = dry_run(meta, resolve_plan(meta, PLAN), world, activations={}, hardware=load_profile("cpu"),
                        workload=Workload(batch_size=LOCAL_BATCH, seq_len=8, precision="32-true", clip_grad=True))
    for sent in sent_per_step[1:]:  # the first step also checks that the ranks agree on the plans
        assert sent == {k: int(v) for k, v in predicted.vescale.collectives.items() if v}, (sent, predicted)


def _prefetch(rank: int, world: int) -> None:
    # Prefetch depth 2 from block 0: blocks 1 and 2 are gathering while block 0 runs, block 3 is not (from the
    # second step on, once the forward order is known); block 1 (no reshard after forward) is still gathered when
    # block 2 starts.
    _, _, _, _, gathered_during_block0, block1_kept = _train_mixed(rank, world)
    assert gathered_during_block0[0] == [True, False, False, False]
    assert gathered_during_block0[1] == [True, True, True, False], gathered_during_block0
    assert all(block1_kept)


class TestMixedPlanOn2Ranks(DistributedTest):
    world_size = 2

    def test_plan_resolves_granularities_per_parameter(self) -> None:
        self.run_ranks(_plan_resolution)

    def test_dry_run_buffers_are_the_engines_group_by_group(self) -> None:
        self.run_ranks(_dry_run_buffers)

    def test_optimizer_routing_follows_the_plan(self) -> None:
        self.run_ranks(_optimizer_routing)

    def test_training_matches_the_reference(self) -> None:
        self.run_ranks(_trains_like_the_reference)

    def test_bytes_per_step_equal_the_dry_run(self) -> None:
        self.run_ranks(_bytes_per_step)

    def test_prefetch_depth_and_no_reshard_after_forward(self) -> None:
        self.run_ranks(_prefetch)


def _train_pair(rank: int, mesh, make, directory: str) -> None:
    """Train a sub-module sharded over ``mesh`` beside an unsharded reference, save, load into a fresh copy."""
    group = mesh.get_group()
    me, n = dist.get_rank(group), dist.get_world_size(group)
    torch.manual_seed(0)
    ref = make()
    model = lv.parallelize(copy.deepcopy(ref), None, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    is_lm = isinstance(ref, TinyTransformer)

    def step(net, optimizer, index, local):
        if is_lm:
            x, y = lm_batch(n * LOCAL_BATCH, index)
            loss_fn = lm_loss
        else:
            g = torch.Generator().manual_seed(200 + index)
            x, y = torch.randn(n * LOCAL_BATCH, 7, generator=g), torch.randn(n * LOCAL_BATCH, 5, generator=g)
            loss_fn = F.mse_loss
        if local:
            x, y = x[me * LOCAL_BATCH:(me + 1) * LOCAL_BATCH], y[me * LOCAL_BATCH:(me + 1) * LOCAL_BATCH]
        loss = loss_fn(net(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for i in range(2):
        step(model, opt, i, True)
        step(ref, ref_opt, i, False)
    assert max_piece_diff(model, ref, group) < 1e-5
    ckpt.save(directory, model, opt)
    torch.manual_seed(1)
    fresh = lv.parallelize(make(), None, mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.load(directory, fresh, fresh_opt)
    assert max_piece_diff(fresh, ref, group) < 1e-5
    step(fresh, fresh_opt, 2, True)
    step(ref, ref_opt, 2, False)
    assert max_piece_diff(fresh, ref, group) < 1e-5
    full = ckpt.export_full_state_dict(fresh)  # gathered on the pair's first rank only
    if me == 0:
        assert all(torch.allclose(full[k], v, atol=1e-5) for k, v in ref.state_dict().items())
    else:
        assert full == {}


def _hsdp_bytes_per_step(rank: int, mesh) -> None:
    """HSDP on a 2-D (replicate, shard) mesh: every collective's bytes per step as the dry run says."""
    torch.manual_seed(0)
    model = lv.parallelize(TinyTransformer(n_layers=2), None, mesh)
    with torch.device("meta"):
        meta = TinyTransformer(n_layers=2)
    R, world = mesh.size(0), mesh.size()
    workload = Workload(batch_size=LOCAL_BATCH, seq_len=8, precision="32-true", clip_grad=True)
    predicted = dry_run(meta, resolve_plan(meta), world, replicate=R, activations={}, hardware=load_profile("cpu"),
                        workload=workload)
    assert predicted.mesh == "2-D HSDP (replicate=2, shard=2)"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = lm_batch(world * LOCAL_BATCH, step)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        lm_loss(model(x[mine]), y[mine]).backward()
        lv.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        sent = dict(lv.comm_stats.step())
    assert sent.get("all_reduce_replicate"), sent  # the replicas' AllReduce ran and is counted
    assert sent == {k: int(v) for k, v in predicted.vescale.collectives.items() if v}, (sent, predicted.vescale)


def _pair_mesh():
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp"))
    return mesh_2d, mesh_2d["dp"]  # {0, 1} and {2, 3}


def _two_meshes(rank: int, world: int, tmp: str, token: str) -> None:
    _, mesh = _pair_mesh()
    pair = rank // 2
    assert dist.get_process_group_ranks(mesh.get_group()) == [2 * pair, 2 * pair + 1]
    store = dist.distributed_c10d._get_default_store()
    if pair == 1:
        store.wait([f"{token}-pair0-done"], timedelta(seconds=120))  # outside any collective: pair 0 runs alone
    make = MLP if pair == 0 else lambda: TinyTransformer(n_layers=3)
    _train_pair(rank, mesh, make, f"{tmp}/pair{pair}")
    store.set(f"{token}-pair{pair}-done", "1")
    if pair == 0:
        store.wait([f"{token}-pair1-done"], timedelta(seconds=120))


def _hsdp(rank: int, world: int) -> None:
    mesh_2d, _ = _pair_mesh()
    _hsdp_bytes_per_step(rank, mesh_2d)  # the same 2-D mesh, now as (replicate, shard)


class TestDisjointMeshesOn4Ranks(DistributedTest):
    """Collectives over the default group would wait for the idle pair until the process-group timeout (45 s)."""

    world_size = 4
    pg_timeout = 45

    def test_two_disjoint_meshes_train_and_checkpoint_without_the_default_group(self, tmp_path) -> None:
        self.run_ranks(_two_meshes, str(tmp_path), uuid.uuid4().hex)

    def test_hsdp_bytes_per_step_equal_the_dry_run(self) -> None:
        self.run_ranks(_hsdp)


QUANT_PLAN = {
    "rules": [
        {"match": "layers.*", "group": True},
        {"match": "layers.*.mlp", "quantization": "fp8_block"},
        {"match": "layers.0.attn", "quantization": "int8_block"},
    ],
}


def _frozen_attention_copy(ref: nn.Module) -> nn.Module:
    model = copy.deepcopy(ref)
    model.layers[0].attn.requires_grad_(False)
    return model


def _two_steps(model: nn.Module, rank: int, world: int, sent: Optional[list] = None) -> list[float]:
    """Two AdamW steps; ``sent``: gets the bytes per collective kind of each step."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    lv.comm_stats.step()  # what parallelize sent is not a step's
    losses = []
    for step in range(2):
        x, y = lm_batch(world * LOCAL_BATCH, step)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        loss = lm_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if sent is not None:
            sent.append(dict(lv.comm_stats.step()))
    return losses


def _quantized(world: int):
    """The reference, under QUANT_PLAN, by hand with the quant API, and under the plan without quantization."""
    torch.manual_seed(0)
    ref = TinyTransformer(n_layers=2)
    mesh = init_device_mesh("cpu", (world,))
    planned = lv.parallelize(_frozen_attention_copy(ref), QUANT_PLAN, mesh)
    # The same declarations made by hand, then the plan without quantization.
    by_hand = _frozen_attention_copy(ref)
    quantize_all_gather(by_hand, parse_format("fp8_block"), targets=["layers.*.mlp.*"])
    quantize_frozen_weights(by_hand, parse_format("int8_block"), targets=["layers.0.attn.*"])
    lv.parallelize(by_hand, {"rules": QUANT_PLAN["rules"][:1]}, mesh)
    plain = lv.parallelize(_frozen_attention_copy(ref), {"rules": QUANT_PLAN["rules"][:1]}, mesh)
    with torch.device("meta"):
        meta = _frozen_attention_copy(TinyTransformer(n_layers=2))
    return planned, by_hand, plain, meta, resolve_plan(meta, QUANT_PLAN)


def _quantized_buffers(rank: int, world: int) -> None:
    planned, _, _, _, _ = _quantized(world)
    kinds = {type(b) for block in planned.layers for b in get_state(block).group.buffers.values()}
    assert QuantizedGatherBuffer in kinds and QuantizedStorage in kinds, kinds
    block1 = get_state(planned.layers[1]).group
    quantized_gather = [mp.fqn for mp in block1.managed if isinstance(block1.buffers[mp.key], QuantizedGatherBuffer)]
    assert sorted(quantized_gather) == ["mlp.down.weight", "mlp.up.weight"], quantized_gather  # biases stay plain


def _dry_run_quantized_buffers(rank: int, world: int) -> None:
    """The dry run's buffers are the engine's, quantized ones included: plans, bytes per rank, scales."""
    planned, _, _, _, resolved = _quantized(world)
    for g in resolved.groups:
        engine = list(get_state(planned.get_submodule(g.name) if g.name else planned).group.buffers.values())
        layouts = group_layouts(resolved, g, world)
        assert [b.plan.fingerprint() for b in engine] == [lay.plan.fingerprint() for lay in layouts], g.name
        for buf, lay in zip(engine, layouts):
            local = buf.local_nbytes() if isinstance(buf, QuantizedStorage) else buf.local.numel() * buf.local.itemsize
            assert lay.shard_bytes == local and lay.gathered_bytes == buf.unsharded.numel() * buf.unsharded.itemsize
            assert lay.scales_per_rank == getattr(buf, "scales_per_rank", 0), g.name
    assert {lay.quant for g in resolved.groups for lay in group_layouts(resolved, g, world)} == {
        None, "quantized_gather", "quantized_storage"}


def _quantized_bytes_and_peak(rank: int, world: int) -> None:
    planned, _, _, meta, resolved = _quantized(world)
    # The gathered peak: unsharded bytes of every buffer, sampled around every module's forward and backward
    # (a quantized gather allocates its unsharded weights when waited for, not when prefetched).
    buffers = [b for m in planned.modules() if get_state(m) for b in get_state(m).group.buffers.values()]
    gathered_peak = [0]

    def sample(*unused) -> None:
        gathered_peak[0] = max(gathered_peak[0], sum(b.unsharded.untyped_storage().nbytes() for b in buffers))

    for m in planned.modules():
        m.register_forward_pre_hook(sample)
        m.register_forward_hook(sample)
        m.register_full_backward_pre_hook(sample)
    sent: list[dict] = []
    _two_steps(planned, rank, world, sent)
    predicted = dry_run(meta, resolved, world, activations={}, hardware=load_profile("cpu"),
                        workload=Workload(batch_size=LOCAL_BATCH, seq_len=8, precision="32-true", clip_grad=False))
    assert {"all_gather_quant_codes", "all_gather_quant_scales"} <= sent[1].keys(), sent[1]
    assert sent[1] == {k: int(v) for k, v in predicted.vescale.collectives.items() if v}, (sent[1], predicted.vescale)
    assert gathered_peak[0] == predicted.vescale.gathered_peak, (gathered_peak, predicted.vescale)


def _plan_trains_like_the_quant_api(rank: int, world: int) -> None:
    planned, by_hand, plain, _, _ = _quantized(world)
    planned_losses, by_hand_losses = _two_steps(planned, rank, world), _two_steps(by_hand, rank, world)
    assert planned_losses == by_hand_losses  # bitwise: the same declarations, the same ops
    assert _two_steps(plain, rank, world) != planned_losses  # negative control: quantization changes the gathers


class TestPlanQuantizationOn2Ranks(DistributedTest):
    world_size = 2

    def test_plan_makes_quantized_gather_and_storage_buffers(self) -> None:
        self.run_ranks(_quantized_buffers)

    def test_dry_run_quantized_buffers_are_the_engines(self) -> None:
        self.run_ranks(_dry_run_quantized_buffers)

    def test_quantized_bytes_per_step_and_gathered_peak_equal_the_dry_run(self) -> None:
        self.run_ranks(_quantized_bytes_and_peak)

    def test_plan_quantization_trains_bitwise_like_the_quant_api(self) -> None:
        self.run_ranks(_plan_trains_like_the_quant_api)
