"""Muon on RaggedShard: momentum on local pieces, Newton–Schulz on whole matrices at one owner rank.

[Note: sharded Muon]
``torch.optim.Muon`` does, per 2-D parameter: ``buf.lerp_(g, 1 - mu)``; ``u = g.lerp(buf, mu)`` (Nesterov)
or ``buf``; ``O = NS(u)`` (Newton–Schulz in bf16, :func:`torch.optim._muon._zeropower_via_newtonschulz`);
``p.mul_(1 - lr * wd)``; ``p.add_(O, alpha=-adjust_lr(lr, shape))``. Everything but ``NS`` is elementwise,
so it runs on the local piece ``p.to_local()`` that ``fully_shard`` leaves on each rank (the
momentum buffer exists only for that piece, invariant 3). ``NS`` needs the whole matrix, on one rank —
its *owner*. Each matrix (each 2-D parameter, and each ``[e]`` slice of a declared 3-D expert stack)
takes one of two paths:

* **local**: the planner put the whole matrix on one rank (granularity ``"matrix"``: a whole 2-D matrix,
  each expert of a stack whole, see :func:`lightning_vescale.optim.muon_granularity`). That rank is the
  owner and runs ``NS`` on its piece with no communication at all.
* **gather**: the matrix is split over ranks (or moved for balance). Its owner is chosen by
  longest-processing-time-first on Newton–Schulz cost (:mod:`lightning_vescale.optim.owner`), every
  rank sends its pieces of the updates ``u`` to their owners, the owners run ``NS`` and send each rank
  its piece of ``O`` back. All gather-path matrices of a process group move in **one**
  ``all_to_all_single`` there and **one** back per step, and the local-path ``NS`` runs while the first
  one is in flight.

The pieces travel in bf16: torch's ``NS`` begins with ``u.bfloat16()`` and returns bf16, so casting the
pieces before sending them changes no bit of the result and halves the bytes. Each ``NS`` sees exactly
the matrix ``torch.optim.Muon`` would see and each elementwise op the same operands, so on CPU fp32 the
result is bitwise equal to ``torch.optim.Muon`` on the unsharded parameters given the same gradients.

Per rank and step, the gather path sends about ``2 · 2 B · Ψ (N - 1) / N²`` for ``Ψ`` elements of split
matrices (there and back, bf16), against ``4 B · Ψ (N - 1) / N`` when every rank gathers every fp32
matrix (FSDP2 ``full_tensor``): a ``1/N`` fraction.

[Note: choosing the path]
``mode="local"`` requires every matrix to be whole on one rank (else a ``ValueError`` names it);
``mode="gather"`` sends every matrix to an LPT-chosen owner (even one already whole on some rank);
``mode="auto"`` (default) takes the local path where it can, gathers split matrices to the least loaded
ranks (LPT seeded with the local work), then, with :class:`MuonCostModel`'s time estimate
``NS flops / flops_per_second + bytes / bytes_per_second`` per rank, moves a whole matrix off the
most loaded rank to the least loaded one while that lowers the estimated step time.

.. note::
    Every rank must step the same parameters (a parameter's ``.grad`` is set on all ranks of its shard
    group or on none, as ``fully_shard`` does). The first step checks that all ranks built the same plan.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence, TypeGuard, get_args

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)
from torch.optim.optimizer import Optimizer, ParamsT, _to_scalar

from lightning_vescale.engine import collectives
from lightning_vescale.engine.process_groups import ranks_process_group
from lightning_vescale.engine.tensor import OuterShard, RaggedLayout, RaggedTensor, is_ragged, local_tensor
from lightning_vescale.optim.owner import assign_owners, newton_schulz_cost

logger = logging.getLogger(__name__)

__all__ = ["ADJUST_LR_FNS", "MODES", "Muon", "MuonCostModel", "Mode"]

Mode = Literal["auto", "local", "gather"]
MODES: tuple[str, ...] = get_args(Mode)
"""Values of ``mode`` (see [Note: choosing the path])."""
ADJUST_LR_FNS: tuple[str, ...] = ("original", "match_rms_adamw")
"""Values of ``adjust_lr_fn`` besides ``None`` (``torch.optim.Muon``'s)."""
_WIRE_DTYPE = torch.bfloat16
"""dtype of the pieces on the wire: torch's Newton–Schulz casts its input to it first and returns it."""
_STATE_KEYS_SHAPED_LIKE_PARAM = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@dataclass(frozen=True)
class MuonCostModel:
    """Time estimate that ``mode="auto"`` uses to decide whether moving a whole matrix pays off.

    A rank's step time is its Newton–Schulz flops (``2 · newton_schulz_cost``) over
    ``flops_per_second`` plus the bytes it sends and receives over ``bytes_per_second``.
    The defaults are of the order of one Hopper GPU (bf16 matmul) and its NVLink share.
    """

    flops_per_second: float = 4e14
    """Sustained bf16 matmul throughput of one rank."""
    bytes_per_second: float = 1e11
    """Bytes per second one rank moves in an all-to-all (counting sent plus received)."""

    def __post_init__(self) -> None:
        if not (self.flops_per_second > 0 and self.bytes_per_second > 0):
            raise ValueError(f"MuonCostModel rates must be positive, got {self}")

    def ns_seconds(self, cost: float) -> float:
        return 2.0 * cost / self.flops_per_second

    def move_seconds(self, numel: int) -> float:
        """Seconds to send ``numel`` wire elements one way (the update comes back the same size)."""
        return numel * _WIRE_DTYPE.itemsize / self.bytes_per_second


# --------------------------------------------------------------------------------------------------------
# The plan: which matrices, where their pieces are, who orthogonalizes them


@dataclass
class _Matrix:
    """One matrix Newton–Schulz orthogonalizes whole: a 2-D parameter or one expert of a stack."""

    name: str
    slot: int
    """Index of its parameter in the step's list of parameters."""
    shape: tuple[int, int]
    cost: float
    ranges: list[tuple[int, int]]
    """Per rank of the bucket, the matrix-relative flat range it holds; they tile ``[0, numel)`` in order."""
    local: tuple[int, int]
    """This rank's part as a range of its flat local piece of the parameter (empty: ``lo == hi``)."""
    group: dict = field(repr=False)
    """The optimizer param group (hyperparameters are read at each step)."""
    mode: str = "local"
    """"local" (owner holds it whole), "gather" (sent to the owner), "replicated" (every rank holds it)."""
    owner: int = 0
    holder: int = -1
    """The rank holding the whole matrix, or -1 when it is split."""
    blocks: Optional[tuple[tuple[tuple[int, int], tuple[int, int]], ...]] = None
    """Tensor parallelism: the ``((row, col) offset, (rows, cols))`` of each tp-local piece the matrix is split into;
    ``ranges[r]`` is then a range of the flat elements of block ``block_of[r]``. None: of the matrix's."""
    block_of: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def assemble(self, parts: Sequence[Tensor]) -> Tensor:
        """The whole matrix from ``parts[r]``, rank ``r``'s flat part (of ``ranges[r]``)."""
        if self.blocks is None:
            return torch.cat(list(parts)).view(self.shape)  # the ranges tile the matrix in rank order
        full = parts[0].new_empty(self.shape)
        for b, ((row, col), (rows, cols)) in enumerate(self.blocks):
            ranks = sorted((r for r in range(len(parts)) if self.block_of[r] == b), key=lambda r: self.ranges[r])
            full[row : row + rows, col : col + cols] = torch.cat([parts[r] for r in ranks]).view(rows, cols)
        return full

    def parts(self, full: Tensor) -> list[Tensor]:
        """Per rank ``r``, its flat part (of ``ranges[r]``) of the whole matrix ``full``: :meth:`assemble` undone."""
        if self.blocks is None:
            flat = full.reshape(-1)
            return [flat[lo:hi] for lo, hi in self.ranges]
        flats = [full[row : row + rows, col : col + cols].reshape(-1) for (row, col), (rows, cols) in self.blocks]
        return [flats[b][lo:hi] for b, (lo, hi) in zip(self.block_of, self.ranges)]


@dataclass
class _Bucket:
    """The gather-path matrices of one shard process group, laid out for the two all-to-alls."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    device: torch.device
    matrices: list[_Matrix] = field(default_factory=list)
    # Filled by _layout():
    send_splits: list[int] = field(default_factory=list)  # gather: elements this rank sends to each owner
    recv_splits: list[int] = field(default_factory=list)  # gather: elements this rank receives from each rank
    send_offset: dict = field(default_factory=dict)  # id(matrix) -> offset of this rank's part in the send buffer
    recv_offsets: dict = field(default_factory=dict)  # id(matrix) -> [offset of rank r's part] (owned only)
    owned: list[_Matrix] = field(default_factory=list)

    def layout(self) -> None:
        N, me = self.world_size, self.rank
        by_owner: dict[int, list[_Matrix]] = defaultdict(list)
        for m in self.matrices:
            by_owner[m.owner].append(m)
        self.send_splits, pos = [], 0
        for o in range(N):
            start = pos
            for m in by_owner[o]:
                lo, hi = m.ranges[me]
                self.send_offset[id(m)] = pos
                pos += hi - lo
            self.send_splits.append(pos - start)
        self.owned = by_owner[me]
        self.recv_splits, pos = [], 0
        for r in range(N):
            start = pos
            for m in self.owned:
                lo, hi = m.ranges[r]
                self.recv_offsets.setdefault(id(m), [0] * N)[r] = pos
                pos += hi - lo
            self.recv_splits.append(pos - start)

    def bytes_sent(self) -> tuple[int, int]:
        """Bytes this rank sends to other ranks in each of the two all-to-alls (gather, scatter)."""
        item = _WIRE_DTYPE.itemsize
        gather = (sum(self.send_splits) - self.send_splits[self.rank]) * item
        scatter = (sum(self.recv_splits) - self.recv_splits[self.rank]) * item
        return gather, scatter


@dataclass
class _Plan:
    matrices: list[_Matrix]
    buckets: list[_Bucket]
    loads: dict
    """Per bucket (by index), the Newton–Schulz cost each rank carries."""


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else (0, 0)


def _matrix_ranges(p: RaggedTensor, start: int, numel: int) -> list[tuple[int, int]]:
    """Per rank, the part of the matrix ``[start, start + numel)`` of sharded ``p`` it holds, matrix-relative."""
    pieces = p.layout_info.ranges
    return [
        (lo - start, hi - start) if hi > lo else (0, 0)
        for lo, hi in (_intersect(pc, (start, start + numel)) for pc in pieces)
    ]


def _is_sharded(p: Tensor) -> TypeGuard[RaggedTensor]:
    return is_ragged(p)


def _layout_of(p: Tensor) -> RaggedLayout:
    """The layout of sharded ``p``."""
    assert isinstance(p, RaggedTensor), f"a sharded parameter is a RaggedTensor, got {type(p).__name__}"
    return p.layout_info


def _tp_outer(p: Tensor) -> Optional[OuterShard]:
    """How tensor parallelism splits sharded ``p`` over more than one tp rank; None if it does not (not sharded, no
    tensor parallelism, or ``Replicate()`` on tp)."""
    if not is_ragged(p):
        return None
    outer = _layout_of(p).outer
    return outer if outer is not None and outer.is_sharded and outer.mesh.size() > 1 else None


def _tp_split(p: Tensor) -> bool:
    """Whether tensor parallelism splits sharded ``p`` over more than one tp rank (not a ``Replicate()`` on tp)."""
    return _tp_outer(p) is not None


def _mesh_ranks(p: Tensor) -> list[int]:
    """The global ranks of the ``(dp, tp)`` mesh a tensor-parallel sharded ``p`` lies on, sorted."""
    layout, outer = _layout_of(p), _tp_outer(p)
    assert outer is not None
    mesh = layout.mesh if layout.mesh is not None else outer.mesh
    return sorted(int(r) for r in mesh.mesh.flatten().tolist())


def _local(t: Tensor) -> Tensor:
    """The piece this rank holds of a sharded tensor; a plain tensor itself."""
    return local_tensor(t)


def global_shape(p: Tensor) -> torch.Size:
    """The unsharded shape of ``p`` (a sharded parameter reports it as its ``shape``)."""
    return p.shape


def is_expert_stack(name: str, p: Tensor, expert_patterns: Sequence[str]) -> bool:
    """Whether a 3-D parameter is a stack of expert matrices (``p._vescale_expert_stack`` or a name pattern)."""
    if getattr(p, "_vescale_expert_stack", False):
        return True
    return any(fnmatch.fnmatchcase(name, pat) for pat in expert_patterns)


# --------------------------------------------------------------------------------------------------------
# The optimizer


class Muon(Optimizer):
    """``torch.optim.Muon`` for parameters sharded by :func:`lightning_vescale.fully_shard`.

    Same hyperparameters and numerics as ``torch.optim.Muon`` (its Newton–Schulz and learning-rate
    adjustment functions are called, not copied); see [Note: sharded Muon] at the top of this module
    for how the whole matrices reach one owner rank. Plain (unsharded, replicated) tensors are also
    accepted: every rank then orthogonalizes them itself, as ``torch.optim.Muon`` would.

    Args:
        params: parameters or ``(name, parameter)`` pairs (e.g. ``model.named_parameters()`` filtered to
            the matrices), or param groups. Names make errors and ``expert_patterns`` readable; without
            them a sharded parameter is known by its name inside its ``fully_shard`` module.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            ``torch.optim.Muon`` (weight decay uses the unadjusted ``lr``).
        mode: ``"auto"`` (default), ``"local"`` or ``"gather"``; per param group. See [Note: choosing
            the path].
        expert_patterns: name glob patterns of 3-D parameters that are stacks of expert matrices
            (``[e]`` is matrix ``e``); ``p._vescale_expert_stack = True`` on the (sharded) parameter
            declares one too.
        cost_model: the time estimate of ``mode="auto"``.

    .. note::
        A 1-D tensor, or a 3-D tensor not declared an expert stack, raises ``ValueError`` naming it: route
        it to AdamW (``lightning_vescale.optim.build_optimizer`` does so by default; ``adamw_patterns`` /
        ``muon_patterns`` / ``expert_patterns`` override its routing).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: Optional[str] = None,
        *,
        mode: Mode = "auto",
        expert_patterns: Sequence[str] = (),
        cost_model: Optional[MuonCostModel] = None,
        _extra_defaults: Optional[dict] = None,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not lr >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "mode": mode,
        }
        defaults.update(_extra_defaults or {})
        self.expert_patterns = tuple(expert_patterns)
        self.cost_model = cost_model or MuonCostModel()
        self._plan: Optional[_Plan] = None
        self._plan_key: Optional[tuple] = None
        super().__init__(params, defaults)  # validates each group in add_param_group

    # -- which groups and names -------------------------------------------------------------------------
    def _is_muon_group(self, group: dict) -> bool:
        """Whether Muon steps this group (all groups here; a subclass may step others differently)."""
        return True

    def _muon_groups(self) -> list[dict]:
        return [g for g in self.param_groups if self._is_muon_group(g)]

    def add_param_group(self, param_group: dict) -> None:
        """``Optimizer.add_param_group``, then reject what Muon cannot orthogonalize, naming it."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if not self._is_muon_group(group):
            return
        if group["mode"] not in MODES:
            raise ValueError(f"Muon mode must be one of {MODES}, got {group['mode']!r}")
        for p, name in zip(group["params"], self._names(group)):
            if is_ragged(p) and p.layout_info.order is not None:
                raise ValueError(
                    f"Muon cannot step {name}: its sharded master is stored tile-major (a quantized AllGather, "
                    f"quantize_all_gather(..., layout='block_major'), at element or row granularity), so its pieces "
                    f"are not row-major ranges of the matrix. Shard it with granularity 'matrix' (fully_shard(..., "
                    f"granularity=muon_granularity(model)): each matrix whole and row-major on its owner), use "
                    f"quantize_all_gather(..., layout='bands'), or give it to AdamW."
                )
            outer = _tp_outer(p)
            if outer is not None and len(global_shape(p)) != 2:
                raise ValueError(
                    f"Muon cannot step {name}: it is a {len(global_shape(p))}-D tensor that tensor parallelism splits "
                    f"over {outer.mesh} ({outer.placement}); Muon orthogonalizes "
                    f"tensor-parallel 2-D matrices only. Give it to AdamW (build_optimizer(..., adamw_patterns=[...])) "
                    f"or do not split it over tp."
                )
            if outer is not None and group["mode"] == "local":
                raise ValueError(
                    f"Muon mode='local' needs every matrix whole on one rank, but tensor parallelism splits {name} "
                    f"over {outer.mesh} ({outer.placement}). Use mode='auto' or 'gather': "
                    f"its tp pieces are then gathered to one owner rank of the (dp, tp) mesh and orthogonalized whole."
                )
            for start, shape in self._matrix_shapes(name, p):  # raises on 1-D / undeclared 3-D tensors
                if group["mode"] == "local" and _is_sharded(p):
                    ranges = _matrix_ranges(p, start, shape[0] * shape[1])
                    holders = [r for r, (lo, hi) in enumerate(ranges) if hi > lo]
                    if len(holders) > 1:
                        raise ValueError(
                            f"Muon mode='local' needs every matrix whole on one rank, but {name} (matrix at element "
                            f"{start}, shape {shape}) is split over ranks {holders}. Shard with granularity 'matrix' "
                            f"(a whole matrix, or each expert matrix of a stack), e.g. fully_shard(..., granularity="
                            f"muon_granularity(model)); or use mode='auto' / 'gather'."
                        )

    def _names(self, group: dict) -> list[str]:
        if "param_names" in group:
            return list(group["param_names"])
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        return [f"param_groups[{gi}][{i}]" for i in range(len(group["params"]))]

    def _matrix_shapes(self, name: str, p: Tensor) -> list[tuple[int, tuple[int, int]]]:
        """``[(flat start, (rows, cols))]`` of the matrices of ``p``; raise for tensors Muon cannot take."""
        shape = tuple(global_shape(p))
        if len(shape) == 2:
            return [(0, (shape[0], shape[1]))]
        if len(shape) == 3 and is_expert_stack(name, p, self.expert_patterns):
            size = shape[1] * shape[2]
            return [(e * size, (shape[1], shape[2])) for e in range(shape[0])]
        if len(shape) == 3:
            raise ValueError(
                f"Muon got the 3-D parameter {name} of shape {shape}, which is not declared an expert stack. "
                f"If each [e] slice is a matrix, declare it: expert_patterns=[...] matching {name!r} (Muon or "
                f"build_optimizer), or set `param._vescale_expert_stack = True` on the sharded parameter; "
                f"otherwise route it to AdamW with adamw_patterns."
            )
        raise ValueError(
            f"Muon only orthogonalizes matrices (2-D, or 3-D expert stacks), but got {name} with shape {shape}. "
            f"Route it to AdamW: build_optimizer(model, ...) does so for 1-D tensors, embeddings and the "
            f"output head by default; adamw_patterns / muon_patterns override the routing by name."
        )

    # -- planning ---------------------------------------------------------------------------------------
    def _build_plan(self, entries: list[tuple[dict, str, Tensor]]) -> _Plan:
        matrices: list[_Matrix] = []
        buckets: dict[Any, _Bucket] = {}
        split: list[tuple[int, dict, str, Tensor]] = []  # split by tensor parallelism: planned after the others
        for slot, (group, name, p) in enumerate(entries):
            steps = group["ns_steps"]
            if _tp_split(p):
                split.append((slot, group, name, p))
                continue
            for start, shape in self._matrix_shapes(name, p):
                numel = shape[0] * shape[1]
                if numel == 0:
                    continue
                mname = name if len(global_shape(p)) == 2 else f"{name}[{start // numel}]"
                cost = newton_schulz_cost(shape, steps)
                if not _is_sharded(p):
                    m = _Matrix(mname, slot, shape, cost, [(0, numel)], (start, start + numel), group,
                                mode="replicated", owner=0, holder=0)
                    matrices.append(m)
                    continue
                layout = p.layout_info
                pieces = layout.ranges
                ranges = _matrix_ranges(p, start, numel)
                mine = _intersect(pieces[layout.rank], (start, start + numel))
                here = pieces[layout.rank][0]
                local = (mine[0] - here, mine[1] - here) if mine[1] > mine[0] else (0, 0)
                holders = [r for r, (lo, hi) in enumerate(ranges) if hi > lo]
                holder = holders[0] if len(holders) == 1 else -1
                m = _Matrix(mname, slot, shape, cost, ranges, local, group, holder=holder)
                key = id(layout.group) if layout.group is not None else None
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = _Bucket(layout.group, layout.rank, layout.world_size, p.device)
                bucket.matrices.append(m)  # every sharded matrix for now; _assign keeps the gathered ones
                matrices.append(m)
        names = [m.name for m in matrices] + [name for _, _, name, _ in split]
        if len(set(names)) != len(names):
            raise ValueError(f"Muon matrices need unique names (they order the owners); got duplicates in {names}")
        loads = {}
        out_buckets = []
        for bi, bucket in enumerate(buckets.values()):
            loads[bi] = self._assign(bucket)
            if bucket.matrices:
                bucket.layout()
            out_buckets.append(bucket)
        if split:
            own_load = sum(loads[bi][b.rank] for bi, b in enumerate(out_buckets))
            bucket, initial = self._plan_tensor_parallel(split, own_load)
            matrices += bucket.matrices
            loads[len(out_buckets)] = self._assign(bucket, initial_loads=initial)
            bucket.layout()
            out_buckets.append(bucket)
        return _Plan(matrices, out_buckets, loads)

    def _plan_tensor_parallel(
        self, split: list[tuple[int, dict, str, Tensor]], load: float
    ) -> tuple[_Bucket, list[float]]:
        """The bucket of the matrices tensor parallelism splits, over every rank of their ``(dp, tp)`` mesh.

        [Note: Muon under tensor parallelism]
        A weight ``ColwiseParallel`` / ``RowwiseParallel`` splits is ``Shard(0)`` / ``Shard(1)`` on ``mesh["tp"]``, and
        ``fully_shard`` cuts each tp-local piece over ``mesh["dp"]``: the matrix lies on all ``dp x tp`` ranks, each
        holding a flat range of its tp block. Its owner is one rank of the whole mesh: every rank sends its part there
        (one all-to-all over the mesh's ranks for all such matrices), the owner puts the blocks together, runs
        Newton–Schulz on the whole matrix and sends every rank its part of the result (one all-to-all back). The owner
        is chosen by longest-processing-time-first among the ranks already holding a part (that part stays put), with
        each rank's Newton–Schulz load from the other matrices as the seed: with granularity ``"matrix"`` every tp
        piece is whole on one dp rank, so the owner is one of the tp ranks holding a piece, and distinct matrices
        spread over the tp ranks (and over dp by the planner's own balance) instead of every tp rank orthogonalizing
        every matrix redundantly (``tp`` times the Newton–Schulz flops, for the same bytes as one gather per tp rank).
        Ranks learn the other tp ranks' blocks and parts once, when the plan is built (one AllGather).
        """
        ranks = _mesh_ranks(split[0][3])
        for _, _, name, p in split:
            if _mesh_ranks(p) != ranks:
                raise ValueError(f"Muon steps the tensor-parallel weights of one (dp, tp) mesh (ranks {ranks}), but {name} "
                                 f"lies on ranks {_mesh_ranks(p)}: give each mesh's weights their own optimizer")
        group = ranks_process_group(ranks)
        world, me, device = len(ranks), dist.get_rank(group), split[0][3].device
        # This rank's part of every matrix: its block's offset and shape, and its flat range of that block.
        rows: list[list[int]] = []
        for _, _, _, p in split:
            lay, outer = _layout_of(p), _tp_outer(p)
            assert outer is not None
            numel = lay.shape[0] * lay.shape[1]
            lo, hi = _intersect(lay.local_range, (0, numel))
            rows.append([*outer.offset, *lay.shape, lo, hi])
        mine = torch.tensor([len(split), round(load)] + [x for row in rows for x in row], dtype=torch.int64, device=device)
        counts = torch.empty(world, dtype=torch.int64, device=device)
        collectives.all_gather_into_tensor(counts, mine[:1].clone(), group, kind="setup")
        if any(c != len(split) for c in counts.tolist()):
            raise RuntimeError(
                f"ranks step different numbers of tensor-parallel Muon matrices ({counts.tolist()} per rank of {ranks}): "
                f"every rank must step the same parameters; a parameter's .grad must be set on all ranks or on none."
            )
        everyone = torch.empty(world, mine.numel(), dtype=torch.int64, device=device)
        collectives.all_gather_into_tensor(everyone.view(-1), mine, group, kind="setup")
        table = everyone.tolist()
        initial = [float(table[q][1]) for q in range(world)]
        bucket = _Bucket(group, me, world, device)
        for i, (slot, group_, name, p) in enumerate(split):
            parts = [table[q][2 + 6 * i : 8 + 6 * i] for q in range(world)]
            blocks = sorted({(tuple(row[0:2]), tuple(row[2:4])) for row in parts})
            block_of = tuple(blocks.index((tuple(row[0:2]), tuple(row[2:4]))) for row in parts)
            ranges = [(row[4], row[5]) if row[5] > row[4] else (0, 0) for row in parts]
            self._check_blocks_tile(name, tuple(global_shape(p)), blocks, block_of, ranges)
            lo, hi = ranges[me]
            here = _layout_of(p).local_range[0]
            local = (lo - here, hi - here) if hi > lo else (0, 0)
            shape = (int(global_shape(p)[0]), int(global_shape(p)[1]))
            cost = newton_schulz_cost(shape, group_["ns_steps"])
            bucket.matrices.append(_Matrix(name, slot, shape, cost, ranges, local, group_, mode="gather",
                                           blocks=tuple(blocks), block_of=block_of))
        return bucket, initial

    @staticmethod
    def _check_blocks_tile(name: str, shape: tuple[int, ...], blocks: list, block_of: tuple[int, ...],
                           ranges: list[tuple[int, int]]) -> None:
        """The tp blocks tile the matrix and the parts of each block tile it (else the plan is not one matrix)."""
        covered = sum(rows * cols for _, (rows, cols) in blocks)
        ok = covered == shape[0] * shape[1] and all(
            r + n <= s for (offset, size) in blocks for r, n, s in zip(offset, size, shape))
        for b, (_, (rows, cols)) in enumerate(blocks):
            cursor = 0
            for lo, hi in sorted(rg for rg, of in zip(ranges, block_of) if of == b and rg[1] > rg[0]):
                ok &= lo == cursor
                cursor = hi
            ok &= cursor == rows * cols
        if not ok:
            raise RuntimeError(f"the tensor-parallel pieces of {name} {shape} do not tile it (blocks {blocks}, parts "
                               f"{list(zip(block_of, ranges))} per rank): the (dp, tp) mesh is not the one it was sharded on")

    def _assign(self, bucket: _Bucket, initial_loads: Optional[list[float]] = None) -> list[float]:
        """Choose path and owner of every matrix of a bucket; keep only the gathered ones in it. A tensor-parallel
        matrix goes to one of the ranks holding a part of it, seeded with ``initial_loads``."""
        N = bucket.world_size
        costs_ns = [0.0] * N if initial_loads is None else list(initial_loads)
        gather: dict[str, _Matrix] = {}
        local: list[_Matrix] = []
        for m in bucket.matrices:
            mode = m.group["mode"]
            if mode == "gather" or m.holder < 0:
                assert mode != "local", f"{m.name} is split; Muon.__init__ checks mode='local'"
                m.mode = "gather"
                gather[m.name] = m
            else:
                m.mode, m.owner = "local", m.holder
                costs_ns[m.holder] += m.cost
                local.append(m)
        candidates = {n: [r for r, (lo, hi) in enumerate(m.ranges) if hi > lo]
                      for n, m in gather.items() if m.blocks is not None}
        assignment = assign_owners({n: m.cost for n, m in gather.items()}, N, initial_loads=costs_ns,
                                   candidates=candidates)
        for n, m in gather.items():
            m.owner = assignment.owners[n]
        self._rebalance(bucket, local)
        bucket.matrices = sorted((m for m in bucket.matrices if m.mode == "gather"), key=lambda m: (m.owner, m.name))
        loads = [0.0] * N  # this bucket's own work (a tensor-parallel bucket's seed is other buckets' work)
        for m in local + list(gather.values()):
            loads[m.owner] += m.cost
        return loads

    def _rebalance(self, bucket: _Bucket, local: list[_Matrix]) -> None:
        """``mode="auto"``: move whole matrices off the most loaded rank while the time estimate drops."""
        N, cm = bucket.world_size, self.cost_model
        if N == 1:
            return
        t = [0.0] * N
        for m in bucket.matrices:
            t[m.owner] += cm.ns_seconds(m.cost)
            if m.mode == "gather":
                for r, (lo, hi) in enumerate(m.ranges):
                    if r != m.owner and hi > lo:
                        t[r] += 2 * cm.move_seconds(hi - lo)
                        t[m.owner] += 2 * cm.move_seconds(hi - lo)
        movable = sorted((m for m in local if m.group["mode"] == "auto"), key=lambda m: (-m.cost, m.name))
        while True:
            r_max = max(range(N), key=lambda r: (t[r], -r))
            r_min = min(range(N), key=lambda r: (t[r], r))
            for m in movable:
                if m.mode != "local" or m.owner != r_max:
                    continue
                ns, mv = cm.ns_seconds(m.cost), 2 * cm.move_seconds(m.numel)
                if max(t[r_max] - ns + mv, t[r_min] + ns + mv) < t[r_max] * (1 - 1e-9):
                    t[r_max] += mv - ns
                    t[r_min] += ns + mv
                    m.mode, m.owner = "gather", r_min
                    break
            else:
                return

    def _get_plan(self, entries: list[tuple[dict, str, Tensor]]) -> _Plan:
        key = tuple((id(p), g["mode"], g["ns_steps"]) for g, _, p in entries)
        if self._plan is None or key != self._plan_key:
            self._plan = self._build_plan(entries)
            self._plan_key = key
            self._check_plans_agree(self._plan)
            logger.debug("lightning_vescale Muon plan: %s", self.plan_report(self._plan))
        return self._plan

    @staticmethod
    def _check_plans_agree(plan: _Plan) -> None:
        """Every rank of a bucket must have built the same plan (else the all-to-alls would hang)."""
        for bucket in plan.buckets:
            if bucket.world_size == 1:
                continue
            text = repr([(m.name, m.shape, m.ranges, m.owner, m.blocks, m.block_of) for m in bucket.matrices])
            digest = int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
            mine = torch.tensor([digest], dtype=torch.int64, device=bucket.device)
            everyone = torch.empty(bucket.world_size, dtype=torch.int64, device=bucket.device)
            collectives.all_gather_into_tensor(everyone, mine, bucket.group, kind="setup")
            if any(x != everyone[0] for x in everyone.tolist()):
                raise RuntimeError(
                    f"ranks built different Muon plans (digests per rank: {everyone.tolist()}). Every rank must "
                    f"step the same parameters with the same param groups; a parameter's .grad must be set on "
                    f"all ranks or on none."
                )

    def plan_report(self, plan: Optional[_Plan] = None) -> dict:
        """Paths, owners, Newton–Schulz load per rank (max/mean) and bytes per step, for every Muon matrix."""
        if plan is None:
            entries = [(g, n, p) for g in self._muon_groups() for n, p in zip(self._names(g), g["params"])]
            plan = self._build_plan(entries)
        report: dict[str, Any] = {"matrices": len(plan.matrices), "modes": defaultdict(int), "buckets": []}
        for m in plan.matrices:
            report["modes"][m.mode] += 1
        report["modes"] = dict(report["modes"])
        for bi, bucket in enumerate(plan.buckets):
            loads = plan.loads[bi]
            mean = sum(loads) / len(loads)
            sent = bucket.bytes_sent() if bucket.matrices else (0, 0)
            report["buckets"].append({
                "world_size": bucket.world_size,
                "rank": bucket.rank,
                "ns_cost_per_rank": loads,
                "ns_balance_max_over_mean": max(loads) / mean if mean else 1.0,
                "gathered_matrices": len(bucket.matrices),
                "bytes_sent_gather": sent[0],
                "bytes_sent_scatter": sent[1],
            })
        return report

    # -- the step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step()
        return loss

    def _muon_step(self) -> None:
        entries: list[tuple[dict, str, Tensor]] = []
        for group in self._muon_groups():
            for name, p in zip(self._names(group), group["params"]):
                if p.grad is not None:
                    entries.append((group, name, p))
        if not entries:
            return
        # 1. Elementwise, on local pieces: momentum, Nesterov, decoupled weight decay (torch.optim.Muon order).
        updates: list[Tensor] = []
        for group, name, p in entries:
            assert p.grad is not None  # entries hold the parameters with a gradient
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            if is_ragged(p) and (not is_ragged(buf) or buf.layout_info != p.layout_info):
                raise ValueError(
                    f"the momentum_buffer of {name} is not sharded like the parameter ({buf!r}); load optimizer "
                    f"state through lightning_vescale.checkpoint, which reshards it"
                )
            grad, buf = _local(p.grad), _local(buf)
            momentum = group["momentum"]
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            updates.append(update.reshape(-1))
            _local(p).mul_(1 - _to_scalar(group["lr"]) * group["weight_decay"])
        flat_params = [_local(p).view(-1) for _, _, p in entries]
        plan = self._get_plan(entries)

        # 2. Gather-path pieces to their owners: one all-to-all per process group, in flight during 3.
        gathers = [self._issue_gather(bucket, updates) if bucket.matrices else None for bucket in plan.buckets]

        # 3. Matrices this rank holds whole: Newton-Schulz in place, no communication.
        for m in plan.matrices:
            lo, hi = m.local
            if m.mode == "replicated" or (m.mode == "local" and hi > lo):  # local: only the holder has a part
                ortho = self._orthogonalize(updates[m.slot][lo:hi].view(m.shape), m)
                self._apply(flat_params[m.slot][lo:hi].view(m.shape), ortho, m)

        # 4. Owners orthogonalize what they received and send every rank its piece of the result back.
        scatters = []
        for bucket, pending in zip(plan.buckets, gathers):
            scatters.append(self._issue_scatter(bucket, pending) if pending is not None else None)

        # 5. Apply the returned pieces.
        for bucket, pending in zip(plan.buckets, scatters):
            if pending is None:
                continue
            work, recv = pending
            if work is not None:
                work.wait()
            for m in bucket.matrices:
                lo, hi = m.local
                if hi > lo:
                    off = bucket.send_offset[id(m)]
                    self._apply(flat_params[m.slot][lo:hi], recv[off : off + hi - lo], m)

    @staticmethod
    def _orthogonalize(update: Tensor, m: _Matrix) -> Tensor:
        g = m.group
        return _zeropower_via_newtonschulz(update, g["ns_coefficients"], g["ns_steps"], g["eps"])

    @staticmethod
    def _apply(param: Tensor, ortho: Tensor, m: _Matrix) -> None:
        g = m.group
        adjusted_lr = _adjust_lr(_to_scalar(g["lr"]), g["adjust_lr_fn"], torch.Size(m.shape))
        param.add_(ortho, alpha=-adjusted_lr)

    def _all_to_all(self, bucket: _Bucket, recv: Tensor, send: Tensor, recv_splits, send_splits, kind: str):
        return collectives.all_to_all_single(
            recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=bucket.group,
            async_op=True, kind=kind,
        )

    def _issue_gather(self, bucket: _Bucket, updates: list[Tensor]):
        device = updates[0].device
        send = torch.empty(sum(bucket.send_splits), dtype=_WIRE_DTYPE, device=device)
        for m in bucket.matrices:
            lo, hi = m.local
            if hi > lo:
                off = bucket.send_offset[id(m)]
                send[off : off + hi - lo].copy_(updates[m.slot][lo:hi])
        recv = torch.empty(sum(bucket.recv_splits), dtype=_WIRE_DTYPE, device=device)
        if bucket.world_size == 1:
            recv.copy_(send)
            return None, recv
        return self._all_to_all(bucket, recv, send, bucket.recv_splits, bucket.send_splits, "muon_gather"), recv

    def _issue_scatter(self, bucket: _Bucket, pending):
        work, recv = pending
        if work is not None:
            work.wait()
        N = bucket.world_size
        send = torch.empty_like(recv)
        for m in bucket.owned:
            offsets = bucket.recv_offsets[id(m)]
            parts = [recv[offsets[r] : offsets[r] + hi - lo] for r, (lo, hi) in enumerate(m.ranges)]
            ortho = self._orthogonalize(m.assemble(parts), m)
            for r, ((lo, hi), part) in enumerate(zip(m.ranges, m.parts(ortho))):
                if hi > lo:
                    send[offsets[r] : offsets[r] + hi - lo].copy_(part)
        back = torch.empty(sum(bucket.send_splits), dtype=_WIRE_DTYPE, device=recv.device)
        if N == 1:
            back.copy_(send)
            return None, back
        return self._all_to_all(bucket, back, send, bucket.send_splits, bucket.recv_splits, "muon_scatter"), back

    # -- state dict -------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but a state tensor that is not laid out like its
        parameter (another world size or granularity, or a plain tensor for a sharded parameter) raises
        instead of loading silently."""
        params = [p for g in self.param_groups for p in g["params"]]
        names = [n for g in self.param_groups for n in self._names(g)]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(saved_ids) == len(params):
            for pid, p, name in zip(saved_ids, params, names):
                for key, value in state_dict["state"].get(pid, {}).items():
                    problem = _state_mismatch(value, p) if key in _STATE_KEYS_SHAPED_LIKE_PARAM else None
                    if problem is not None:
                        raise ValueError(
                            f"cannot load optimizer state {key!r} of {name}: {problem}. The state was saved with "
                            f"another sharding (world size or granularity); reshard it through a full or DCP "
                            f"checkpoint (lightning_vescale.checkpoint) instead."
                        )
        super().load_state_dict(state_dict)
        self._plan, self._plan_key = None, None


def _state_mismatch(value: Any, p: Tensor) -> Optional[str]:
    """Why a per-element optimizer state cannot belong to ``p``, or None when it can."""
    if not isinstance(value, Tensor):
        return None
    if is_ragged(p):
        if is_ragged(value) and value.layout_info == p.layout_info:
            return None
        have = f"it is sharded as {value.layout_info}" if is_ragged(value) else (
            f"it is a plain tensor of shape {tuple(value.shape)}")
        return f"{have}, but the parameter is sharded as {p.layout_info}"
    return None if value.shape == p.shape else f"its shape {tuple(value.shape)} is not the parameter's {tuple(p.shape)}"
