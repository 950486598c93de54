"""DBuffer: a group's flat distributed storage for tensors of one dtype.

[Note: DBuffer layout]
A :class:`~lightning_vescale.engine.planner.BufferPlan` places every tensor of the buffer at an offset of a
flat buffer of ``N * S`` elements; rank ``r`` owns ``[r * S, (r + 1) * S)``. The DBuffer keeps

* ``local``           (S,)    persistent, original dtype (fp32 master) — the sharded parameters are
                              views into it, so the optimizer updates it in place;
* ``unsharded``       (N*S,)  ``param_dtype`` — filled by one AllGather; parameters used in forward
                              and backward are views into it; its storage is freed (resized to 0)
                              after use and re-allocated in place, so views and tensors autograd
                              saved stay valid;
* ``unsharded_grad``  (N*S,)  ``param_dtype`` — the unsharded parameters' ``.grad`` are views into
                              it, so autograd accumulates straight into the ReduceScatter input;
                              allocated at the group's first gradient, freed when its ReduceScatter
                              completes (once it is issued, when the collective reads a cast copy);
* ``local_grad``      (S,)    original dtype — the sharded parameters' ``.grad`` are views into it;
                              allocated by the ReduceScatter and dropped once every gradient of the
                              buffer was set to None (``zero_grad(set_to_none=True)``), as FSDP2 frees
                              its sharded gradients.

The AllGather reads ``local`` (or, under mixed precision, its one-op cast written straight into this
rank's slot of ``unsharded``) and writes ``unsharded``; the ReduceScatter reads ``unsharded_grad``
and writes ``local_grad``. Nothing is copied into or out of a staging buffer around a collective
(FSDP2 copies every parameter in before its AllGather and out after it, and chunk-cats gradients
before its ReduceScatter). All storage is owned here, so a memory tier change is one place: ``offload`` (set by
:mod:`lightning_vescale.memory`) is told before and after the AllGather reads ``local`` (an offloaded ``local`` is
copied into its slot of ``unsharded``, as under mixed precision, and released before the AllGather), and when ``local_grad``
is dropped; it releases and re-allocates their storage in place, as ``unsharded`` is.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from lightning_vescale.engine import collectives
from lightning_vescale.engine.planner import BufferPlan
from lightning_vescale.engine.tensor import ElementOrder, local_piece_shape

__all__ = ["BufferState", "DBuffer", "GatheredTier", "PieceTier"]


class BufferState(Enum):
    """Where a DBuffer's parameters live."""

    SHARDED = auto()
    """Only the local piece exists; the unsharded storage is freed."""
    GATHERING = auto()
    """An AllGather into the unsharded buffer was issued and not yet waited on."""
    UNSHARDED = auto()
    """The unsharded buffer holds every tensor of the group."""


class PieceTier(Protocol):
    """Where a buffer's ``local`` and ``local_grad`` live between uses (``DBuffer.offload``): the engine's tier
    interface, implemented by :mod:`lightning_vescale.memory`. None keeps them in memory."""

    @property
    def sends_copy(self) -> bool:
        """The AllGather reads a copy of ``local`` written into ``unsharded`` (``local`` itself is not resident)."""

    def before_gather(self) -> None:
        """Bring ``local`` back before the AllGather reads it."""

    def after_gather(self) -> None:
        """The AllGather has read ``local``: it may go back to its tier."""

    def fetch_grad(self) -> None:
        """Bring ``local_grad`` back (a ReduceScatter will add to it)."""

    def after_reduce(self) -> None:
        """The reduced ``local_grad`` is complete: it may go to its tier."""

    def grad_dropped(self) -> None:
        """``local_grad`` was released (every gradient set to None)."""


class GatheredTier(Protocol):
    """Where a buffer's gathered parameters wait between forward and backward (``DBuffer.gathered_offload``),
    instead of being gathered again; implemented by :mod:`lightning_vescale.memory`."""

    def has(self, buffer: DBuffer) -> bool: ...

    def save(self, buffer: DBuffer) -> None: ...

    def load(self, buffer: DBuffer, async_op: bool) -> Any: ...

    def drop(self, buffer: DBuffer) -> None: ...


def _free_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


