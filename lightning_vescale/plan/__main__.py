"""``python -m lightning_vescale.plan``: size a run before it starts, on the meta device (no memory, no device).

    python -m lightning_vescale.plan model=llama_70b world_size=1024
    python -m lightning_vescale.plan model=deepseek_v3_671b world_size=8..16384 plan=moe hardware=h200
    python -m lightning_vescale.plan model=llama_70b world_size=1024 replicate=8   # HSDP: 8 replicas of 128 ranks
    python -m lightning_vescale.plan model=llama_70b world_size=16384 tp=8   # dp 2048 x tp 8 (plan llama: its tp rules)
    python -m lightning_vescale.plan model=deepseek_v3_671b world_size=2048 ep=64   # dp 32 x ep 64 (plan moe)
    python -m lightning_vescale.plan model=llama_8b world_size=64 plan=configs/plan/llama.yaml seq_len=8192 \\
        batch_size=2 precision=bf16-mixed optimizer=muon model.n_layers=16 out=plan_llama_8b.yaml
    python -m lightning_vescale.plan --measure-hardware > my_machine.yaml   # then hardware=my_machine.yaml

Arguments (``key=value``, as the recipes take them):

* ``model``: a preset ``<family>_<preset>`` (``llama_70b``, ``deepseek_v3_671b``, ``moe_tiny``, ...; the files of
  ``configs/model/``), with ``model.<field>=<value>`` overrides;
* ``world_size``: ranks in all: ``1024``, a list ``8,64,512``, or powers of two ``8..16384``;
* ``replicate``: HSDP, a 2-D ``(replicate, shard)`` mesh: each group sharded over ``world_size / replicate`` ranks,
  gradients AllReduced across the ``replicate`` replicas (must divide every world size); 1 (default): a 1-D mesh;
* ``tp``: tensor parallelism, a ``(world_size / tp, tp)`` mesh: the plan's ``tp`` rules split modules over ``tp``
  ranks (``plan=llama``), each group of the tp-local model is sharded over ``world_size / tp`` ranks, and the
  tensor-parallel AllReduces per layer are counted (``all-reduce tp/step``; with sequence parallelism, ``plan=llama_sp``,
  its AllGathers and ReduceScatters too); without ``plan=`` the model family's plan (``llama``); 1 (default): none;
* ``ep``: expert parallelism, a ``(world_size / ep, ep)`` mesh: every MoE layer's routed experts split over ``ep``
  ranks (``E / ep`` each), their groups sharded over the ``world_size / ep`` dp ranks, the rest over all; the
  all-to-alls per layer are counted under balanced routing (``all-to-all ep/step``); without ``plan=`` the ``moe``
  plan; 1 (default): none;
* ``plan``: a plan name (``configs/plan/``) or YAML file; default: every transformer block a group. A plan's
  ``quantization: fp8_block | int8_block`` is sized as the engine applies it (trained weights gathered as codes +
  scales, frozen ones stored as codes + scales);
* ``hardware``: ``h200`` (public specifications) or ``cpu`` (this machine, measured), or a profile file;
* ``batch_size`` (sequences per rank per micro-batch, 1), ``seq_len`` (4096), ``precision`` (``bf16-mixed``,
  ``32-true``, ``bf16-true``), ``optimizer`` (``adamw``, ``muon``, ``adamw8bit``), ``clip_grad`` (true), ``checkpointing``
  (false: activation checkpointing of every block);
* ``params=true``: also one line per parameter of the resolved plan; ``out=<file.yaml|.json>``: write the
  resolved plan and every figure.

Prints the resolved plan (per group: parameters, bytes, granularity, padding at the first world size), then per
world size and per engine (lightning_vescale, and FSDP2's even sharding of the same model): bytes per rank of
sharded parameters, gradients and optimizer states on the device (a plan's ``tier``: what it keeps on host or
disk in a column of its own, outside the peak), the peak of gathered parameters with prefetch, activations
per micro-batch, the peak per rank, bytes sent per step per collective (AllGather, of which block-quantized
codes + scales; ReduceScatter; HSDP's AllReduce across replicas; tensor parallelism's AllReduces, and with sequence
parallelism its AllGathers and ReduceScatters; with ``optimizer=muon`` Muon's two all-to-alls, the busiest rank's),
padding, and the predicted step time, under the mesh it names.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from lightning_vescale.plan._spec import PlanError

USAGE = ("usage: python -m lightning_vescale.plan model=<preset> world_size=<N|N1,N2|A..B> [replicate=R] [plan=...] "
         "[hardware=...]")
_KEYS = ("model", "world_size", "replicate", "tp", "ep", "plan", "hardware", "batch_size", "seq_len", "precision", "optimizer", "clip_grad",
         "checkpointing", "params", "out")


def _parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    import yaml

    args: dict[str, Any] = {}
    overrides: dict[str, Any] = {}
    for item in argv:
        if "=" not in item:
            raise PlanError(f"{item!r} is not key=value; {USAGE}")
        key, _, value = item.partition("=")
        if key.startswith("model."):
            overrides[key[len("model."):]] = yaml.safe_load(value)
        elif key in _KEYS:
            args[key] = value
        else:
            import difflib

            close = difflib.get_close_matches(key, _KEYS, n=1)
            raise PlanError(f"unknown argument {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                            + f"; arguments: {', '.join(_KEYS)}, model.<field>")
    for required in ("model", "world_size"):
        if required not in args:
            raise PlanError(f"{required}= is required; {USAGE}")
    return args, overrides


def _flag(value: str) -> bool:
    if str(value).lower() in ("1", "true", "yes"):
        return True
    if str(value).lower() in ("0", "false", "no"):
        return False
    raise PlanError(f"expected true or false, got {value!r}")


def world_sizes(spec: str) -> list[int]:
    """``"1024"`` -> [1024]; ``"8,64"`` -> [8, 64]; ``"8..64"`` -> [8, 16, 32, 64]."""
    try:
        if ".." in spec:
            lo, hi = (int(x) for x in spec.split(".."))
            sizes = []
            n = lo
            while n <= hi:
                sizes.append(n)
                n *= 2
        else:
            sizes = [int(x) for x in spec.split(",")]
    except ValueError:
        raise PlanError(f"world_size={spec!r}: give N, a list N1,N2 or a range of powers of two A..B") from None
    if not sizes or any(n < 1 for n in sizes):
        raise PlanError(f"world_size={spec!r}: world sizes must be >= 1")
    return sizes


class _SkipInit(TorchFunctionMode):
    """Skip weight initialization (meta tensors hold no values; on meta, init ops run Python references that are
    slow and import the compiler stack)."""

    _INIT = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in self._INIT or getattr(func, "__module__", "") == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def build_model(name: str, overrides: dict[str, Any]) -> torch.nn.Module:
    """The preset ``<family>_<preset>`` with field overrides, on the meta device."""
    from lightning_vescale.models.families import FAMILIES

    family = next((f for f in sorted(FAMILIES, key=len, reverse=True) if name.startswith(f + "_")), None)
    presets = sorted(f"{f}_{p}" for f, fam in FAMILIES.items() for p in fam.presets)
    if family is None or name[len(family) + 1:] not in FAMILIES[family].presets:
        raise PlanError(f"unknown model {name!r}; presets: {', '.join(presets)}")
    config = FAMILIES[family].preset(name[len(family) + 1:])
    try:
        config = dataclasses.replace(config, **overrides)
    except (TypeError, ValueError) as err:
        raise PlanError(f"model={name} with overrides {overrides}: {err}") from None
    with torch.device("meta"), _SkipInit():
        return FAMILIES[family].model_cls(config)


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.01 else f"{s * 1e3:.2f} ms"


def _off_device(off: dict) -> str:
    """A plan's bytes off the device, per tier (the params / grads / optim columns count the device's only)."""
    tiers: dict[str, float] = {}
    for key, nbytes in off.items():
        tiers[key.rpartition("/")[2]] = tiers.get(key.rpartition("/")[2], 0.0) + nbytes
    return ", ".join(f"{t} {_mib(n)}" for t, n in sorted(tiers.items())) or "-"


def format_runs(runs: list) -> str:
    from lightning_vescale.plan._table import _rows_to_text

    hsdp = any(run.replicate > 1 for run in runs)
    tp = any(run.tensor_parallel > 1 for run in runs)
    sp = any(k in run.vescale.collectives for run in runs for k in ("all_gather_tp", "reduce_scatter_tp"))
    quant = any(k.startswith("all_gather_quant") for run in runs for k in run.vescale.collectives)
    tiered = any(run.vescale.off_device for run in runs)
    muon = any("muon_gather" in run.vescale.collectives for run in runs)
    ep = any(run.expert_parallel > 1 for run in runs)
    header = ["ranks", *(["mesh"] if hsdp else []), "engine", "params", "grads", "optim",
              *(["host/disk"] if tiered else []), "gathered peak",
              "activations", "peak/rank", "all-gather/step", *(["(quantized)"] if quant else []),
              "reduce-scatter/step", *(["all-reduce/step", "all-reduce time"] if hsdp else []),
              *(["all-reduce tp/step"] if tp else []),
              *(["all-gather tp/step", "reduce-scatter tp/step"] if sp else []), *(["tp time"] if tp else []),
              *(["all-to-all ep/step"] if ep else []), *(["muon all-to-all/step"] if muon else []),
              "padding",
              "step time", "(compute+exposed comm+optim)"]
    rows = []
    for run in runs:
        for name, est in (("vescale", run.vescale), ("fsdp2", run.fsdp2)):
            quantized = sum(v for k, v in est.collectives.items() if k.startswith("all_gather_quant"))
            rows.append([
                str(run.world_size), *([f"{run.replicate}x{run.world_size // run.replicate}"] if hsdp else []), name,
                _mib(est.params), _mib(est.grads), _mib(est.optimizer),
                *([_off_device(est.off_device)] if tiered else []),
                _mib(est.gathered_peak), _mib(est.activations), _mib(est.peak), _mib(est.all_gather_bytes),
                *([_mib(quantized) if quantized else "-"] if quant else []),
                _mib(est.collectives.get("reduce_scatter", 0)),
                *([_mib(est.collectives.get("all_reduce_replicate", 0)), _seconds(est.replicate_seconds)] if hsdp
                  else []),
                *([_mib(est.collectives.get("all_reduce_tp", 0))] if tp else []),
                *([_mib(est.collectives.get(k, 0)) for k in ("all_gather_tp", "reduce_scatter_tp")] if sp else []),
                *([_seconds(est.replicate_seconds)] if tp else []),
                *([_mib(est.collectives.get("all_to_all_ep", 0) + est.collectives.get("all_to_all_ep_counts", 0))]
                  if ep else []),
                *([_mib(est.collectives.get("muon_gather", 0) + est.collectives.get("muon_scatter", 0))] if muon
                  else []),
                f"{est.padding:.3%}", _seconds(est.step_seconds),
                f"{_seconds(est.compute_seconds)} + {_seconds(est.exposed_comm_seconds)} + "
                f"{_seconds(est.optimizer_seconds)}",
            ])
    return _rows_to_text(header, rows)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]) or not argv:
        print(__doc__)
        return 0
    if argv == ["--measure-hardware"]:
        from lightning_vescale.plan._hardware import measure_cpu_profile

        print("# Measured by: python -m lightning_vescale.plan --measure-hardware")
        print(measure_cpu_profile().to_yaml(), end="")
        return 0
    try:
        return _run(argv)
    except PlanError as err:
        sys.stderr.write(f"python -m lightning_vescale.plan: error: {err}\n")
        return 2


def _run(argv: list[str]) -> int:
    from lightning_vescale.plan._activations import activation_profile
    from lightning_vescale.plan._dry_run import Workload, _forward_order, check_replicate, dry_run, mesh_description
    from lightning_vescale.plan._files import load_plan
    from lightning_vescale.plan._hardware import load_profile
    from lightning_vescale.plan._resolve import resolve_plan
    from lightning_vescale.plan._tensor_parallel import (
        check_expert_parallel_size,
        check_tensor_parallel_size,
        expert_parallel_view,
        sequence_parallel,
        tensor_parallel_view,
    )

    start = time.perf_counter()
    args, overrides = _parse(argv)
    sizes = world_sizes(args["world_size"])
    try:
        replicate = int(args.get("replicate", 1))
    except ValueError:
        raise PlanError(f"replicate={args['replicate']!r}: give a number of replicas (HSDP), e.g. replicate=2") from None
    try:
        tp = int(args.get("tp", 1))
    except ValueError:
        raise PlanError(f"tp={args['tp']!r}: give the tensor-parallel size, e.g. tp=8") from None
    try:
        ep = int(args.get("ep", 1))
    except ValueError:
        raise PlanError(f"ep={args['ep']!r}: give the expert-parallel size, e.g. ep=8") from None
    for n in sizes:
        check_replicate(n, replicate)
        check_tensor_parallel_size(n, replicate, tp)
        check_expert_parallel_size(n, replicate, tp, ep)
    try:
        workload = Workload(
            batch_size=int(args.get("batch_size", 1)), seq_len=int(args.get("seq_len", 4096)),
            precision=args.get("precision", "bf16-mixed"), optimizer=args.get("optimizer", "adamw"),
            clip_grad=_flag(args.get("clip_grad", "true")), checkpointing=_flag(args.get("checkpointing", "false")),
        )
    except ValueError as err:
        raise PlanError(str(err)) from None
    hardware = load_profile(args.get("hardware", "h200"))
    model = build_model(args["model"], overrides)
    if workload.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    plan = load_plan(args["plan"]) if "plan" in args else None
    if plan is None and (tp > 1 or ep > 1):
        # The default plan splits nothing over tp and leaves the experts in their blocks' groups: take the model
        # family's plan (configs/plan/<family>.yaml; the moe plan for a MoE family without one), and say so.
        from lightning_vescale.models.families import FAMILIES

        family = next(f for f in sorted(FAMILIES, key=len, reverse=True) if args["model"].startswith(f + "_"))
        moe_family = hasattr(FAMILIES[family].config_cls, "num_experts") or "num_experts" in getattr(
            FAMILIES[family].config_cls, "__dataclass_fields__", {})
        for name in (family, "moe") if ep > 1 or moe_family else (family,):
            try:
                plan = load_plan(name)
                break
            except (PlanError, FileNotFoundError, ValueError):
                continue
        else:
            raise PlanError(f"tp={tp} needs a plan with tp rules and there is no plan {family!r}: give plan=...")
        why = "whose tp rules split the model" if tp > 1 else "whose groups hold the routed experts"
        print(f"({', '.join(f'{k}={v}' for k, v in (('tp', tp), ('ep', ep)) if v > 1)} without plan=: using plan "
              f"{plan.name!r}, {why})")
    resolved = resolve_plan(model, plan)
    try:
        model, resolved = tensor_parallel_view(model, resolved, tp)  # one tp rank's model: sized as the engine sees it
        model, resolved = expert_parallel_view(model, resolved, ep, copy_model=tp == 1)  # one ep rank's experts
    except ValueError as err:
        raise PlanError(str(err)) from None
    from lightning_vescale.plan._dry_run import PRECISIONS

    compute_dtype = PRECISIONS[workload.precision][0] or next(model.parameters()).dtype
    activations = activation_profile(model, [g.name for g in _forward_order(model, resolved)],
                                     compute_dtype=compute_dtype, sequence_parallel=sequence_parallel(model))
    runs = [dry_run(model, resolved, n, workload=workload, hardware=hardware, activations=activations,
                    replicate=replicate, tensor_parallel=tp, expert_parallel=ep) for n in sizes]
    elapsed = time.perf_counter() - start
    print(resolved.table(sizes[0] // (replicate * tp), params=_flag(args.get("params", "false"))))
    if tp > 1:
        print(f"(one tensor-parallel rank's model: the weights the tp rules split at 1/{tp} of their size)")
    if ep > 1:
        print(f"(one expert-parallel rank's model: 1/{ep} of the routed experts; their groups sharded over "
              f"world_size / {ep * tp} ranks, the others over world_size / {tp})")
    print()
    print(f"{args['model']} ({runs[0].num_params / 1e9:.2f}B parameters), plan {resolved.plan.name or 'default'!r}, "
          f"{workload.precision}, {workload.optimizer}, micro-batch {workload.batch_size}x{workload.seq_len} tokens per "
          f"rank{', activation checkpointing' if workload.checkpointing else ''}, hardware {hardware.name} ({hardware.description}); per rank:")
    meshes = [mesh_description(n, replicate, tp, ep) for n in sizes]
    print("mesh: " + (", ".join(meshes) if len(meshes) <= 3 else f"{meshes[0]} ... {meshes[-1]}")
          + (f": each group sharded over world_size / {replicate} ranks, gradients AllReduced across the "
             f"{replicate} replicas after each ReduceScatter (exposed: the engine waits for it)" if replicate > 1
             else f": each MoE layer's routed experts split over the {ep} ep ranks, their groups sharded over the "
             f"dp ranks of an ep coordinate, the others over all; the all-to-alls (balanced routing) are exposed"
             if ep > 1 and tp == 1
             else f": the plan's tp rules split modules over {tp} ranks (split_tokens feed-forwards: 1/{tp} of the "
             f"tokens each, in groups over every rank), the routed experts over {ep} ep ranks (their groups over the "
             f"dp x tp ranks of an ep coordinate), the rest sharded over world_size / {tp} ranks; the tp collectives "
             f"and the all-to-alls (balanced routing) are exposed" if ep > 1
             else f": the plan's tp rules split modules over {tp} ranks, each group of one tp rank's model sharded "
             f"over world_size / {tp} ranks; the tp collectives are exposed" if tp > 1
             else ": every group sharded over all ranks"))
    print(format_runs(runs))
    too_big = [str(r.world_size) for r in runs if r.vescale.peak > hardware.memory_bytes]
    if too_big:
        print(f"note: the predicted peak per rank exceeds the {hardware.memory_bytes / 2**30:.0f} GiB of a "
              f"{hardware.name} device at {', '.join(too_big)} ranks"
              + (" (try a smaller micro-batch, more ranks, or fewer gathered bytes)" if workload.checkpointing else
                 " (without activation checkpointing: try checkpointing=true, a smaller micro-batch or more ranks)"))
    for note in dict.fromkeys(n for run in runs for n in run.notes if "exceeds the device memory" not in n):
        print(f"note: {note}")
    print(f"(dry run of {len(sizes)} world size(s) in {elapsed:.2f} s)")
    if "out" in args:
        out = Path(args["out"])
        data = {"resolved_plan": resolved.to_dict(), "runs": [r.to_dict() for r in runs],
                "hardware": hardware.to_dict()}
        if out.suffix == ".json":
            out.write_text(json.dumps(data, indent=1, default=str))
        else:
            import yaml

            out.write_text(yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False, width=120))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
