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
under ``all_reduce_tp`` (see :mod:`._tensor_parallel`), exposed; with sequence parallelism its AllGathers and
ReduceScatters under ``all_gather_tp`` / ``reduce_scatter_tp``. With ``ep``, a ``(world_size / ep, ep)`` mesh: one ep
rank's model holds ``E / ep`` routed experts, whose groups are sharded over the dp ranks of its ep coordinate, the
others over all ranks; the all-to-alls of each MoE layer (``all_to_all_ep``, ``all_to_all_ep_counts``) are sized under
balanced routing, exposed. With ``ep`` and ``tp``, the ``(dp, ep, tp)`` mesh: attention split by the tp rules, the
``split_tokens`` feed-forwards on ``1 / tp`` of the tokens in groups over every rank, the experts over the ``dp x tp``
ranks of their ep coordinate, the rest over the ``dp x ep`` ranks of a tp coordinate.
With ``optimizer="muon"``, Muon's own two all-to-alls per step (``muon_gather``: each rank's pieces of the updates of
the matrices not whole on one rank to their owners; ``muon_scatter``: the orthogonalized pieces back) are sized
with Muon's own owner choice on the planner's pieces (:func:`muon_bucket_bytes`), per rank (``per_rank``; the
busiest rank's in ``collectives``); under tp, each tp-split matrix is gathered whole to one rank of the
``(dp, tp)`` mesh.
Block-quantized parameters (a plan's ``quantization``) get the engine's quantized buffers (:mod:`._layout`):
their AllGathers are counted under ``all_gather_quant_codes`` and ``all_gather_quant_scales``, as ``comm_stats``
counts them; FSDP2, which has no block-quantized gather or storage, is sized without the quantization.

[Note: one training step, as the engine runs it]
The order and the decisions are the engine's own schedule (``engine.schedule.StepSchedule``, built from the plan's
groups), whose events :func:`_simulate` walks, counting the bytes. Forward visits the groups in module order. A
group is gathered at its pre-forward (unless prefetched) and issues the AllGathers of the next ``prefetch`` groups (a plain buffer's unsharded parameters exist from the issue;
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

from lightning_vescale.engine.param_group import backward_reads_params
from lightning_vescale.engine.schedule import (
    GroupSettings,
    StepSchedule,
    default_backward_prefetch,
    default_reduces_in_flight,
    root_done_early,
)
from lightning_vescale.plan._activations import activation_profile
from lightning_vescale.plan._hardware import HardwareProfile
from lightning_vescale.plan._layout import BufferLayout, block_padding_warnings, group_layouts
from lightning_vescale.plan._resolve import GroupPolicy, ResolvedPlan
from lightning_vescale.plan._spec import PlanError
from lightning_vescale.plan._tensor_parallel import (
    check_expert_parallel_size,
    check_tensor_parallel_size,
    expert_groups,
    expert_parallel_bytes,
    expert_parallel_view,
    sequence_parallel,
    tensor_parallel_bytes,
    tensor_parallel_view,
    token_split_modules,
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
    tensor parallelism's under ``all_reduce_tp``, and with sequence parallelism ``all_gather_tp`` /
    ``reduce_scatter_tp``)."""
    calls: dict = field(default_factory=dict)
    """Collective calls per step, by kind."""
    per_rank: dict = field(default_factory=dict)
    """For the kinds whose bytes differ between ranks (Muon's ``muon_gather`` / ``muon_scatter``): bytes per step of
    every rank, by global rank; ``collectives`` holds the busiest rank's."""
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
    """Collectives nothing overlaps (part of ``comm_seconds``): HSDP's AllReduces across replicas, tensor
    parallelism's, Muon's all-to-alls in the optimizer step."""

    @property
    def bytes_per_step(self) -> float:
        return float(sum(self.collectives.values()))

    @property
    def all_gather_bytes(self) -> float:
        """The sharding's AllGather bytes per step, quantized ones included (not tensor parallelism's)."""
        return float(sum(v for k, v in self.collectives.items() if k.startswith("all_gather") and not k.endswith("_tp")))


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
    expert_parallel: int = 1
    """Expert-parallel ranks (1: none); the routed experts' groups are sharded over ``world_size // (tp * ep)``
    ranks, the others over ``world_size // tp``."""
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
# Muon's own collectives


def _piece_ranges(N: int, S: int, start: int, numel: int) -> list[tuple[int, int]]:
    """Per rank of a buffer of shard size ``S`` on ``N`` ranks, its range of ``[start, start + numel)``, relative to
    ``start`` (``(0, 0)``: none), as ``RaggedTensor.layout_info.ranges`` gives them to Muon."""
    ranges = [(0, 0)] * N
    for r in range(start // S, min((start + numel - 1) // S, N - 1) + 1):
        lo, hi = max(start, r * S), min(start + numel, (r + 1) * S)
        if hi > lo:
            ranges[r] = (lo - start, hi - start)
    return ranges


_MuonMatrix = tuple[str, tuple[int, int], list[tuple[int, int]]]
"""``(name, shape, ranges)``: a matrix Muon orthogonalizes whole, and per rank of its process group the flat part of
it that rank holds (:func:`_piece_ranges`; of its tp block for a tensor-parallel one)."""


def _muon_matrices(name: str, shape: tuple[int, ...], N: int, S: int, offset: int,
                   numel: int) -> list[_MuonMatrix]:
    """The Muon matrices of a parameter at ``offset`` of a buffer of shard size ``S`` on ``N`` ranks: itself (2-D),
    or each expert ``[e]`` of a 3-D stack. ``shape``: its whole shape (a tensor-parallel one's, which ``numel`` is
    ``1 / tp`` of: its ranges are then of its tp block)."""
    if len(shape) == 2:
        return [(name, (shape[0], shape[1]), _piece_ranges(N, S, offset, numel))]
    size = numel // shape[0]
    return [(f"{name}[{e}]", (shape[1], shape[2]), _piece_ranges(N, S, offset + e * size, size)) for e in range(shape[0])]


def muon_bucket_bytes(matrices: list[_MuonMatrix], world_size: int, *, tensor_parallel: bool = False,
                      initial_loads: Optional[list[float]] = None,
                      ns_steps: int = 5) -> tuple[list[float], list[float], list[float]]:
    """``(muon_gather, muon_scatter, loads)`` per rank of one process group: the bytes each rank sends in Muon's two
    all-to-alls per step (its update pieces to their owners; the orthogonalized pieces back to their holders) and
    the Newton–Schulz cost it carries. Paths and owners are Muon's own (``Muon._assign``, [Note: choosing the path]
    in :mod:`lightning_vescale.optim.muon`, ``mode="auto"`` with the default cost model): the local path where a
    matrix is whole on one rank, else gathered to an owner chosen by LPT; ``tensor_parallel``: the matrices split
    by tp, each gathered to one of the ranks of the ``(dp, tp)`` mesh holding a part of it, seeded with
    ``initial_loads`` (Note: Muon under tensor parallelism). The pieces travel in bf16."""
    from lightning_vescale.optim.muon import _WIRE_DTYPE, Muon, _Bucket, _Matrix
    from lightning_vescale.optim.owner import newton_schulz_cost

    muon = Muon([nn.Parameter(torch.zeros(1, 1))])  # for its owner choice and cost model only
    group = {"mode": "auto"}
    bucket = _Bucket(None, 0, world_size, torch.device("cpu"))
    for name, shape, ranges in matrices:
        holders = [r for r, (lo, hi) in enumerate(ranges) if hi > lo]
        holder = holders[0] if len(holders) == 1 and not tensor_parallel else -1
        blocks = (((0, 0), shape),) if tensor_parallel else None  # only "not None" matters to the owner choice
        bucket.matrices.append(_Matrix(name, 0, shape, newton_schulz_cost(shape, ns_steps), ranges, (0, 0), group,
                                       mode="gather" if tensor_parallel else "local", holder=holder, blocks=blocks))
    loads = muon._assign(bucket, initial_loads=initial_loads)
    item = _WIRE_DTYPE.itemsize
    gather, scatter = [0.0] * world_size, [0.0] * world_size
    for m in bucket.matrices:  # _assign kept the gathered ones
        for r, (lo, hi) in enumerate(m.ranges):
            if hi > lo and r != m.owner:
                gather[r] += (hi - lo) * item
                scatter[m.owner] += (hi - lo) * item
    return gather, scatter, loads


# --------------------------------------------------------------------------------------------------------
# One step


@dataclass
class _Group:
    """A group's bytes in one step; its part in the step's schedule is ``settings``."""

    settings: GroupSettings
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
    gathered_late: float = 0.0  # block-quantized buffers: unsharded bytes (part of ``gathered``) allocated only when
    # the gather is waited for (dequantized into), not when it is issued
    in_flight: float = 0.0  # block-quantized buffers: codes and scales alive from the gather's issue to its wait

    @property
    def name(self) -> str:
        return self.settings.name


def _backward_transient(g: _Group) -> float:
    """Gradients in flight inside one group's backward: about one group's activations (the gradient of each saved
    tensor is made and consumed while its neighbours are still alive), and a parameter's new gradient, which
    autograd makes whole before adding it into the gradient buffer's view."""
    return g.activations + g.recompute + g.largest_param


def _step_schedule(order: list[_Group], *, fsdp2: bool) -> StepSchedule:
    """The engine's schedule of one step over ``order`` (the groups in forward order); its backward order is the
    engine's (reverse post-forward order: a nested group's backward starts after its parent's and ends first)."""
    return StepSchedule([g.settings for g in order], roots_prefetch_backward=fsdp2)


def _simulate(schedule: StepSchedule, groups: dict[str, _Group], persistent: float,
              logits_grad: float) -> tuple[float, float]:
    """(peak bytes, peak gathered bytes) of one step, walking the schedule's events ([Note: one training step, as
    the engine runs it]; the decisions are the engine's own, see [Note: one schedule] in
    :mod:`lightning_vescale.engine.schedule`).

    ``groups``: each group's bytes by name; ``persistent``: bytes alive throughout (parameter pieces, states);
    ``logits_grad``: bytes of the loss's gradient over the vocabulary (fp32, every token).
    """
    gathered: dict[str, float] = {}
    activations = 0.0
    peak = peak_gathered = 0.0
    grad_buffers: dict[str, float] = {}
    pieces = 0.0  # sharded gradients of the groups reduced so far
    pending: dict[str, float] = {}  # gathers issued (prefetched) and not yet waited for: their codes and scales

    def note(extra: float = 0.0) -> None:
        nonlocal peak, peak_gathered
        g = sum(gathered.values())
        peak_gathered = max(peak_gathered, g)
        peak = max(peak, persistent + g + sum(grad_buffers.values()) + pieces + activations + sum(pending.values())
                   + extra)

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

    for event in schedule.events():
        kind = event.kind
        if kind == "loss_backward":
            # Backward starts at the loss: the gradients of the log-probabilities and of the logits, and one more
            # vocabulary-sized tensor the system holds there (measured, not identified: benchmarks/plan_check.py
            # puts the step's peak at this point since the head's gradient buffer comes with its gradient, 1
            # logits' size above two, at batch 2 and 4).
            note(3 * logits_grad)
            continue
        if kind == "root_grad_buffers":
            # The head's weight gradient is made while the logits' is alive; the roots' gradient buffers come with
            # it (lightning-vescale allocates a group's at its first gradient; FSDP2 has none before), the logits'
            # gone.
            roots = [groups[n] for n in event.groups]
            largest = max((r.largest_param for r in roots), default=0.0)
            note(logits_grad + largest)
            for root in roots:
                grad_buffers[root.name] = root.grad
            note(largest)
            continue
        g = groups[event.groups[0]]
        if kind == "gather":
            gather(g)
        elif kind == "prefetch":
            issue(g)
        elif kind == "forward":
            activations += g.activations
            note()
        elif kind == "free":
            gathered.pop(g.name, None)
        elif kind == "grad_buffer":
            grad_buffers[g.name] = g.grad
        elif kind == "backward":
            note(_backward_transient(g))
        elif kind == "backward_done":
            activations -= g.activations
            gathered.pop(g.name, None)
        elif kind == "reduce":
            pieces += g.grad_piece
            if g.grad:
                grad_buffers[g.name] = g.grad + g.reduce_extra
                note(g.reduce_transient)
        elif kind == "reduce_done":
            grad_buffers.pop(g.name, None)
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
    gradients are complete as soon as backward has passed the head (:func:`root_done_early`, as the engine)."""
    modules = [name for name, _ in model.named_modules(remove_duplicate=False)]
    inner = [g.name for g in groups if not g.is_root]
    return {g.name for g in groups
            if g.is_root and root_done_early(modules, inner, [p.rpartition(".")[0] for p in g.params])}


def _matmul_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 per matmul weight element a token meets (routed experts: only the
    chosen ``top_k``; a tied output head: the embedding), plus attention's ``6 * T * H * K`` per layer (causal:
    half of ``12``)."""
    from lightning_vescale.models.llama import TiedOutput
    from lightning_vescale.models.moe import MoEFeedForward

    split, tp = token_split_modules(model), getattr(model, "_vescale_tp_local", 1)
    weights = 0.0
    for name, m in model.named_modules():
        tokens = 1 / tp if any(name == t or name.startswith(t + ".") for t in split) else 1  # split_tokens: 1/tp
        if isinstance(m, nn.Linear):
            weights += m.weight.numel() * tokens
        elif isinstance(m, MoEFeedForward):  # top_k experts' weights per token (an ep rank's share of them: its own)
            share = m.router.top_k / m.experts.w1_EDF.shape[0]
            weights += sum(p.numel() for p in m.experts.parameters()) * share * tokens
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
    expert_parallel: int = 1,
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
        expert_parallel: a ``(world_size // ep, ep)`` mesh (``("dp", "ep")``): every routed expert stack keeps
            ``E / ep`` experts and its group is sharded over the ``world_size // ep`` dp ranks, every other group over
            all ranks; the all-to-alls of each MoE layer are sized under balanced routing
            (:func:`~lightning_vescale.plan._tensor_parallel.expert_parallel_view`, ``expert_parallel_bytes``).

    Raises:
        PlanError: ``replicate`` does not divide ``world_size``.
    """
    R = check_replicate(world_size, replicate)
    TP = check_tensor_parallel_size(world_size, R, tensor_parallel)
    EP = check_expert_parallel_size(world_size, R, TP, expert_parallel)
    fresh = False  # whether model is a view made here (that the expert-parallel view may change in place)
    if TP > 1 and getattr(model, "_vescale_tp_local", 1) != TP:
        model, resolved = tensor_parallel_view(model, resolved, TP)
        fresh = True
    if EP > 1 and getattr(model, "_vescale_ep_local", 1) != EP:
        model, resolved = expert_parallel_view(model, resolved, EP, copy_model=not fresh)
    N = world_size // (R * TP)  # the shard group's ranks: every per-rank figure below is on them
    experts = expert_groups(model)  # sharded over the N // EP dp ranks of their ep coordinate
    param_dtype, reduce_dtype = PRECISIONS[workload.precision]
    groups = _forward_order(model, resolved)
    compute_dtype = param_dtype or next(model.parameters()).dtype
    if activations is None:
        activations = activation_profile(model, [g.name for g in groups], compute_dtype=compute_dtype,
                                         sequence_parallel=sequence_parallel(model))
    tokens = workload.tokens
    hidden = _hidden_size(model) * compute_dtype.itemsize
    out = DryRun(model=resolved.model_type, plan=resolved.plan.name or "unnamed", world_size=world_size,
                 workload=workload, hardware=hardware.name, num_params=getattr(model, "_vescale_global_numel", sum(p.numel for p in resolved.params.values())),
                 replicate=R, tensor_parallel=TP, expert_parallel=EP, mesh=mesh_description(world_size, R, TP, EP))
    # HSDP's replicas: rank i of every shard group; they span every node once the shard group fills one.
    t_replicate = functools.partial(hardware.all_reduce_seconds, world_size=R, span=world_size)
    ve, fs = out.vescale, out.fsdp2
    ve.collectives.update(all_gather=0, reduce_scatter=0)
    ve_groups, fs_groups = [], []
    L = N * TP  # the ranks of one replica: the (dp, ep, tp) / (dp, tp) / (dp, ep) mesh's, global rank order
    state_per_rank = torch.zeros(L, dtype=torch.float64)  # on the device
    token_split = token_split_modules(model)  # groups of their own over all L ranks (tp: split_tokens)
    ranks = torch.arange(L)
    # For each group's mesh, the index of global rank g in it (tp the fastest dimension, then ep): the dense groups'
    # (dp * ep) ranks of g's tp coordinate, the experts' (dp * tp) ranks of g's ep coordinate, or every rank.
    rank_in = {"dense": ranks // TP, "experts": (ranks // (EP * TP)) * TP + ranks % TP, "every": ranks}
    clip_ranks: dict[str, int] = {}  # the ranks a parameter's norm is summed over
    states_off: dict[str, torch.Tensor] = {}  # tier -> per rank, a plan's states off the device

    def tier(name: str, cls: str) -> str:
        """Where a plan puts ``cls`` of parameter ``name``: ``device`` unless off the device's memory."""
        t = resolved.params[name].tier_of(cls) or "device"
        return "device" if t == "host" and hardware.shared_compute else t

    def add_off(cls: str, t: str, nbytes: float) -> None:
        ve.off_device[f"{cls}/{t}"] = ve.off_device.get(f"{cls}/{t}", 0.0) + nbytes

    per_rank_cache: dict[tuple, torch.Tensor] = {}
    muon_matrices: dict[str, list[_MuonMatrix]] = {"dp": [], "tp": []}  # by process group (Muon's buckets)
    tp_split: dict[str, tuple[int, ...]] = getattr(model, "_vescale_tp_split", {})
    total_real = total_padding = fs_padding = 0.0
    fs_state = fs_params = 0.0
    first_gather = last_reduce = fs_first_gather = fs_last_reduce = 0.0
    ag_calls: dict[str, int] = {}
    rs_calls = ar_calls = 0
    quantized: dict[str, int] = {}
    group_buffers: list[tuple[str, list[BufferLayout]]] = []
    early = _roots_done_early(model, groups)
    # The engine's defaults on the profile's device: CPU's where the ranks share the cores that compute.
    engine_device = torch.device("cpu") if hardware.shared_compute else torch.device("cuda")
    modules = dict(model.named_modules(remove_duplicate=False))
    for g in groups:
        inside_split = any(g.name == t or g.name.startswith(t + ".") for t in token_split)
        mesh_of = "experts" if g.name in experts else "every" if inside_split else "dense"
        Ng = {"experts": L // EP, "every": L, "dense": N}[mesh_of]  # this group's shard ranks
        clip_ranks.update(dict.fromkeys(g.params, L if g.name in experts or inside_split else N))
        layouts = group_layouts(resolved, g, Ng, base_param_dtype=param_dtype, base_reduce_dtype=reduce_dtype)
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
                grad += Ng * S * pb
                if lay.reduce_dtype != lay.param_dtype:
                    extra += Ng * S * rb
                if Ng > 1:
                    rs += (Ng - 1) * S * rb
                    rs_calls += 1
                if R > 1:  # DBuffer.wait_reduce: one AllReduce of the reduced piece (reduce dtype) per buffer
                    ar += 2 * (R - 1) * S * rb // R
                    ar_calls += 1
            if lay.quant == "quantized_storage":
                continue  # frozen: no optimizer states
            if workload.optimizer == "muon" and lay.requires_grad:
                for name, spec, off in zip(names, lay.plan.specs, lay.plan.offsets):
                    if resolved.params[name].optimizer == "muon" and spec.numel and Ng == N:
                        muon_matrices["tp" if name in tp_split else "dp"] += _muon_matrices(
                            name, tp_split.get(name, tuple(spec.shape)), Ng, S, off, spec.numel)
            routes = [resolved.params[n].optimizer for n in names]
            where = [tier(n, "optimizer_states") for n in names]
            for t in sorted(set(where)):
                weights = tuple(_state_bytes(workload.optimizer, r, resolved.params[n].numel, mb) if w == t else 0
                                for n, r, w in zip(names, routes, where))
                key = (id(lay.plan), weights)  # identical groups share one BufferPlan (the planner's cache)
                if key not in per_rank_cache:
                    per_rank_cache[key] = _per_rank_state_elements(lay, list(weights))
                on_ranks = per_rank_cache[key][rank_in[mesh_of]]
                if t == "device":
                    state_per_rank += on_ranks
                else:
                    states_off[t] = states_off.get(t, torch.zeros(L, dtype=torch.float64)) + on_ranks
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
        ve_settings = GroupSettings(g.name, is_root=g.is_root, reshard_after_forward=g.reshard_after_forward,
                                    prefetch=g.prefetch, backward_prefetch=default_backward_prefetch(engine_device),
                                    backward_reads_params=reads, done_early=g.name in early, reduces=bool(grad),
                                    reduces_in_flight=default_reduces_in_flight(engine_device))
        ve_groups.append(_Group(ve_settings, gathered, grad, extra, act, largest_bytes, recompute, gathered_late=late,
                                in_flight=transient, grad_piece=grad_piece, reduce_transient=reorder))
        t_ag = hardware.collective_seconds(ag / max(gathers, 1), Ng)
        t_rs = hardware.collective_seconds(rs, Ng)
        t_ar = t_replicate(ar) if ar else 0.0
        ve.comm_seconds += gathers * t_ag + t_rs + t_ar
        ve.replicate_seconds += t_ar
        first_gather = first_gather or t_ag
        last_reduce = t_rs or last_reduce
        # FSDP2: every parameter cut by rows into Ng equal pieces (dim 0 padded to a multiple of Ng).
        f_shard = f_gathered = f_grad = f_ag = f_rs = f_ar = f_real = f_elems = f_rs_input = f_piece = 0.0
        for name in g.params:
            p = resolved.params[name]
            dtype = getattr(torch, p.dtype)
            rows = p.shape[0] if p.shape else 1
            rest = p.numel // max(rows, 1) if rows else 0
            piece = -(-rows // Ng) * rest
            floating = dtype.is_floating_point
            mb = dtype.itemsize
            pb = (param_dtype if floating and param_dtype is not None else dtype).itemsize
            rb = (reduce_dtype if floating and reduce_dtype is not None else param_dtype if floating and param_dtype
                  else dtype).itemsize
            f_elems += Ng * piece
            f_shard += piece * mb
            f_gathered += Ng * piece * pb
            f_real += p.numel
            fs_state += _state_bytes(workload.optimizer, p.optimizer, p.numel, mb) * piece
            if p.requires_grad:
                f_grad += Ng * piece * pb
                f_rs_input += Ng * piece * rb
                fs.grads += piece * mb
                f_piece += piece * mb
                f_rs += (Ng - 1) * piece * rb if Ng > 1 else 0
                f_ar += 2 * (R - 1) * piece * rb / R  # FSDP2's HSDP: one AllReduce of the group's reduced pieces
            f_ag += gathers * (Ng - 1) * piece * pb if Ng > 1 else 0
        fs_params += f_shard
        fs_padding += f_elems - f_real
        fs.collectives["all_gather"] = fs.collectives.get("all_gather", 0) + f_ag
        fs.collectives["reduce_scatter"] = fs.collectives.get("reduce_scatter", 0) + f_rs
        if R > 1:
            fs.collectives["all_reduce_replicate"] = fs.collectives.get("all_reduce_replicate", 0) + f_ar
        # FSDP2 copies the gradients into a ReduceScatter input (in the reduce dtype) and frees them: the input
        # replaces them until the ReduceScatter completes, and both live during the copy.
        # FSDP2's schedule: every group prefetches in backward (its root too), reduces as ours do.
        fs_settings = GroupSettings(g.name, is_root=g.is_root, reshard_after_forward=g.reshard_after_forward and reads,
                                    prefetch=g.prefetch, done_early=g.name in early, reduces=bool(f_grad),
                                    reduces_in_flight=default_reduces_in_flight(engine_device))
        fs_groups.append(_Group(fs_settings, f_gathered, f_grad, f_rs_input - f_grad, act, largest_bytes, recompute,
                                gather_transient=f_gathered, reduce_transient=f_grad, grad_piece=f_piece))
        ft_ag = hardware.collective_seconds(f_ag / max(gathers, 1), Ng)
        ft_rs = hardware.collective_seconds(f_rs, Ng)
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
    if TP > 1:  # torch's tensor-parallel collectives: on the critical path (nothing overlaps them)
        checkpointed = frozenset(g.name for g in groups if workload.checkpointing and not g.is_root)
        tp_bytes, tp_calls = tensor_parallel_bytes(model, resolved.tensor_parallel, TP, tokens,
                                                   compute_dtype.itemsize, checkpointed)
        t_tp = 0.0
        for kind, nbytes in tp_bytes.items():
            n = tp_calls[kind]
            t_tp += n * (hardware.all_reduce_seconds(nbytes / n, world_size=TP, span=TP) if kind == "all_reduce_tp"
                         else hardware.collective_seconds(nbytes / n, TP))
        for est in (ve, fs):
            est.collectives.update(tp_bytes)
            est.calls.update(tp_calls)
            est.comm_seconds += t_tp
            est.replicate_seconds += t_tp  # exposed, as HSDP's AllReduce
    if EP > 1:  # the all-to-alls of every MoE layer: on the critical path (the experts wait for their rows)
        checkpointed = frozenset(g.name for g in groups if workload.checkpointing and not g.is_root)
        ep_bytes, ep_calls = expert_parallel_bytes(model, EP, tokens, compute_dtype.itemsize, checkpointed, TP)
        t_ep = sum(ep_calls[k] * hardware.collective_seconds(v / max(ep_calls[k], 1), EP) for k, v in ep_bytes.items())
        for est in (ve, fs):
            est.collectives.update(ep_bytes)
            est.calls.update(ep_calls)
            est.comm_seconds += t_ep
            est.replicate_seconds += t_ep
        out.notes.append(f"expert parallelism: the all-to-alls (all_to_all_ep) assume balanced routing (each of the "
                         f"{EP} ep ranks' experts gets 1/{EP} of every rank's routed rows, so {EP - 1}/{EP} of them "
                         f"leave it); a real run's routing is uneven and its bytes (and the experts' activations and "
                         f"FLOPs on the busiest rank) higher")
    if workload.clip_grad:
        # clip_grad_norm_'s norms: one AllReduce of the squared norms per set of groups the gradients are laid out
        # over (RaggedTensor's _foreach_norm): the dense ones' shard group (the replicas hold the same reduced
        # gradients), every rank for the experts (their norm group) and the split_tokens groups, and the tp group
        # too for the parameters tp splits.
        norm_sets: dict[tuple[int, bool], int] = {}
        for name, p in resolved.params.items():
            if p.requires_grad:
                norm_key = (clip_ranks.get(name, N), name in tp_split and TP > 1)
                norm_sets[norm_key] = norm_sets.get(norm_key, 0) + 1
        clip_sent = clip_calls = 0
        for (ranks_, split_), count in norm_sets.items():
            for size in (ranks_, TP if split_ else 1):
                if size > 1:
                    clip_sent += 2 * (size - 1) * count * 4 // size  # comm_stats' count of each AllReduce
                    clip_calls += 1
        if clip_calls:
            ve.collectives["all_reduce_ragged"] = clip_sent
            ve.calls["all_reduce_ragged"] = clip_calls
    if workload.optimizer == "muon":
        param_order = {n: i for i, (n, _) in enumerate(model.named_parameters())}  # the optimizer's order of matrices
        for entries in muon_matrices.values():
            entries.sort(key=lambda m: (param_order.get(m[0].partition("[")[0], -1), m[0]))
        gather, scatter, loads = muon_bucket_bytes(muon_matrices["dp"], N)
        muon_per_rank = {"muon_gather": [gather[q // TP] for q in range(L)],
                         "muon_scatter": [scatter[q // TP] for q in range(L)]}
        muon_calls = int(any(gather))
        if muon_matrices["tp"]:  # one (dp, tp) mesh: global rank q is dp rank q // TP's piece of tp block q % TP
            tp_matrices = [(n, shape, [r for r in ranges for _ in range(TP)]) for n, shape, ranges in muon_matrices["tp"]]
            # Each rank seeds the owner choice with its own load from the other buckets, rounded (as it sends it).
            tp_gather, tp_scatter, _ = muon_bucket_bytes(tp_matrices, L, tensor_parallel=True,
                                                         initial_loads=[float(round(loads[q // TP])) for q in range(L)])
            muon_per_rank = {"muon_gather": [a + b for a, b in zip(muon_per_rank["muon_gather"], tp_gather)],
                             "muon_scatter": [a + b for a, b in zip(muon_per_rank["muon_scatter"], tp_scatter)]}
            muon_calls += int(any(tp_gather))
        ve.per_rank.update(muon_per_rank)  # zeros where every matrix is whole on its owner (the local path)
        if muon_calls:
            t_muon = 0.0
            for kind, rank_bytes in muon_per_rank.items():
                ve.collectives[kind] = max(rank_bytes)
                ve.calls[kind] = muon_calls
                t_muon += hardware.collective_seconds(max(rank_bytes), L)
            ve.comm_seconds += t_muon
            ve.replicate_seconds += t_muon  # in the optimizer step: nothing overlaps it
    ve.optimizer = float(state_per_rank.max()) if N else 0.0
    for t, per_rank in states_off.items():
        add_off("optimizer_states", t, float(per_rank.max()))
    fs.params, fs.optimizer = fs_params, fs_state
    ve.padding = total_padding / max(total_real, 1)
    fs.padding = fs_padding / max(total_real, 1)
    logits_grad = tokens * _vocab(model) * 4
    for est, order in ((ve, ve_groups), (fs, fs_groups)):
        est.activations = sum(g.activations for g in order)
        persistent = est.params + est.optimizer  # gradient pieces: allocated group by group in backward
        est.peak, est.gathered_peak = _simulate(_step_schedule(order, fsdp2=est is fs), {g.name: g for g in order},
                                                persistent, logits_grad)
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
    if workload.optimizer == "muon" and (EP > 1 or token_split):
        out.notes.append("Muon's all-to-alls of the matrices in groups sharded over other ranks than the dense ones "
                         "(expert stacks under ep, split_tokens modules under tp) are not counted")
    if "muon_gather" in ve.collectives:
        out.notes.append("Muon's all-to-alls (muon_gather / muon_scatter): the busiest rank's bytes, with Muon's "
                         "defaults (mode='auto', 5 Newton-Schulz steps); FSDP2 is sized without Muon's gathers")
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


def mesh_description(world_size: int, replicate: int, tensor_parallel: int = 1, expert_parallel: int = 1) -> str:
    """The mesh the dry run assumes, in words."""
    if expert_parallel > 1:
        dp = world_size // (tensor_parallel * expert_parallel)
        return (f"3-D (dp={dp}, ep={expert_parallel}, tp={tensor_parallel})" if tensor_parallel > 1
                else f"2-D (dp={dp}, ep={expert_parallel})")
    if tensor_parallel > 1:
        return f"2-D (dp={world_size // tensor_parallel}, tp={tensor_parallel})"
    if replicate == 1:
        return f"1-D (shard={world_size})"
    return f"2-D HSDP (replicate={replicate}, shard={world_size // replicate})"


def _hidden_size(model: nn.Module) -> int:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.embedding_dim if emb is not None else 0


def _vocab(model: nn.Module) -> int:
    vocab = getattr(model, "_vescale_vocab", None)  # a tensor-parallel rank's model: the whole vocabulary's logits
    if isinstance(vocab, int):
        return vocab
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else 0
