"""Hardware profiles for the dry run: FLOP/s, memory bandwidth, and link bandwidth and latency.

``profiles/h200.yaml`` is from public specifications (its efficiencies and latencies are stated
assumptions); ``profiles/cpu.yaml`` was measured on the machine the tests run on with
``python -m lightning_vescale.plan --measure-hardware``, which runs :func:`measure_cpu_profile`.

[Note: the collective model]
A ring AllGather or ReduceScatter over ``N`` ranks sends ``(N - 1) * S`` bytes per rank (as ``comm_stats``
counts them). Its time is ``latency * ceil(log2 N) + sent / (bandwidth * link_efficiency)``: the bandwidth
term is the ring's; the latency term is a tree's (NCCL switches algorithms for latency; a pure ring's
``(N - 1) * latency`` would dominate at thousands of ranks, which NCCL avoids). ``bandwidth`` is the
NVLink figure when the group fits in one node and the per-GPU network figure otherwise.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_vescale.plan._spec import PlanError

__all__ = ["FunctionalCollectiveCounter", "HardwareProfile", "OpCounter", "load_profile", "measure_cpu_profile", "profile_names"]

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class Link:
    bandwidth: float
    """Bytes per second per rank and direction."""
    latency: float
    """Seconds per collective step."""


@dataclass(frozen=True)
class HardwareProfile:
    """What the step-time prediction needs to know about a machine."""

    name: str
    description: str
    devices_per_node: int
    """Ranks that share the fast link (NVLink); larger groups go over ``inter_node``."""
    memory_bytes: float
    """Memory per device (the dry run says when a plan does not fit)."""
    memory_bandwidth: float
    """Bytes/s of device memory (copies, the optimizer step)."""
    flops: dict
    """Peak dense FLOP/s per device, by dtype name (``bfloat16``, ``float32``)."""
    compute_efficiency: float
    """Achieved / peak FLOP/s for the model's matmuls."""
    intra_node: Link
    inter_node: Link
    link_efficiency: float = 1.0
    """Achieved / nominal bandwidth of large collectives."""
    shared_compute: bool = False
    """The ranks share ``flops`` (several processes on one CPU) instead of each having its own device."""
    cores: int = 0
    """With ``shared_compute``: how many ranks compute at once (the CPU's cores; ``flops`` is all of them)."""
    op_overhead: float = 0.0
    """Host seconds per dispatched operator (forward and backward) beyond its FLOPs: what a small model on a CPU
    spends mostly (the MPMD cost model prices it; 0: none)."""
    microbatch_overhead: float = 0.0
    """Host seconds per pipeline micro-batch and stage beyond its operators (the schedule's bookkeeping, its
    sends and receives)."""
    tensor_overhead: float = 0.0
    """Host seconds per parameter tensor and step beyond FLOPs and bytes (the optimizer's per-tensor loop,
    clipping, the sharding hooks)."""
    measured: dict = field(default_factory=dict)
    """For a measured profile: the raw measurements and the command."""

    def __post_init__(self) -> None:
        for name in ("intra_node", "inter_node"):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, Link(**value))

    def flops_per_rank(self, dtype: torch.dtype, world_size: int) -> float:
        name = str(dtype).removeprefix("torch.")
        peak = self.flops.get(name, self.flops.get("float32"))
        assert peak is not None, f"HardwareProfile.flops has neither {name} nor float32"
        if self.shared_compute:
            peak = peak / max(1, world_size)
        return peak * self.compute_efficiency

    def link(self, world_size: int) -> Link:
        return self.intra_node if world_size <= self.devices_per_node else self.inter_node

    def collective_seconds(self, sent_bytes: float, world_size: int) -> float:
        """Time of one AllGather / ReduceScatter in which each rank sends ``sent_bytes`` (see the module note)."""
        if world_size <= 1:
            return 0.0
        link = self.link(world_size)
        return link.latency * math.ceil(math.log2(world_size)) + sent_bytes / (link.bandwidth * self.link_efficiency)

    def all_reduce_seconds(self, sent_bytes: float, world_size: int, span: int) -> float:
        """Time of one AllReduce over ``world_size`` ranks spread over ``span`` consecutive ranks (HSDP's
        replicas: one rank of each shard group), each sending ``sent_bytes``: a ReduceScatter then an AllGather,
        so twice the latency term, over the NVLink only if ``span`` fits in one node."""
        if world_size <= 1:
            return 0.0
        link = self.link(span)
        return 2 * link.latency * math.ceil(math.log2(world_size)) + sent_bytes / (link.bandwidth * self.link_efficiency)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(source: Union[str, os.PathLike, HardwareProfile]) -> HardwareProfile:
    """A profile by name (``h200``, ``cpu``) or from a YAML file with the same fields."""
    import yaml

    if isinstance(source, HardwareProfile):
        return source
    path = Path(source)
    if not path.is_file():
        path = PROFILE_DIR / f"{source}.yaml"
    if not path.is_file():
        raise PlanError(f"no hardware profile {str(source)!r}: use one of {', '.join(profile_names())} or a YAML file")
    data = yaml.safe_load(path.read_text())
    try:
        return HardwareProfile(**data)
    except TypeError as err:
        raise PlanError(f"hardware profile {str(path)!r}: {err}") from None


# --------------------------------------------------------------------------------------------------------
# Measuring this machine


