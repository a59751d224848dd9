#!/usr/bin/env bash
# Issue 33's GPU measurements in one device-tool call (see bench/gpu_check.py's docstring):
#   prepare here:  make gpu-carry      (bench/wheels/*.whl and bench/data/fashion-mnist/)
#   on the device: run(command="GPU_CHECK_COMMIT=<sha> bash bench/gpu_check.sh",
#                      carry=["bench/wheels", "bench/data"], timeout_s=540)
#   (the device's copy of the tree has no .git: the commit travels in GPU_CHECK_COMMIT)
# Writes $OUT/gpu_check_<device>.json (rewritten after every section) and $OUT/gpu_check.log;
# extra arguments go to `python -m bench.gpu_check` (e.g. --budget 300 --sections timing).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
LOG="$OUT/gpu_check.log"
{
  echo "python: $PY ($("$PY" -V 2>&1)); out: $OUT"
  nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv 2>&1 || true
} | tee "$LOG"

# The carried pure-Python wheels (opacus, prv-accountant, dp-accounting and theirs): installed
# into the machine's Python when pip may, else unpacked and put on PYTHONPATH (spawned
# children inherit it). A failure here is not fatal: the sections that need them record it.
shopt -s nullglob
wheels=(bench/wheels/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  if ! "$PY" -m pip install --no-index --no-deps --quiet "${wheels[@]}" >>"$LOG" 2>&1 \
      && ! "$PY" -m pip install --no-index --no-deps --quiet --break-system-packages \
           "${wheels[@]}" >>"$LOG" 2>&1; then
    site="$(mktemp -d)/site"
    mkdir -p "$site"
    for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$site" >>"$LOG" 2>&1 || true; done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "wheels unpacked into $site (pip refused)" | tee -a "$LOG"
  else
    echo "wheels installed: ${wheels[*]}" | tee -a "$LOG"
  fi
else
  echo "no bench/wheels/*.whl: run 'make gpu-carry' and carry bench/wheels" | tee -a "$LOG"
fi

"$PY" -m bench.gpu_check --out "$OUT" "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
