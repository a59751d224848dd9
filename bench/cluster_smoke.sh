#!/usr/bin/env bash
# The same sweep config against a Ray cluster started separately on this machine (loopback
# only), then the cluster is stopped. Usage: bench/cluster_smoke.sh [CONFIG.toml]
set -euo pipefail
# A throwaway loopback cluster: no token authentication (Ray >= 2.5x enables it by default;
# on a real cluster give the driver the cluster's token instead).
export RAY_AUTH_MODE=disabled RAY_DISABLE_USAGE_STATS=1
cd "$(dirname "$0")/.."
BIN=.venv/bin
PORT=${PORT:-6389}
CFG=${1:-}
WORK=$(mktemp -d)
if [ -z "$CFG" ]; then
  CFG=$WORK/cluster.toml
  cat > "$CFG" <<'TOML'
[training]
epochs = 5
[sweep]
methods = ["dpsgd", "dpsgd_lf"]
trials_per_method = 2
TOML
fi
trap '$BIN/ray stop --force >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
$BIN/ray start --head --node-ip-address=127.0.0.1 --port="$PORT" --num-cpus=2 \
  --include-dashboard=false --disable-usage-stats
$BIN/ray status --address="127.0.0.1:$PORT" 2>/dev/null | head -20 || true
time $BIN/dpsweep run "$CFG" --address "127.0.0.1:$PORT" --out "$WORK/run"
$BIN/python - "$WORK/run" <<'PY'
import sys
from orchestrator import results
frame = results.read_results(sys.argv[1])
print(frame[["trial_id", "method", "status", "test_accuracy", "peak_mia_accuracy",
             "epsilon_upper"]].to_string(index=False))
PY
