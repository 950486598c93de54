#!/usr/bin/env bash
# One GPU check, prepared for the first device (nothing to download, at most 8 minutes on one GPU):
#
#   OUT=/some/empty/dir bash benchmarks/gpu_check.sh
#
# (1) the environment; (2) tokens/s, MFU and torch.cuda.max_memory_allocated / reserved of a Llama-1B-shaped model in
# bf16 mixed precision, lightning-vescale vs torch FSDP2 at N = 1 (each engine in its own process); (3) a torch.profiler
# summary of one step and the copy kernels at the collectives; (4) the host memory tier (optimizer states in pinned
# host memory) against device-only; (5) the block-quantized AllGather (FP8, INT8) against bf16. Results:
# $OUT/gpu_check_summary.md and .json, $OUT/parts/*.json, $OUT/logs/*.log (tracebacks), $OUT/profile_*.
#
# Without CUDA it is a dry check (tiny model, gloo, a step or two; about a minute on 2 CPU cores): each part runs its
# code and reports "SKIP (no CUDA): ..." for the measurements that need a GPU. Knobs (environment): GPU_CHECK_BUDGET_S
# (total seconds, 450), GPU_CHECK_PART_TIMEOUT_S (per part, 150), and those listed in benchmarks/gpu_check.py.
# Exit status 0 when no part failed.
set -u

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO/gpu_check_out}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
PART_TIMEOUT_S="${GPU_CHECK_PART_TIMEOUT_S:-150}"
RESERVE_S=20  # kept back for the summary
PY="${PYTHON:-$(command -v python || command -v python3 || echo python)}"
mkdir -p "$OUT/logs" "$OUT/parts"
export OUT
START=$(date +%s)
cd "$REPO" || exit 1

say() { echo "[gpu_check] $*" | tee -a "$OUT/logs/gpu_check.log"; }

fail_summary() {  # when Python itself cannot run the parts
  printf '# GPU check summary\n\noverall: **FAIL**\n\n%s\n\nSee logs/setup.log.\n' "$1" > "$OUT/gpu_check_summary.md"
  printf '{"overall": "FAIL", "reason": "%s"}\n' "$1" > "$OUT/gpu_check_summary.json"
  say "FAIL: $1"
  exit 1
}

# 0. torch and lightning_vescale importable? If not: this checkout on PYTHONPATH, then an offline editable install.
check_import() { "$PY" -c "import torch, lightning_vescale; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'lightning_vescale', lightning_vescale.__file__)" >> "$OUT/logs/setup.log" 2>&1; }
say "repo $REPO, OUT $OUT, budget ${BUDGET_S}s, commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'unknown (no .git)')"
if ! "$PY" -c "import torch" >> "$OUT/logs/setup.log" 2>&1; then
  fail_summary "torch is not importable with $PY: this script installs nothing from the network; install torch first"
fi
if ! check_import; then
  say "lightning_vescale not importable; trying PYTHONPATH=$REPO"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  if ! check_import; then
    say "still not importable; trying an offline editable install (pip install --no-index --no-build-isolation --no-deps -e .)"
    "$PY" -m pip install --no-index --no-build-isolation --no-deps -e "$REPO" >> "$OUT/logs/setup.log" 2>&1 \
      || say "pip install -e . failed offline (see logs/setup.log)"
    check_import || fail_summary "lightning_vescale is not importable (PYTHONPATH and an offline pip install -e . both failed; missing dependencies are in logs/setup.log)"
  fi
fi
# lightning_vescale must be this checkout, not another install of it.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
tail -n 1 "$OUT/logs/setup.log" | tee -a "$OUT/logs/gpu_check.log"

# 1-5. Each part in its own process under the remaining budget.
run_part() {  # name, then the arguments of benchmarks/gpu_check.py
  local name="$1"; shift
  local left=$(( BUDGET_S - RESERVE_S - ($(date +%s) - START) ))
  local limit=$(( left < PART_TIMEOUT_S ? left : PART_TIMEOUT_S ))
  if (( limit < 10 )); then
    say "$name: not run (the time budget is spent)"
    echo "budget" > "$OUT/logs/$name.rc"
    return
  fi
  say "$name: starting (at most ${limit}s)"
  local t0=$(date +%s)
  if command -v timeout > /dev/null; then
    timeout -k 10 "$limit" "$PY" "$REPO/benchmarks/gpu_check.py" "$@" > "$OUT/logs/$name.log" 2>&1
  else  # no coreutils timeout: the part runs unbounded
    "$PY" "$REPO/benchmarks/gpu_check.py" "$@" > "$OUT/logs/$name.log" 2>&1
  fi
  local rc=$?
  echo "$rc" > "$OUT/logs/$name.rc"
  local status="FAIL (exit $rc$( ((rc == 124 || rc == 137)) && echo ', timed out'))"
  [[ -f "$OUT/parts/$name.json" ]] && status="$(grep -m1 '"status"' "$OUT/parts/$name.json" | sed 's/.*: "\(.*\)".*/\1/')"
  say "$name: $status in $(( $(date +%s) - t0 ))s"
  grep -h '^\[gpu_check\]' "$OUT/logs/$name.log" | grep -v ': starting' | tee -a "$OUT/logs/gpu_check.log" >/dev/null
}

run_part env env
run_part train_vescale train --engine vescale
run_part train_fsdp2 train --engine fsdp2
run_part profile profile
run_part host_tier host_tier
run_part quant quant

"$PY" "$REPO/benchmarks/gpu_check.py" summary > "$OUT/logs/summary.log" 2>&1 \
  || fail_summary "the summary failed: $(tail -n 3 "$OUT/logs/summary.log")"
cat "$OUT/logs/summary.log"
say "done in $(( $(date +%s) - START ))s: $OUT/gpu_check_summary.md"
grep -q '"overall": "FAIL"' "$OUT/gpu_check_summary.json" && exit 1
exit 0
