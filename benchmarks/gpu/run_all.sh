#!/usr/bin/env bash
# The GPU check in one command, for a device session of ~15 minutes (issue 41 item 5): every section of
# benchmarks/gpu/check.py within a 9-minute budget, its figures in $OUT/gpu_check.json (rewritten after every
# section) and the whole log in $OUT/gpu_check.log. Run from the repository root:
#     OUT=/some/dir bash benchmarks/gpu/run_all.sh            # on the CUDA machine
#     bash benchmarks/gpu/run_all.sh --smoke                  # the same code paths on the CPU (CI-sized)
# Extra arguments go to check.py. PYTHON picks the interpreter (default: python3).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-check-out}"
BUDGET_S="${BUDGET_S:-540}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_ENABLE_TELEMETRY=false DO_NOT_TRACK=1
PY="${PYTHON:-python3}"
{
  echo "[gpu-check] $(date -u +%FT%TZ) $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  # the budget bounds the sections; the outer timeout is the last resort (a hang inside a native call)
  timeout --signal=TERM --kill-after=20 $((BUDGET_S + 60)) "$PY" benchmarks/gpu/check.py --out "$OUT" --budget-s "$BUDGET_S" "$@"
  rc=$?
  echo "[gpu-check] exit $rc; figures in $OUT/gpu_check.json"
  exit $rc
} 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
