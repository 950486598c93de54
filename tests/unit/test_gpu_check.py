"""``benchmarks/gpu_check.sh`` starts and runs every part: its CPU dry check end to end, and the profile parser on a
CUDA-shaped trace (kernels launched from copy ops inside collective sites, NCCL neighbours)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.recipe_zygote import python_command

REPO = Path(__file__).resolve().parents[2]
PARTS = ("env", "train_vescale", "train_fsdp2", "profile", "host_tier", "quant")


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_dry_check_end_to_end(tmp_path: Path) -> None:
    # $PYTHON: each of the script's python commands forked from an interpreter that has imported torch (7-9 s of
    # imports each, eight of them); tests/zygote_python.py.
    (tmp_path / "bin").mkdir()
    python, python_env = python_command(tmp_path / "bin")
    env = {**os.environ, **python_env, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "",
           "GPU_CHECK_STEPS": "1", "GPU_CHECK_WARMUP": "1", "PYTHON": python, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    summary_md = tmp_path / "gpu_check_summary.md"
    assert summary_md.exists(), proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "gpu_check_summary.json").read_text())
    assert summary["statuses"] == {part: "SKIP" for part in PARTS}, summary_md.read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = summary_md.read_text()
    for part in PARTS:
        assert f"| {part} | SKIP | SKIP (no CUDA): " in text
    assert "SKIP (no CUDA)" in proc.stdout
    # The dry run really trained and profiled: finite losses, lightning-vescale's sites seen, FSDP2's copies found.
    parts = summary["parts"]
    assert len(parts["train_vescale"]["losses"]) == 2 and len(parts["train_fsdp2"]["losses"]) == 2
    assert parts["profile"]["vescale"]["sites"] > 0 and parts["profile"]["vescale"]["staging_copies"] == 0
    assert parts["profile"]["fsdp2"]["staging_copies"] > 0
    assert (tmp_path / "profile_copies.md").exists() and (tmp_path / "profile_vescale_trace.json.gz").exists()


def _x(name: str, cat: str, ts: float, dur: float = 1.0, tid: int = 1, **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_copies_at_collectives_on_a_cuda_shaped_trace() -> None:
    gpu_check = _gpu_check()
    events = [
        _x("lv::unshard (layers.0)", "user_annotation", 0, 100),
        _x("aten::copy_", "cpu_op", 10, 5, **{"Input type": ["c10::BFloat16", "float"]}),  # the bf16 cast
        _x("cudaLaunchKernel", "cuda_runtime", 11, correlation=1),
        _x("aten::copy_", "cpu_op", 30, 5, **{"Input type": ["c10::BFloat16", "c10::BFloat16"]}),  # a staging copy
        _x("cudaMemcpyAsync", "cuda_runtime", 31, correlation=2),
        _x("lv::all_gather", "user_annotation", 50, 20),
        _x("ncclDevKernel_AllGather_RING_LL", "cuda_runtime", 51, correlation=3),
        _x("aten::mm", "cpu_op", 200, 5),  # outside every site
        _x("cudaLaunchKernel", "cuda_runtime", 201, correlation=4),
        _x("void direct_copy_kernel_cuda<float>", "kernel", 1000, tid=7, correlation=1),
        _x("Memcpy DtoD (Device -> Device)", "gpu_memcpy", 1010, tid=7, correlation=2),
        _x("ncclDevKernel_AllGather_RING_LL", "kernel", 1020, tid=8, correlation=3),
        _x("sm90_xmma_gemm_bf16", "kernel", 1030, tid=7, correlation=4),
    ]
    got = gpu_check.copies_at_collectives({"traceEvents": events}, "vescale")
    kinds = {(c["site"], c["kind"], c["work"][:6]) for c in got["copies"]}
    assert kinds == {("lv::unshard", "cast", "void d"), ("lv::unshard", "staging", "Memcpy")}
    assert got["sites"] == 2 and got["staging_copies"] == 1 and got["nccl_kernels"] == 1
    assert got["copies_adjacent_to_nccl"] == [{"nccl": "ncclDevKernel_AllGather_RING_LL",
                                               "neighbour": "Memcpy DtoD (Device -> Device)"}]


@pytest.mark.parametrize("engine", ["vescale", "fsdp2"])
def test_sites_of_each_engine(engine: str) -> None:
    sites = _gpu_check().SITES[engine]
    names = {"vescale": ["lv::unshard", "lv::reduce_grad", "lv::all_gather"],
             "fsdp2": ["FSDP::all_gather (layers.0)", "FSDP::pre_forward (layers.0)", "FSDP::post_backward_reduce"]}
    assert all(sites.match(n) for n in names[engine])
    assert not sites.match("aten::copy_") and not sites.match("FSDP::post_forward")