def alias(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor on ``flat``'s storage at ``offset`` with ``shape`` that autograd does not treat as a view.

    Parameters must be leaves even though the collectives write their storage in place: an autograd
    view of a buffer would turn into a non-leaf (AsStridedBackward) after such a write. Sharing the
    storage without the view relation keeps them leaves, and their version counters untouched.
    """
    t = torch.empty(0, dtype=flat.dtype, device=flat.device)
    stride = torch.empty(shape, device="meta").stride()
    return t.set_(flat.untyped_storage(), flat.storage_offset() + offset, shape, stride)


class DBuffer:
    """The flat buffers of one group and dtype, with in-place collectives on them.

    Args:
        plan: the layout (offsets, shard size) from the planner.
        group: the process group the buffer is sharded over (size ``plan.world_size``).
        device: where every buffer lives.
        dtype: dtype of the local (master) piece.
        param_dtype: dtype of the unsharded parameters and gradients (mixed precision).
        reduce_dtype: dtype of the gradient ReduceScatter.
        requires_grad: whether the buffer's tensors get gradients.
        replicate_group: for HSDP, the group over which reduced gradient pieces are averaged.
        gradient_divide_factor: what the reduced gradient (the sum over the shard group, and over the
            replicate group for HSDP) is divided by. ``None`` (default): the number of ranks summed over,
            i.e. the mean. Expert parallelism needs another factor (see
            :func:`lightning_vescale.parallel.fully_shard_expert_parallel`).
    """

    holds_master_pieces = True
    """Each rank's master pieces live here and the sharded parameters are views of them (see group_plan's
    [Note: buffer kinds] for buffers that keep their own storage)."""

    def __init__(
        self,
        plan: BufferPlan,
        *,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        dtype: torch.dtype,
        param_dtype: Optional[torch.dtype] = None,
        reduce_dtype: Optional[torch.dtype] = None,
        requires_grad: bool = True,
        replicate_group: Optional[dist.ProcessGroup] = None,
        gradient_divide_factor: Optional[float] = None,
    ) -> None:
        self.plan = plan
        self.gradient_divide_factor = gradient_divide_factor
        self.group = group
        self.replicate_group = replicate_group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = plan.world_size
        self.device = device
        self.dtype = dtype
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        S, N = plan.shard_size, plan.world_size
        # Zero so that padding between tensors never carries garbage (it is gathered and reduced).
        self.local = torch.zeros(S, dtype=dtype, device=device)  # 1D
        # Views are made while the storage exists; they stay valid across free (resize to 0) and refill.
        self.unsharded = torch.empty(N * S, dtype=self.param_dtype, device=device)  # 1D, freed
        self._unsharded_views = [self._full_view(self.unsharded, i) for i in range(len(plan.specs))]
        _free_storage(self.unsharded)
        self.unsharded_grad: Optional[torch.Tensor] = None
        self._unsharded_grad_views: list[torch.Tensor] = []
        self.requires_grad = False
        if requires_grad:
            self.enable_grad()
        self.local_grad: Optional[torch.Tensor] = None
        self.state = BufferState.SHARDED
        self._gather_handle: Optional[Any] = None  # a collective's (or the gathered tier's) handle
        self._reduce_handle = None
        self._reduce_output: Optional[torch.Tensor] = None
        self._reduce_accumulate = False
        self.grad_allocated = False
        self.offload: Optional[PieceTier] = None  # local / local_grad between uses; None: always in memory
        # lightning_vescale.memory.GatheredOffload: ``unsharded`` on disk between forward and backward (None: the
        # backward gathers again); see [Note: gathered parameters on disk].
        self.gathered_offload: Optional[GatheredTier] = None
        self._read_back = False

    def enable_grad(self) -> None:
        """Give the buffer gradient storage (a frozen parameter of it was unfrozen); its layout is unchanged."""
        if self.requires_grad:
            return
        self.unsharded_grad = torch.empty(self.world_size * self.shard_size, dtype=self.param_dtype, device=self.device)
        self._unsharded_grad_views = [self._full_view(self.unsharded_grad, i) for i in range(len(self.plan.specs))]
        _free_storage(self.unsharded_grad)
        self.requires_grad = True

    # -- views ----------------------------------------------------------------------------------------
    @property
    def shard_size(self) -> int:
        return self.plan.shard_size

    def local_view(self, index: int) -> torch.Tensor:
        """This rank's piece of tensor ``index``: a view into ``local`` (possibly empty)."""
        return self._local_piece(self.local, index)

    def local_grad_view(self, index: int) -> torch.Tensor:
        assert self.local_grad is not None
        return self._local_piece(self.local_grad, index)

    def _local_piece(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        start, end = self.plan.piece(index, self.rank)
        lo = self.plan.local_offset(index, self.rank)
        shape = local_piece_shape(self.plan.specs[index].shape, start, end)
        return alias(flat, lo, shape)

    def _full_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        spec = self.plan.specs[index]
        off = self.plan.offsets[index]
        return alias(flat, off, spec.shape)

    def unsharded_view(self, index: int) -> torch.Tensor:
        """Tensor ``index`` in the unsharded buffer (valid data only while unsharded)."""
        return self._unsharded_views[index]

    def unsharded_grad_view(self, index: int) -> torch.Tensor:
        return self._unsharded_grad_views[index]

    def element_order(self, index: int) -> Optional[ElementOrder]:
        """The order of tensor ``index``'s elements in the local pieces when not row-major (a buffer kind may keep
        one, e.g. tile-major quantized weights); None: row-major."""
        return None

    def rank_slice(self, flat: torch.Tensor) -> torch.Tensor:
        S = self.shard_size
        return flat[self.rank * S : (self.rank + 1) * S]

    # -- parameters: AllGather / free -------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Gather every rank's piece into ``unsharded`` with one in-place AllGather."""
        if self.state is not BufferState.SHARDED:
            return
        if self.gathered_offload is not None and self.gathered_offload.has(self):
            if torch._C._current_graph_task_id() != -1:  # backward of the forward that saved it: read it back
                self._gather_handle = self.gathered_offload.load(self, async_op)
                self.state = BufferState.GATHERING if self._gather_handle is not None else BufferState.UNSHARDED
                self._read_back = True
                return
            self.gathered_offload.drop(self)  # a new forward (or evaluation): the weights may have changed
        if self.offload is not None:
            self.offload.before_gather()  # ``local`` back from its tier
        _alloc_storage(self.unsharded)
        # The gather mutates storage that autograd may have saved (the parameters' views) while the
        # values it restores are the same ones: keep the version counter so backward accepts them.
        with torch.autograd._unsafe_preserve_version_counter(self.unsharded), torch.no_grad():
            if self.param_dtype == self.dtype and not (self.offload is not None and self.offload.sends_copy):
                send = self.local
            else:
                # The mixed-precision cast, one op for the whole group; or an offloaded piece, which then goes
                # back to its tier at once instead of staying in memory until the AllGather completes.
                send = self.rank_slice(self.unsharded)
                send.copy_(self.local)
                if self.offload is not None:
                    self.offload.after_gather()
            self._gather_handle = collectives.all_gather_into_tensor(
                self.unsharded, send, self.group, async_op=async_op
            )
        self.state = BufferState.GATHERING if self._gather_handle is not None and async_op else BufferState.UNSHARDED
        if self.state is BufferState.UNSHARDED:
            self._gather_handle = None
            if self.offload is not None:
                self.offload.after_gather()

    def wait_unshard(self) -> None:
        if self.state is BufferState.GATHERING:
            assert self._gather_handle is not None  # GATHERING: a gather is in flight
            self._gather_handle.wait()
            self._gather_handle = None
            self.state = BufferState.UNSHARDED
            if self.offload is not None and not self._read_back:
                self.offload.after_gather()
        self._read_back = False

    def reshard(self, keep_for_backward: bool = False) -> None:
        """Free the unsharded storage (views stay valid objects and refill on the next unshard).
        ``keep_for_backward``: a forward's reshard whose backward will gather again; with a ``gathered_offload``
        the bytes go to disk for it instead (released once written)."""
        self.wait_unshard()
        if keep_for_backward and self.gathered_offload is not None:
            self.gathered_offload.save(self)
        else:
            if self.gathered_offload is not None:
                self.gathered_offload.drop(self)
            _free_storage(self.unsharded)
        self.state = BufferState.SHARDED

    def materialize_unsharded_for_init(self) -> torch.Tensor:
        """An unsharded buffer in the master dtype, for initializing values before sharding."""
        return torch.empty(self.world_size * self.shard_size, dtype=self.dtype, device=self.device)

    def init_view(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """Tensor ``index`` in ``full`` (from :meth:`materialize_unsharded_for_init`), to initialize it whole."""
        off, spec = self.plan.offsets[index], self.plan.specs[index]
        return full[off : off + spec.numel].view(spec.shape)

    def finish_init(self, full: torch.Tensor, sharded: dict) -> None:
        """Keep this rank's piece of the initialized ``full`` buffer (``sharded``: index -> parameter, unused here:
        the parameters are views of ``local``)."""
        self.local.copy_(self.rank_slice(full))

    # -- gradients: ReduceScatter -------------------------------------------------------------------------
    def alloc_grad(self) -> None:
        """Allocate and zero the unsharded gradient buffer (one op), unless it is accumulating."""
        assert self.unsharded_grad is not None
        if not self.grad_allocated:
            _alloc_storage(self.unsharded_grad)
            self.unsharded_grad.zero_()
            self.grad_allocated = True

    def free_grad(self) -> None:
        if self.unsharded_grad is not None:
            _free_storage(self.unsharded_grad)
        self.grad_allocated = False

    def reduce_grad(self, *, accumulate: bool, async_op: bool = True) -> None:
        """ReduceScatter the unsharded gradient buffer into this rank's gradient piece.

        Args:
            accumulate: add into the existing ``local_grad`` instead of overwriting it.
        """
        assert self.unsharded_grad is not None and self.grad_allocated
        N = self.world_size
        with torch.no_grad():
            send = self.unsharded_grad
            if self.reduce_dtype != self.param_dtype:
                send = send.to(self.reduce_dtype)  # one cast for the whole group
            if send.dtype != torch.float32 and send.dtype != torch.float64:
                send.div_(N)  # pre-divide low-precision sums so they cannot overflow
            if self.local_grad is None:
                # Written whole below (by the ReduceScatter or the copy in wait_reduce): no fill needed.
                self.local_grad = torch.empty(self.shard_size, dtype=self.dtype, device=self.device)
                accumulate = False
            if not accumulate and self.reduce_dtype == self.dtype:
                out = self.local_grad
            else:
                out = torch.empty(self.shard_size, dtype=self.reduce_dtype, device=self.device)
            self._reduce_handle = collectives.reduce_scatter_tensor(out, send, self.group, async_op=async_op)
            self._reduce_send: Optional[torch.Tensor] = send
        if send is not self.unsharded_grad:
            # The collective reads the cast copy: the gradient buffer is free from here (a later allocation on the
            # compute stream is ordered after the cast), not only when the ReduceScatter completes.
            self.free_grad()
        self._reduce_output = out
        self._reduce_accumulate = accumulate

    @property
    def reducing(self) -> bool:
        return self._reduce_output is not None

    @property
    def reduce_completed(self) -> bool:
        """The ReduceScatter in flight has finished (``wait_reduce`` will not block); True when none is."""
        handle = self._reduce_handle
        return handle is None or handle.is_completed()

    def release_grad_piece(self) -> None:
        """Drop the sharded gradient storage (every gradient of the buffer was set to None): the next
        ReduceScatter allocates it again. Tensors the user still holds keep their own reference."""
        assert not self.reducing, "release_grad_piece during a ReduceScatter"
        if self.offload is not None:
            self.offload.grad_dropped()
        self.local_grad = None

    def wait_reduce(self) -> None:
        """Finish the ReduceScatter: average, HSDP all-reduce, accumulate; free the unsharded grads."""
        if self._reduce_output is None:
            return
        if self._reduce_handle is not None:
            self._reduce_handle.wait()
        out = self._reduce_output
        with torch.no_grad():
            replicas = dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1
            if replicas > 1:
                collectives.all_reduce(out, self.replicate_group, kind="all_reduce_replicate")
            divisor = self.gradient_divide_factor or self.world_size * replicas  # default: the mean over ranks
            if not (out.dtype == torch.float32 or out.dtype == torch.float64):
                divisor /= self.world_size  # low-precision sums were pre-divided by N in reduce_grad
            if divisor != 1:
                out.div_(divisor)
            assert self.local_grad is not None  # allocated by reduce_grad
            if out is not self.local_grad:
                if self._reduce_accumulate:
                    self.local_grad.add_(out)
                else:
                    self.local_grad.copy_(out)
        self._reduce_handle = None
        self._reduce_output = None
        self._reduce_send = None
        self.free_grad()
