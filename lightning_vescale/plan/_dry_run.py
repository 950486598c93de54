"""The dry run: what a plan costs per rank on ``N`` ranks, computed on the meta device in seconds.

For every group the planner lays out the buffers exactly as ``fully_shard`` will (:mod:`._layout`), so the
bytes below are the engine's: per rank, the sharded parameters, gradients and optimizer states; the bytes
each collective sends per step (what ``comm_stats`` counts); the padding. A walk through one training step
(:func:`_simulate`) gives the peak of gathered parameters with prefetch and the peak memory per rank; a
hardware profile turns FLOPs and bytes into a predicted step time. The same model under FSDP2's layout (each
parameter cut by rows into ``N`` equal padded pieces, copies in and out of its collective buffers) is computed
next to it.

Meshes: 1-D (every rank shards every group) or, with ``replicate=R``, HSDP's 2-D ``(replicate, shard)`` mesh: each
group is sharded over ``N / R`` ranks exactly as on a 1-D mesh of that size, and after each ReduceScatter the
reduced gradient pieces are AllReduced across the ``R`` replicas (``comm_stats`` kind ``all_reduce_replicate``;
the engine issues it when the ReduceScatter completes and waits for it, so it is counted as exposed time).
With ``tp``, a ``(world_size / tp, tp)`` mesh: the plan's ``tp`` rules split modules over ``tp`` ranks, and the
tp-local model is sized as above over ``world_size / tp`` ranks; torch's tensor-parallel AllReduces are added
under ``all_reduce_tp`` (see :mod:`._tensor_parallel`), exposed.
Block-quantized parameters (a plan's ``quantization``) get the engine's quantized buffers (:mod:`._layout`):
their AllGathers are counted under ``all_gather_quant_codes`` and ``all_gather_quant_scales``, as ``comm_stats``
counts them; FSDP2, which has no block-quantized gather or storage, is sized without the quantization.

[Note: one training step, as the engine runs it]
Forward visits the groups in module order. A group is gathered at its pre-forward (unless prefetched) and
issues the AllGathers of the next ``prefetch`` groups (a plain buffer's unsharded parameters exist from the issue;
a block-quantized one holds the gathered codes and scales until it is waited for, and only then its unsharded
parameters, dequantized into); it is freed after its forward if it reshards after
forward and is not a root (a group containing others stays gathered while they run). Activations accumulate.
Backward visits them in reverse: the root is reached first (its outputs; FSDP2's root prefetches the next
groups there, lightning-vescale's does not) and its gradient buffer comes with the head's gradient; a root
that holds only modules after every other group (final norm, head) is done at once, one that holds the
embedding lives to the end (its gradient comes last). Each other group is gathered again if it was freed (not
a group of embeddings: lightning-vescale frees it after forward and does not gather it again; FSDP2 is sized
keeping it gathered), gets its unsharded gradient buffer, prefetches the next groups (lightning-vescale: not
on CPU), frees its activations and parameters when done and issues its ReduceScatter, whose buffers (and an
fp32 copy when reducing in another dtype) stay until it completes: one left in flight on an accelerator, none
on CPU (the engines' defaults). Then the optimizer steps. Transients: the loss's gradient over the vocabulary
at the start of backward, and per group the gradients flowing through it (:func:`_backward_transient`).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_vescale._param_group import backward_reads_params
from lightning_vescale.plan._activations import activation_profile
from lightning_vescale.plan._hardware import HardwareProfile
from lightning_vescale.plan._layout import BufferLayout, block_padding_warnings, group_layouts
from lightning_vescale.plan._resolve import GroupPolicy, ResolvedPlan
from lightning_vescale.plan._spec import PlanError
from lightning_vescale.plan._tensor_parallel import (
    check_tensor_parallel_size,
    tensor_parallel_bytes,
    tensor_parallel_view,
)

__all__ = ["DryRun", "EngineEstimate", "Workload", "check_replicate", "dry_run", "mesh_description"]

PRECISIONS = {
    "32-true": (None, None),
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "bf16-true": (None, None),  # the model itself is bf16
}


@dataclass(frozen=True)
class Workload:
    """What one training step does on each rank."""

    batch_size: int = 1
    """Sequences per rank per micro-batch."""
    seq_len: int = 4096
    """Tokens per sequence."""
    precision: str = "bf16-mixed"
    """``32-true``, ``bf16-mixed`` (bf16 compute, fp32 reduction and master weights) or ``bf16-true``."""
    optimizer: str = "adamw"
    """``adamw`` (two fp32 states per element), ``muon`` (one for Muon's matrices, two for the rest) or ``adamw8bit``
    (two 1-byte codes per element and two fp32 scales per block of 256; fp32 states under 1024 elements)."""
    clip_grad: bool = True
    """Gradient clipping by the global norm (one small all-reduce)."""
    checkpointing: bool = False
    """Activation checkpointing of every group but the roots: each keeps only its input for backward and runs its
    forward again there (one more forward's FLOPs for those groups)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.optimizer not in ("adamw", "muon", "adamw8bit"):
            raise ValueError(f"optimizer must be 'adamw', 'muon' or 'adamw8bit', got {self.optimizer!r}")
        if self.batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {self.batch_size}, {self.seq_len}")

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


@dataclass
class EngineEstimate:
    """Per-rank figures of one engine (lightning_vescale or FSDP2) for one world size."""

    params: float = 0.0
    """Bytes of sharded parameters (local pieces) on the device."""
    grads: float = 0.0
    """Bytes of sharded gradients on the device."""
    optimizer: float = 0.0
    """Bytes of optimizer states on the device, on the busiest rank."""
    off_device: dict = field(default_factory=dict)
    """Bytes per rank a plan's ``tier`` keeps off the device, by ``<class>/<tier>`` (``params/disk``,
    ``optimizer_states/host``; states on the busiest rank): not in ``params`` / ``grads`` / ``optimizer`` nor in
    ``peak``. Where the ranks share a CPU (``shared_compute``), host memory is the device's: ``host`` counts there."""
    gathered_peak: float = 0.0
    """Peak bytes of gathered (unsharded) parameters, prefetch included."""
    activations: float = 0.0
    """Bytes saved for backward per micro-batch."""
    peak: float = 0.0
    """Peak bytes per rank over the step."""
    collectives: dict = field(default_factory=dict)
    """Bytes sent per rank per step, by ``comm_stats`` kind (the quantized AllGathers under
    ``all_gather_quant_codes`` / ``all_gather_quant_scales``, HSDP's AllReduce under ``all_reduce_replicate``,
    tensor parallelism's under ``all_reduce_tp``)."""
    calls: dict = field(default_factory=dict)
    """Collective calls per step, by kind."""
    padding: float = 0.0
    """Padding elements / real elements."""
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    exposed_comm_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    copy_seconds: float = 0.0
    """Copies in and out of collective buffers (FSDP2 only)."""
    replicate_seconds: float = 0.0
    """AllReduces nothing overlaps (part of ``comm_seconds``): HSDP's across replicas, tensor parallelism's."""

    @property
    def bytes_per_step(self) -> float:
        return float(sum(self.collectives.values()))

    @property
    def all_gather_bytes(self) -> float:
        """AllGather bytes per step, quantized ones included."""
        return float(sum(v for k, v in self.collectives.items() if k.startswith("all_gather")))


@dataclass
class DryRun:
    """The dry run of a plan on ``world_size`` ranks: lightning_vescale and FSDP2 side by side."""

    model: str
    plan: str
    world_size: int
    workload: Workload
    hardware: str
    num_params: int
    replicate: int = 1
    """HSDP replicas (1: a 1-D mesh); each group is sharded over ``world_size // replicate`` ranks."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks (1: none); each group is sharded over ``world_size // tensor_parallel`` ranks."""
    mesh: str = ""
    """The mesh assumed, in words."""
    groups: list = field(default_factory=list)
    """Per group: name, parameters, shard bytes, gathered bytes, padding, bytes sent per step."""
    vescale: EngineEstimate = field(default_factory=EngineEstimate)
    fsdp2: EngineEstimate = field(default_factory=EngineEstimate)
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["workload"] = asdict(self.workload)
        return out


# --------------------------------------------------------------------------------------------------------
# Per-rank optimizer states


def _state_bytes(optimizer: str, route: str, numel: int, itemsize: int) -> float:
    """Optimizer-state bytes per element of a parameter of ``numel`` elements in a master dtype of ``itemsize``."""
    if route == "none":
        return 0
    if optimizer == "muon" and route == "muon":
        return itemsize  # momentum
    if optimizer == "adamw8bit":
        from lightning_vescale.optim.adamw8bit import DEFAULT_BLOCK_SIZE, DEFAULT_MIN_8BIT_SIZE

        if numel >= DEFAULT_MIN_8BIT_SIZE:  # two 1-byte codes and two fp32 scales per block
            return 2 + 2 * 4 / DEFAULT_BLOCK_SIZE
    return 2 * itemsize  # AdamW's exp_avg and exp_avg_sq


def _per_rank_state_elements(layout: BufferLayout, weights: list[float]) -> torch.Tensor:
    """Per rank: sum over tensors of (elements of the tensor on that rank) * weight (a tensor of length N)."""
    plan = layout.plan
    N, S = plan.world_size, plan.shard_size
    diff = torch.zeros(N + 1, dtype=torch.float64)
    ends = torch.zeros(N, dtype=torch.float64)
    for off, spec, w in zip(plan.offsets, plan.specs, weights):
        if not w or not spec.numel:
            continue
        end = off + spec.numel
        first, last = off // S, (end - 1) // S
        if first == last:
            ends[first] += spec.numel * w
            continue
        ends[first] += ((first + 1) * S - off) * w
        ends[last] += (end - last * S) * w
        if last > first + 1:
            diff[first + 1] += S * w
            diff[last] -= S * w
    return torch.cumsum(diff, 0)[:N] + ends


# --------------------------------------------------------------------------------------------------------
# One step


@dataclass
class _Group:
    name: str
    is_root: bool
    reshard: bool
    prefetch: int
    gathered: float  # unsharded parameter bytes
    grad: float  # unsharded gradient bytes
    reduce_extra: float  # a copy of the gradient in the reduce dtype, alive until the ReduceScatter completes
    activations: float
    largest_param: float = 0.0  # bytes of its largest parameter: autograd makes its gradient, then adds it in
    recompute: float = 0.0  # checkpointing: the activations its backward makes again
    gather_transient: float = 0.0  # FSDP2: the AllGather output next to the unsharded parameters while copying out
    reduce_transient: float = 0.0  # FSDP2: the ReduceScatter input built from the gradients; ours: the copy that
    # reorders a tile-major quantized weight's gradient into tile order (the largest such weight of the group)
    grad_piece: float = 0.0  # this rank's sharded gradient bytes: allocated at the group's ReduceScatter (both
    # engines free them at zero_grad(set_to_none=True), so none exist when forward starts)
    done_early: bool = False  # a root whose modules run after every other group's (norm, head): its backward
    # is over as soon as backward starts
    gathered_late: float = 0.0  # block-quantized buffers: unsharded bytes (part of ``gathered``) allocated only when
    # the gather is waited for (dequantized into), not when it is issued
    in_flight: float = 0.0  # block-quantized buffers: codes and scales alive from the gather's issue to its wait
    backward_reads: bool = True  # False: embeddings only, not gathered for backward (ParamGroup.backward_reads_params)


def _backward_transient(g: _Group) -> float:
    """Gradients in flight inside one group's backward: about one group's activations (the gradient of each saved
    tensor is made and consumed while its neighbours are still alive), and a parameter's new gradient, which
    autograd makes whole before adding it into the gradient buffer's view."""
    return g.activations + g.recompute + g.largest_param


def _simulate(order: list[_Group], persistent: float, logits_grad: float,
              reduces_in_flight: int = 1, root_prefetches: bool = True,
              backward_prefetch: bool = True) -> tuple[float, float]:
    """(peak bytes, peak gathered bytes) of one step, walking [Note: one training step, as the engine runs it].

    ``order``: the groups in forward order; ``persistent``: bytes alive throughout (parameter pieces, states);
    ``logits_grad``: bytes of the loss's gradient over the vocabulary (fp32, every token);
    ``reduces_in_flight``: ReduceScatters left running while backward goes on (the engine's default for the device);
    ``root_prefetches``: whether the roots' pre-backward gathers the next groups (FSDP2) or each group gathers
    at its own (lightning-vescale: not while the head's backward holds the step's peak);
    ``backward_prefetch``: whether a group's backward gathers the next groups (lightning-vescale: not on a CPU,
    see ``default_backward_prefetch``).
    """
    gathered: dict[str, float] = {}
    activations = 0.0
    peak = peak_gathered = 0.0
    parents: list[_Group] = []  # groups whose forward is still running

    def note(extra: float = 0.0) -> None:
        nonlocal peak, peak_gathered
        g = sum(gathered.values())
        peak_gathered = max(peak_gathered, g)
        peak = max(peak, persistent + g + grads_alive() + pieces + activations + sum(pending.values()) + extra)

    in_flight: list[_Group] = []
    grad_buffers: dict[str, float] = {}
    pieces = 0.0  # sharded gradients of the groups reduced so far
    pending: dict[str, float] = {}  # gathers issued (prefetched) and not yet waited for: their codes and scales

    def grads_alive() -> float:
        return sum(grad_buffers.values())

    def issue(g: _Group) -> None:
        """A prefetch: plain buffers' unsharded storage now, quantized ones' codes and scales until waited for."""
        if g.name not in gathered:
            gathered[g.name] = g.gathered - g.gathered_late
            pending[g.name] = g.in_flight
            note(g.gather_transient)

    def gather(g: _Group) -> None:
        """Issued if not prefetched, and waited for: quantized buffers dequantize from their codes and scales."""
        issue(g)
        if g.name in pending:
            gathered[g.name] = g.gathered
            note(pending.pop(g.name))

    def is_ancestor(a: _Group, b: _Group) -> bool:
        return a.name == "" or b.name.startswith(a.name + ".")

    for i, g in enumerate(order):
        while parents and not is_ancestor(parents[-1], g):
            done = parents.pop()
            if done.reshard and not done.is_root:
                gathered.pop(done.name, None)
        gather(g)
        for nxt in order[i + 1 : i + 1 + g.prefetch]:
            issue(nxt)
        activations += g.activations
        note()
        parents.append(g)
    for done in parents:
        if done.reshard and not done.is_root:
            gathered.pop(done.name, None)
    # Backward starts at the loss: the gradients of the log-probabilities and of the logits, and one more
    # vocabulary-sized tensor the system holds there (measured, not identified: benchmarks/plan_check.py puts the
    # step's peak at this point since the head's gradient buffer comes with its gradient, 1 logits' size above two,
    # at batch 2 and 4), then the output head's weight gradient while the logits' is still alive (the roots have
    # prefetched the last groups again).
    note(3 * logits_grad)
    reverse = order[::-1]
    roots = [g for g in order if g.is_root]
    for root in roots:
        gather(root)
        for nxt in [g for g in reverse if not g.is_root][: root.prefetch if root_prefetches else 0]:
            issue(nxt)
    # The head's weight gradient is made while the logits' is alive; the roots' gradient buffers come with it
    # (lightning-vescale allocates a group's at its first gradient; FSDP2 has none before), the logits' gone.
    largest = max((r.largest_param for r in roots), default=0.0)
    note(logits_grad + largest)
    for root in roots:
        grad_buffers[root.name] = root.grad
    note(largest)

    def reduce(g: _Group) -> None:
        nonlocal pieces
        pieces += g.grad_piece
        if g.grad:
            grad_buffers[g.name] = g.grad + g.reduce_extra
            note(g.reduce_transient)
            in_flight.append(g)
            while len(in_flight) > reduces_in_flight:
                grad_buffers.pop(in_flight.pop(0).name, None)

    for root in [r for r in roots if r.done_early]:
        activations -= root.activations
        gathered.pop(root.name, None)
        reduce(root)
    for i, g in enumerate(reverse):
        if g.is_root:
            continue
        if g.backward_reads:
            gather(g)
        grad_buffers[g.name] = g.grad
        for nxt in reverse[i + 1 : i + 1 + (g.prefetch if backward_prefetch else 0)]:
            if not nxt.is_root and nxt.backward_reads:
                issue(nxt)
        note(_backward_transient(g))
        activations -= g.activations
        gathered.pop(g.name, None)
        reduce(g)
    for root in [r for r in roots if not r.done_early]:
        note(_backward_transient(root))
        gathered.pop(root.name, None)
        activations -= root.activations
        reduce(root)
    return peak, peak_gathered


# --------------------------------------------------------------------------------------------------------
# The dry run


_ORDERS: dict[tuple[int, int], list[GroupPolicy]] = {}


def _forward_order(model: nn.Module, resolved: ResolvedPlan) -> list[GroupPolicy]:
    """The groups in module order (the order their forwards start); computed once per model and plan."""
    key = (id(model), id(resolved))
    if key not in _ORDERS:
        position = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
        _ORDERS.clear()  # one model at a time: ids of collected objects must not be reused
        _ORDERS[key] = sorted(resolved.groups, key=lambda g: position.get(g.name, -1))
    return _ORDERS[key]


def _roots_done_early(model: nn.Module, groups: list[GroupPolicy]) -> set[str]:
    """Roots whose parameters all sit in modules after every other group's (a final norm and head): their
    gradients are complete as soon as backward has passed the head."""
    position = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    inner = [g.name for g in groups if not g.is_root]
    last_inner = max((i for name, i in position.items()
                      if any(name == n or name.startswith(n + ".") for n in inner)), default=-1)
    early = set()
    for g in groups:
        owners = [position.get(p.rpartition(".")[0], -1) for p in g.params]
        if g.is_root and owners and min(owners) > last_inner:
            early.add(g.name)
    return early


def _matmul_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 per matmul weight element a token meets (routed experts: only the
    chosen ``top_k``; a tied output head: the embedding), plus attention's ``6 * T * H * K`` per layer (causal:
    half of ``12``)."""
    from lightning_vescale.models.llama import TiedOutput
    from lightning_vescale.models.moe import MoEFeedForward

    weights = 0.0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            weights += m.weight.numel()
        elif isinstance(m, MoEFeedForward):
            share = m.router.top_k / m.router.num_experts
            weights += sum(p.numel() for p in m.experts.parameters()) * share
        elif isinstance(m, TiedOutput):
            weights += m.weight.numel()
    attention = 0.0
    for m in model.modules():
        wo = getattr(m, "wo", None)
        if hasattr(m, "n_heads") and isinstance(wo, nn.Linear):
            attention += 6 * seq_len * wo.weight.shape[1]
    return 6 * weights + attention


_FLOPS: dict[tuple[int, int], float] = {}


def _flops_per_token(model: nn.Module, seq_len: int) -> float:
    key = (id(model), seq_len)
    if key not in _FLOPS:
        _FLOPS.clear()
        _FLOPS[key] = _matmul_flops_per_token(model, seq_len)
    return _FLOPS[key]


def dry_run(
    model: nn.Module,
    resolved: ResolvedPlan,
    world_size: int,
    *,
    workload: Workload = Workload(),
    hardware: HardwareProfile,
    activations: Optional[dict[str, float]] = None,
    replicate: int = 1,
    tensor_parallel: int = 1,
) -> DryRun:
    """Size one training step of ``model`` sharded by ``resolved`` on ``world_size`` ranks (see the module doc).

    Args:
        model: the unsharded model on the meta device (in the master dtype: bf16 for ``bf16-true``).
        resolved: the plan resolved against ``model``.
        world_size: ranks in all.
        workload: batch, sequence, precision, optimizer.
        hardware: the profile that turns FLOPs and bytes into seconds.
        activations: per group, bytes saved per token (:func:`~lightning_vescale.plan._activations.activation_profile`);
            counted here if not given (pass it to size several world sizes with one count).
        replicate: HSDP: a ``(replicate, world_size // replicate)`` mesh, sharding over the second dimension and
            AllReducing gradients over the first; 1 (default): a 1-D mesh.
        tensor_parallel: a ``(world_size // tp, tp)`` mesh: the plan's ``tp`` rules split modules over ``tp`` ranks
            and each group of the tp-local model is sharded over the first dimension
            (:mod:`~lightning_vescale.plan._tensor_parallel`). ``model`` / ``resolved`` may be the global ones or
            :func:`~lightning_vescale.plan._tensor_parallel.tensor_parallel_view`'s; given ``activations`` must be
            counted on that view (``None``: counted here, on it).

    Raises:
        PlanError: ``replicate`` does not divide ``world_size``.
    """
    R = check_replicate(world_size, replicate)
    TP = check_tensor_parallel_size(world_size, R, tensor_parallel)
    if TP > 1 and getattr(model, "_vescale_tp_local", 1) != TP:
        model, resolved = tensor_parallel_view(model, resolved, TP)
    N = world_size // (R * TP)  # the shard group's ranks: every per-rank figure below is on them
    param_dtype, reduce_dtype = PRECISIONS[workload.precision]
    groups = _forward_order(model, resolved)
    compute_dtype = param_dtype or next(model.parameters()).dtype
    if activations is None:
        activations = activation_profile(model, [g.name for g in groups], compute_dtype=compute_dtype)
    tokens = workload.tokens
    hidden = _hidden_size(model) * compute_dtype.itemsize
    out = DryRun(model=resolved.model_type, plan=resolved.plan.name or "unnamed", world_size=world_size,
                 workload=workload, hardware=hardware.name, num_params=getattr(model, "_vescale_global_numel", sum(p.numel for p in resolved.params.values())),
                 replicate=R, tensor_parallel=TP, mesh=mesh_description(world_size, R, TP))
    # HSDP's replicas: rank i of every shard group; they span every node once the shard group fills one.
    t_replicate = functools.partial(hardware.all_reduce_seconds, world_size=R, span=world_size)
    ve, fs = out.vescale, out.fsdp2
    ve.collectives.update(all_gather=0, reduce_scatter=0)
    ve_groups, fs_groups = [], []
    state_per_rank = torch.zeros(N, dtype=torch.float64)  # on the device
    states_off: dict[str, torch.Tensor] = {}  # tier -> per rank, a plan's states off the device

    def tier(name: str, cls: str) -> str:
        """Where a plan puts ``cls`` of parameter ``name``: ``device`` unless off the device's memory."""
        t = resolved.params[name].tier_of(cls) or "device"
        return "device" if t == "host" and hardware.shared_compute else t

    def add_off(cls: str, t: str, nbytes: float) -> None:
        ve.off_device[f"{cls}/{t}"] = ve.off_device.get(f"{cls}/{t}", 0.0) + nbytes

    per_rank_cache: dict[tuple, torch.Tensor] = {}
    total_real = total_padding = fs_padding = 0.0
    fs_state = fs_params = 0.0
    first_gather = last_reduce = fs_first_gather = fs_last_reduce = 0.0
    ag_calls: dict[str, int] = {}
    rs_calls = ar_calls = 0
    quantized: dict[str, int] = {}
    group_buffers: list[tuple[str, list[BufferLayout]]] = []
    early = _roots_done_early(model, groups)
    modules = dict(model.named_modules(remove_duplicate=False))
    for g in groups:
        layouts = group_layouts(resolved, g, N, base_param_dtype=param_dtype, base_reduce_dtype=reduce_dtype)
        group_buffers.append((g.label, layouts))
        # A group of embeddings is not gathered for backward (it reads no weight): lightning-vescale frees it after
        # forward, and FSDP2, which would gather it again, is sized keeping it instead (one AllGather each).
        reads = backward_reads_params([modules[n.rpartition(".")[0]] for p in g.params
                                       for n in (p, *resolved.params[p].aliases)])
        gathers = 2 if g.reshard_after_forward and not g.is_root and reads else 1
        shard = gathered = late = grad = extra = ag = rs = ar = real = pad = transient = grad_piece = off_params = 0.0
        reorder = 0.0
        largest = max((resolved.params[n].numel for n in g.params), default=0)
        for lay in layouts:
            S = lay.plan.shard_size
            pb, rb, mb = lay.param_dtype.itemsize, lay.reduce_dtype.itemsize, lay.dtype.itemsize
            names = [(g.name + "." if g.name else "") + spec.name for spec in lay.plan.specs]
            # A buffer's pieces move as one (resolve_plan checked that its parameters agree); quantized ones stay.
            params_tier = tier(names[0], "params") if names and not lay.quant else "device"
            grads_tier = tier(names[0], "grads") if names and not lay.quant else "device"
            if params_tier != "device":
                add_off("params", params_tier, lay.shard_bytes)
                off_params += lay.shard_bytes
            shard += lay.shard_bytes
            gathered += lay.gathered_bytes
            real += lay.real_numel
            pad += lay.padding_elements
            if lay.quant:
                late += lay.gathered_bytes
                transient += lay.gather_transient
                quantized[lay.quant] = quantized.get(lay.quant, 0) + lay.real_numel
            for kind, sent in lay.all_gather_bytes().items():
                ve.collectives[kind] = ve.collectives.get(kind, 0) + gathers * sent
                ag += gathers * sent
                ag_calls[kind] = ag_calls.get(kind, 0) + gathers
            if lay.requires_grad:
                reorder = max(reorder, lay.reduce_transient)
                if grads_tier != "device":  # written to its tier as soon as its ReduceScatter is done
                    add_off("grads", grads_tier, S * mb)
                else:
                    ve.grads += S * mb
                    grad_piece += S * mb
                grad += N * S * pb
                if lay.reduce_dtype != lay.param_dtype:
                    extra += N * S * rb
                if N > 1:
                    rs += (N - 1) * S * rb
                    rs_calls += 1
                if R > 1:  # DBuffer.wait_reduce: one AllReduce of the reduced piece (reduce dtype) per buffer
                    ar += 2 * (R - 1) * S * rb // R
                    ar_calls += 1
            if lay.quant == "quantized_storage":
                continue  # frozen: no optimizer states
            routes = [resolved.params[n].optimizer for n in names]
            where = [tier(n, "optimizer_states") for n in names]
            for t in sorted(set(where)):
                weights = tuple(_state_bytes(workload.optimizer, r, resolved.params[n].numel, mb) if w == t else 0
                                for n, r, w in zip(names, routes, where))
                key = (id(lay.plan), weights)  # identical groups share one BufferPlan (the planner's cache)
                if key not in per_rank_cache:
                    per_rank_cache[key] = _per_rank_state_elements(lay, list(weights))
                if t == "device":
                    state_per_rank += per_rank_cache[key]
                else:
                    states_off[t] = states_off.get(t, torch.zeros(N, dtype=torch.float64)) + per_rank_cache[key]
        ve.params += shard - off_params
        ve.collectives["reduce_scatter"] = ve.collectives.get("reduce_scatter", 0) + rs
        if R > 1:
            ve.collectives["all_reduce_replicate"] = ve.collectives.get("all_reduce_replicate", 0) + ar
        total_real += real
        total_padding += pad
        act = activations.get(g.name, 0.0) * tokens
        recompute = 0.0
        if workload.checkpointing and not g.is_root and act:
            act, recompute = hidden * tokens, act  # only the group's input is kept
        largest_bytes = largest * (layouts[0].param_dtype.itemsize if layouts else 4)
        ve_groups.append(_Group(g.name, g.is_root, g.reshard_after_forward, g.prefetch, gathered, grad, extra, act,
                                largest_bytes, recompute, gathered_late=late, in_flight=transient, grad_piece=grad_piece,
                                done_early=g.name in early, backward_reads=reads, reduce_transient=reorder))
        t_ag = hardware.collective_seconds(ag / max(gathers, 1), N)
        t_rs = hardware.collective_seconds(rs, N)
        t_ar = t_replicate(ar) if ar else 0.0
        ve.comm_seconds += gathers * t_ag + t_rs + t_ar
        ve.replicate_seconds += t_ar
        first_gather = first_gather or t_ag
        last_reduce = t_rs or last_reduce
        # FSDP2: every parameter cut by rows into N equal pieces (dim 0 padded to a multiple of N).
        f_shard = f_gathered = f_grad = f_ag = f_rs = f_ar = f_real = f_elems = f_rs_input = f_piece = 0.0
        for name in g.params:
            p = resolved.params[name]
            dtype = getattr(torch, p.dtype)
            rows = p.shape[0] if p.shape else 1
            rest = p.numel // max(rows, 1) if rows else 0
            piece = -(-rows // N) * rest
            floating = dtype.is_floating_point
            mb = dtype.itemsize
            pb = (param_dtype if floating and param_dtype is not None else dtype).itemsize
            rb = (reduce_dtype if floating and reduce_dtype is not None else param_dtype if floating and param_dtype
                  else dtype).itemsize
            f_elems += N * piece
            f_shard += piece * mb
            f_gathered += N * piece * pb
            f_real += p.numel
            fs_state += _state_bytes(workload.optimizer, p.optimizer, p.numel, mb) * piece
            if p.requires_grad:
                f_grad += N * piece * pb
                f_rs_input += N * piece * rb
                fs.grads += piece * mb
                f_piece += piece * mb
                f_rs += (N - 1) * piece * rb if N > 1 else 0
                f_ar += 2 * (R - 1) * piece * rb / R  # FSDP2's HSDP: one AllReduce of the group's reduced pieces
            f_ag += gathers * (N - 1) * piece * pb if N > 1 else 0
        fs_params += f_shard
        fs_padding += f_elems - f_real
        fs.collectives["all_gather"] = fs.collectives.get("all_gather", 0) + f_ag
        fs.collectives["reduce_scatter"] = fs.collectives.get("reduce_scatter", 0) + f_rs
        if R > 1:
            fs.collectives["all_reduce_replicate"] = fs.collectives.get("all_reduce_replicate", 0) + f_ar
        # FSDP2 copies the gradients into a ReduceScatter input (in the reduce dtype) and frees them: the input
        # replaces them until the ReduceScatter completes, and both live during the copy.
        fs_groups.append(_Group(g.name, g.is_root, g.reshard_after_forward and reads, g.prefetch, f_gathered, f_grad,
                                f_rs_input - f_grad, act, largest_bytes, recompute, gather_transient=f_gathered,
                                reduce_transient=f_grad, grad_piece=f_piece, done_early=g.name in early))
        ft_ag = hardware.collective_seconds(f_ag / max(gathers, 1), N)
        ft_rs = hardware.collective_seconds(f_rs, N)
        ft_ar = t_replicate(f_ar) if f_ar else 0.0
        fs.comm_seconds += gathers * ft_ag + ft_rs + ft_ar
        fs.replicate_seconds += ft_ar
        fs.copy_seconds += (gathers * 2 * f_gathered + 2 * f_grad) / hardware.memory_bandwidth
        fs_first_gather = fs_first_gather or ft_ag
        fs_last_reduce = ft_rs or fs_last_reduce
        out.groups.append({
            "group": g.label, "params": len(g.params), "elements": int(real), "shard_bytes": shard,
            "gathered_bytes": gathered, "padding": pad / max(real, 1),
            "padding_lower_bound": sum(lay.lower_bound_padding_elements for lay in layouts) / max(real, 1),
            "all_gather_bytes": ag,
            "reduce_scatter_bytes": rs, "all_reduce_replicate_bytes": ar,
            "quantization": sorted({resolved.params[n].quantization for n in g.params} - {"none"}),
            "fsdp2_padding": (f_elems - f_real) / max(f_real, 1),
        })
    ve.calls = {**ag_calls, "reduce_scatter": rs_calls}
    fs.calls = {"all_gather": sum(ag_calls.values()), "reduce_scatter": rs_calls}
    if R > 1:
        ve.calls["all_reduce_replicate"] = ar_calls
        fs.calls["all_reduce_replicate"] = len(groups)
    if TP > 1:  # torch's tensor-parallel AllReduces: on the critical path (nothing overlaps them)
        checkpointed = frozenset(g.name for g in groups if workload.checkpointing and not g.is_root)
        tp_bytes, tp_calls = tensor_parallel_bytes(model, resolved.tensor_parallel, TP, tokens,
                                                   compute_dtype.itemsize, checkpointed)
        t_tp = hardware.all_reduce_seconds(tp_bytes / max(tp_calls, 1), world_size=TP, span=TP) * tp_calls
        for est in (ve, fs):
            est.collectives["all_reduce_tp"] = tp_bytes
            est.calls["all_reduce_tp"] = tp_calls
            est.comm_seconds += t_tp
            est.replicate_seconds += t_tp  # exposed, as HSDP's AllReduce
    if workload.clip_grad and N > 1:  # over the shard group: the replicas hold the same reduced gradients
        n_grads = sum(1 for p in resolved.params.values() if p.requires_grad)
        ve.collectives["all_reduce_ragged"] = 2 * (N - 1) * n_grads * 4 // N
        ve.calls["all_reduce_ragged"] = 1
    if workload.clip_grad and TP > 1:  # the split parameters' squared norms are summed over tp too
        split: frozenset[str] = getattr(model, "_vescale_tp_split", frozenset())
        n_split = sum(1 for n in split if resolved.params[n].requires_grad)
        ve.collectives["all_reduce_ragged"] = ve.collectives.get("all_reduce_ragged", 0) + 2 * (TP - 1) * n_split * 4 // TP
        ve.calls["all_reduce_ragged"] = ve.calls.get("all_reduce_ragged", 0) + 1
    ve.optimizer = float(state_per_rank.max()) if N else 0.0
    for t, per_rank in states_off.items():
        add_off("optimizer_states", t, float(per_rank.max()))
    fs.params, fs.optimizer = fs_params, fs_state
    ve.padding = total_padding / max(total_real, 1)
    fs.padding = fs_padding / max(total_real, 1)
    logits_grad = tokens * _vocab(model) * 4
    in_flight = 0 if hardware.shared_compute else 1  # the engines' default: see default_reduces_in_flight
    for est, order in ((ve, ve_groups), (fs, fs_groups)):
        est.activations = sum(g.activations for g in order)
        persistent = est.params + est.optimizer  # gradient pieces: allocated group by group in backward
        est.peak, est.gathered_peak = _simulate(order, persistent, logits_grad, in_flight, root_prefetches=est is fs,
                                                backward_prefetch=est is fs or not hardware.shared_compute)
    # Time: compute at the profile's rate; communication overlapped with it (prefetch) except the first gather
    # and the last reduce; the optimizer reads and writes its states once (memory bound).
    flops = _flops_per_token(model, workload.seq_len) * tokens
    if workload.checkpointing:
        flops *= 4 / 3  # the checkpointed groups' forward again (nearly the whole model)
    compute = flops / hardware.flops_per_rank(compute_dtype, N)
    prefetching = any(g.prefetch > 0 for g in groups)
    for est, first, last in ((ve, first_gather, last_reduce), (fs, fs_first_gather, fs_last_reduce)):
        est.compute_seconds = compute
        comm = est.comm_seconds + est.copy_seconds
        # HSDP's AllReduces are waited for in backward: exposed whatever the prefetch.
        overlapped = comm - est.replicate_seconds
        est.exposed_comm_seconds = est.replicate_seconds + (
            (max(overlapped - compute, 0.0) + first + last) if prefetching else overlapped)
        moved = sum(est.off_device.values())  # stepped in memory too, once brought in
        est.optimizer_seconds = 4 * (est.params + est.grads + est.optimizer + moved) / hardware.memory_bandwidth
        est.step_seconds = compute + est.exposed_comm_seconds + est.optimizer_seconds
    if ve.peak > hardware.memory_bytes:
        out.notes.append(f"the predicted peak {ve.peak / 2**30:.1f} GiB exceeds the device memory "
                         f"{hardware.memory_bytes / 2**30:.0f} GiB of {hardware.name}")
    if ve.off_device:
        out.notes.append("the plan's tiers keep " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in
                         sorted(ve.off_device.items())) + " per rank off the device (the transfers' time and their "
                         "buffers in flight are not counted)")
    if workload.optimizer == "muon":
        out.notes.append("Muon's own collectives (matrices not whole on one rank) are not counted")
    if quantized:
        parts = [f"{_count(n)} elements {'trained, gathered' if k == 'quantized_gather' else 'frozen, stored'} "
                 f"as codes + scales" for k, n in sorted(quantized.items())]
        out.notes.append("block quantization: " + "; ".join(parts) + " (FSDP2 is sized without it: it has no "
                         "block-quantized gather or storage)")
    out.notes += block_padding_warnings(group_buffers)
    return out


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{int(n):,}"


def check_replicate(world_size: int, replicate: int) -> int:
    """``replicate`` if it divides ``world_size``; else a :class:`PlanError` saying what to give instead."""
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
        raise PlanError(f"replicate={replicate!r}: give the number of HSDP replicas, a positive int dividing the world "
                        f"size (replicate=1: a 1-D mesh)")
    if world_size % replicate:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        shown = ", ".join(map(str, divisors[:8])) + (", ..." if len(divisors) > 8 else "")
        raise PlanError(
            f"replicate={replicate} does not divide world_size={world_size}: HSDP shards each group over world_size / "
            f"replicate ranks, so give a replicate that divides every world size ({world_size}: {shown}), or "
            f"world sizes that are multiples of {replicate}")
    return replicate


def mesh_description(world_size: int, replicate: int, tensor_parallel: int = 1) -> str:
    """The mesh the dry run assumes, in words."""
    if tensor_parallel > 1:
        return f"2-D (dp={world_size // tensor_parallel}, tp={tensor_parallel})"
    if replicate == 1:
        return f"1-D (shard={world_size})"
    return f"2-D HSDP (replicate={replicate}, shard={world_size // replicate})"


def _hidden_size(model: nn.Module) -> int:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.embedding_dim if emb is not None else 0


def _vocab(model: nn.Module) -> int:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else 0