def _best_seconds(fn, repeat: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_flops(dtype: torch.dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_seconds(lambda: a @ b, 5)


def _copy_bandwidth(nbytes: int = 256 * 2**20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), 5)  # read + write


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched inside it (``ops``): what ``op_overhead`` is paid for."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class FunctionalCollectiveCounter(TorchDispatchMode):
    """Bytes per rank torch's functional collectives send inside it (what DTensor's redistributions issue: tensor
    parallelism's), by kind ``<op>_<suffix>`` (``all_reduce_tp``, ``all_gather_tp``, ``reduce_scatter_tp``), counted as
    ``comm_stats`` counts them: ``2 (n - 1) / n`` of an AllReduce's tensor, ``(n - 1)`` times an AllGather's input,
    ``(n - 1) / n`` of a ReduceScatter's input, ``n`` the group's size. With ``all_to_all`` (a suffix), also every
    ``all_to_all_single`` (expert parallelism's: ``all_to_all_<all_to_all>`` for the rows, ``..._counts`` for an
    integer one, the tokens-per-expert exchange): the bytes of the rows this rank sends to the others (the engine's
    own, Muon's, are ``comm_stats``' too: count those outside). ``calls`` counts them by kind. The reference the dry
    run's tensor- and expert-parallel bytes are checked against (``benchmarks/plan_check.py``, the tests)."""

    def __init__(self, suffix: str = "tp", *, all_to_all: Optional[str] = None) -> None:
        super().__init__()
        self.suffix, self.all_to_all = suffix, all_to_all
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def _record(self, kind: str, nbytes: float) -> None:
        self.sent[kind] = self.sent.get(kind, 0.0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        ops = torch.ops._c10d_functional
        if func in (ops.all_reduce.default, ops.all_gather_into_tensor.default, ops.reduce_scatter_tensor.default):
            from torch.distributed.distributed_c10d import _resolve_process_group

            t = args[0]
            nbytes = t.numel() * t.element_size()
            n = _resolve_process_group(args[-1]).size()
            if func is ops.all_reduce.default:
                self._record(f"all_reduce_{self.suffix}", 2 * (n - 1) * nbytes / n)
            elif func is ops.all_gather_into_tensor.default:
                self._record(f"all_gather_{self.suffix}", (n - 1) * nbytes)
            else:
                self._record(f"reduce_scatter_{self.suffix}", (n - 1) * nbytes / n)
        elif self.all_to_all is not None and func is torch.ops.c10d.alltoall_base_.default:
            import torch.distributed as dist

            _, t, group, _, input_splits = args[:5]
            pg = dist.ProcessGroup.unbox(group)
            rows = t.shape[0] if t.dim() else 0
            splits = list(input_splits) or [rows // pg.size()] * pg.size()
            row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
            kind = f"all_to_all_{self.all_to_all}" + ("" if t.is_floating_point() else "_counts")
            self._record(kind, (rows - splits[pg.rank()]) * row_bytes)
        return func(*args, **(kwargs or {}))


def _op_overhead(width: int = 8, depth: int = 16) -> float:
    """Seconds per operator of a training step's forward and backward whose FLOPs are negligible (a deep stack
    of tiny linear layers, one thread): the host's per-op cost (dispatch, autograd)."""
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                for _ in range(depth)])
    x = torch.randn(2, width)

    def step() -> None:
        net(x).sum().backward()

    with OpCounter() as counter:
        step()
    return _best_seconds(step, 20) / counter.ops


def _gloo_worker(rank: int, world: int, init_file: str, sizes: list, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    times = []
    for n in sizes:
        send = torch.ones(n // 4, dtype=torch.float32)
        recv = torch.empty(world * (n // 4), dtype=torch.float32)
        dist.barrier()
        times.append(_best_seconds(lambda: gather(recv, send), 5))
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def _gloo_link(sizes: list) -> tuple[float, float, list]:
    """(latency, bandwidth) of gloo AllGathers between two processes on this machine, each rank sending each of
    ``sizes`` bytes: the latency is the time of the smallest, the bandwidth the median of ``sent / (time -
    latency)`` over the sizes of 1 MiB and more (robust to one slow size on a shared machine)."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_gloo_worker, args=(r, 2, os.path.join(tmp, "pg"), sizes, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        times = out.get()
    latency = times[0]
    rates = sorted(n / max(t - latency, 1e-9) for n, t in zip(sizes, times) if n >= 2**20)
    return latency, rates[len(rates) // 2], times


def measure_cpu_profile() -> HardwareProfile:
    """Measure this CPU: matmul FLOP/s of all its cores (the ranks of a run share them), copy bandwidth,
    and gloo AllGather latency and bandwidth between two local processes. Takes about half a minute."""
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        fp32 = _matmul_flops(torch.float32)
        bf16 = _matmul_flops(torch.bfloat16)
        copy = _copy_bandwidth()
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(1)  # as each rank runs
    try:
        per_op = _op_overhead()
    finally:
        torch.set_num_threads(threads)
    sizes = [2**10, 2**20, 2**22, 2**24, 2**26]
    latency, bandwidth, times = _gloo_link(sizes)
    link = Link(bandwidth=bandwidth, latency=latency)
    return HardwareProfile(
        name="cpu", description=f"this machine: {cores} CPU cores shared by the ranks, gloo over loopback",
        devices_per_node=1 << 20, memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        memory_bandwidth=copy, flops={"float32": fp32, "bfloat16": bf16}, compute_efficiency=1.0,
        intra_node=link, inter_node=link, link_efficiency=1.0, shared_compute=True, cores=cores, op_overhead=per_op,
        measured={"command": "python -m lightning_vescale.plan --measure-hardware", "date": time.strftime("%Y-%m-%d"),
                  "cores": cores, "torch": str(torch.__version__), "matmul": "1024x1024 @ 1024x1024, all cores, best of 5",
                  "gloo_all_gather_bytes_sent": sizes, "gloo_all_gather_seconds": times},
    )
