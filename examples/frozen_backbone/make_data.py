"""Write the frozen-backbone example's inputs: scikit-learn's digits as 32 x 32 RGB PNG class
folders (``digits_png/<class>/<n>.png``; the last 8 images left out, 1,789 in all), a backbone
weights file (``backbone.pt``, the stand-in for a downloaded pretrained backbone), and
``sweep.toml`` from ``sweep.template.toml`` with the weights' absolute path: Ray ships this
folder's Python files to the workers, not its data or weights, so a weights file is named by a
path every worker can read (on a cluster: shared storage).

    python examples/frozen_backbone/make_data.py
    dpsweep run examples/frozen_backbone/sweep.toml --out runs/frozen_backbone
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.datasets import load_digits

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from backbone_model import make_backbone  # noqa: E402

SIDE = 32
LEFT_OUT = 8
PIXEL_MAX = 16
BACKBONE_SEED = 0


def write_images(out: Path) -> int:
    digits = load_digits()
    x, y = digits.images[:-LEFT_OUT], digits.target[:-LEFT_OUT]
    for n, (image, label) in enumerate(zip(x, y, strict=True)):
        folder = out / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image / PIXEL_MAX * 255).astype(np.uint8)
        Image.fromarray(pixels, mode="L").resize((SIDE, SIDE), Image.BILINEAR) \
            .convert("RGB").save(folder / f"{n:04d}.png")
    return len(x)


def main() -> None:
    count = write_images(HERE / "digits_png")
    torch.manual_seed(BACKBONE_SEED)
    weights = HERE / "backbone.pt"
    torch.save(make_backbone().state_dict(), weights)
    template = (HERE / "sweep.template.toml").read_text()
    (HERE / "sweep.toml").write_text(template.replace("@WEIGHTS@", str(weights)))
    print(f"wrote {count} images under {HERE / 'digits_png'}, {weights} and "
          f"{HERE / 'sweep.toml'}")


if __name__ == "__main__":
    main()
