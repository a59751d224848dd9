#!/usr/bin/env bash
# Build the report of a run directory and screenshot it with headless Chromium, to look at it.
#
#   bench/render_report.sh [RUN_DIR] [OUT_DIR]
#
# Without RUN_DIR it first writes the synthetic run directory the report tests use
# (bench/synthetic_run.py: two targets, five series, ties, a replayable, a degenerate and a
# failed trial, re-runs, canary bounds, the non-private baseline; no training, a few seconds).
# Screenshots go to OUT_DIR (default RUN_DIR/screenshots):
#   desktop.png         the whole page at 1440 px wide
#   laptop.png          the first screen of a 1280 x 800 laptop
#   laptop_full.png     the whole page at 1280 px wide
#   desktop_NN.png      the desktop page cut into 1,600 px slices (easier to look at)
#   open.png            the whole page at 1440 px with every folded section opened
#   open_NN.png         open.png cut into 1,600 px slices
# Installs Debian's chromium when it is missing (needs root and the network). Not part of CI.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
cd "$ROOT"

RUN_DIR="${1:-}"
if [[ -z "$RUN_DIR" ]]; then
    WORK="$(mktemp -d -t dpsweep-render-XXXXXX)"
    echo "writing the synthetic run directory in $WORK/run"
    PYTHONPATH="$ROOT" "$PY" -c 'import sys; from pathlib import Path
from bench.synthetic_run import make_run
print(make_run(Path(sys.argv[1])))' "$WORK" >/dev/null
    RUN_DIR="$WORK/run"
fi
RUN_DIR="$(cd "$RUN_DIR" && pwd)"
OUT="${2:-$RUN_DIR/screenshots}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

HTML="$(PYTHONPATH="$ROOT" "$PY" -c 'import sys; from pathlib import Path
from dpsweep.orchestrator.report import run_report
print(run_report(Path(sys.argv[1])))' "$RUN_DIR")"
echo "report: $HTML"

CHROMIUM="$(command -v chromium || command -v chromium-browser || true)"
if [[ -z "$CHROMIUM" ]]; then
    echo "installing chromium (Debian package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    CHROMIUM="$(command -v chromium)"
fi

PROFILES=()
cleanup() { rm -rf "${PROFILES[@]}"; }
trap cleanup EXIT

shoot() {  # shoot WIDTH HEIGHT PNG HTML
    local profile
    profile="$(mktemp -d -t dpsweep-chromium-XXXXXX)"
    PROFILES+=("$profile")
    "$CHROMIUM" --headless --no-sandbox --disable-gpu --disable-background-networking \
        --disable-component-update --disable-sync --no-first-run --hide-scrollbars \
        --user-data-dir="$profile" --window-size="$1,$2" --screenshot="$3" \
        "file://$4" 2>/dev/null
}

# A window taller than the page shows all of it; the blank space below is trimmed afterwards.
FULL_HEIGHT="${HEIGHT:-24000}"
shoot 1440 "$FULL_HEIGHT" "$OUT/desktop.png" "$HTML"
shoot 1280 800 "$OUT/laptop.png" "$HTML"
shoot 1280 "$FULL_HEIGHT" "$OUT/laptop_full.png" "$HTML"
# The folded sections (<details>) opened, in a copy beside the page (its links still resolve).
OPENED="$(dirname "$HTML")/.opened.html"
PROFILES+=("$OPENED")
sed -e 's/<details\([ >]\)/<details open\1/g' "$HTML" >"$OPENED"
shoot 1440 "$((FULL_HEIGHT * 2))" "$OUT/open.png" "$OPENED"

"$PY" - "$OUT" <<'EOF'
import sys
from pathlib import Path

from PIL import Image, ImageOps

SLICE = 1600
out = Path(sys.argv[1])
for name in ("desktop.png", "laptop_full.png", "open.png"):
    image = Image.open(out / name).convert("RGB")
    box = ImageOps.invert(image).getbbox()
    if box:
        image = image.crop((0, 0, image.width, min(image.height, box[3] + 40)))
        image.save(out / name)
    stem = name.removesuffix(".png")
    if stem in ("desktop", "open"):
        for old in out.glob(f"{stem}_*.png"):
            old.unlink()
        for k, top in enumerate(range(0, image.height, SLICE)):
            image.crop((0, top, image.width, min(image.height, top + SLICE))).save(
                out / f"{stem}_{k + 1:02d}.png")
    print(f"{name}: {image.width} x {image.height} px")
EOF
echo "screenshots: $OUT"
