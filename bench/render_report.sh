#!/usr/bin/env bash
# Build the report of a run directory and screenshot it with headless Chromium, to look at it.
#
#   bench/render_report.sh [RUN_DIR] [SCREENSHOT.png]
#
# Without RUN_DIR it first makes a tiny real run in a temporary directory: six digits trials
# (dpsgd x2, ww_dpsgd, dp_adamilg public and faithful, dpsgd_lf; 3 epochs each), one failed row,
# the per-layer audit, then the report (about a minute on two CPU cores). The screenshot goes to
# SCREENSHOT.png (default: RUN_DIR/report_screenshot.png). Installs Debian's chromium when it is
# missing (needs root and the network). Not part of CI.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
cd "$ROOT"

RUN_DIR="${1:-}"
if [[ -z "$RUN_DIR" ]]; then
    WORK="$(mktemp -d -t dpsweep-render-XXXXXX)"
    RUN_DIR="$WORK/run"
    echo "making a tiny run in $RUN_DIR"
    # A file, not stdin: the accountant's worker processes (spawn) re-import __main__.
    cat >"$WORK/make_run.py" <<'EOF'
import dataclasses
import sys
from pathlib import Path

from orchestrator.config import Config, TrainingConfig
from orchestrator.results import TRIALS_DIR, append_row, collect_trials, failed_row
from orchestrator.trial import load_data, plan_trial
from reports.audit import audit_run
from trainables.training import train_trial


def main(run: Path) -> None:
    run.mkdir(parents=True)
    trials = [
        ("dpsgd", {"lr": 1.0}, {}),
        ("dpsgd", {"lr": 0.3}, {}),
        ("ww_dpsgd", {"lr": 1.0}, {"K": 5}),
        ("dp_adamilg", {"lr": 0.01}, {"mode": "public"}),
        ("dp_adamilg", {"lr": 0.01}, {"mode": "faithful"}),
        ("dpsgd_lf", {"lr": 1.0}, {}),
    ]
    data = None
    for i, (method, training, params) in enumerate(trials):
        cfg = dataclasses.replace(
            Config(), method_params=params,
            training=TrainingConfig(method=method, epochs=3, batch_size=60, clip_norm=1.0,
                                    seed=i, **training))
        data = data or load_data(cfg)
        spec = plan_trial(cfg, trial_id=f"t{i + 1}", data=data)
        train_trial(spec, data=data, checkpoint_root=run / TRIALS_DIR / f"t{i + 1}")
    collect_trials(run)
    append_row(run, failed_row(trial_id=f"t{len(trials) + 1}", method="ww_dpsgd",
                               error="TrialDiverged: train loss became nan in epoch 2",
                               spec={"seed": 9, "lr": 50.0, "clip_norm": 1.0}))
    audit_run(run, shadow_models=1, seed=0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
EOF
    (cd "$ROOT" && PYTHONPATH="$ROOT" "$PY" "$WORK/make_run.py" "$RUN_DIR")
fi
RUN_DIR="$(cd "$RUN_DIR" && pwd)"
SHOT="${2:-$RUN_DIR/report_screenshot.png}"

HTML="$("$PY" -c 'import sys; from pathlib import Path; from reports.html import build_report
print(build_report(Path(sys.argv[1])))' "$RUN_DIR")"
echo "report: $HTML"

if ! command -v chromium >/dev/null 2>&1; then
    echo "installing chromium (Debian package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

PROFILE="$(mktemp -d -t dpsweep-chromium-XXXXXX)"
trap 'rm -rf "$PROFILE"' EXIT
# Tall window: the whole page in one image (the report is ~7,000 px at this width).
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --hide-scrollbars --user-data-dir="$PROFILE" --window-size=1400,"${HEIGHT:-9000}" \
    --screenshot="$SHOT" "file://$HTML" 2>/dev/null
# Trim the blank space below the page's end (the window is taller than the page).
"$PY" - "$SHOT" <<'EOF'
import sys

from PIL import Image, ImageOps

image = Image.open(sys.argv[1]).convert("RGB")
box = ImageOps.invert(image).getbbox()
if box:
    image.crop((0, 0, image.width, min(image.height, box[3] + 40))).save(sys.argv[1])
EOF
echo "screenshot: $SHOT"
