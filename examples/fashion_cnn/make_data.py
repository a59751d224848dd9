"""Write Fashion-MNIST (Debian's IDX files, `make data`) as fashion.npz: arrays x [N, 1, 28, 28]
uint8 and y [N] int64, the way a user's own image data would arrive.

    python examples/fashion_cnn/make_data.py [--limit N]
"""

import argparse
from pathlib import Path

import numpy as np

from dpsweep.trainables.data.splits import load_pool

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=0, help="first N examples only (0 = all)")
    parser.add_argument("--out", type=Path, default=HERE / "fashion.npz")
    args = parser.parse_args()
    pool = load_pool(dataset="fashion-mnist")
    n = args.limit or len(pool.y)
    np.savez_compressed(args.out, x=pool.x[:n], y=pool.y[:n].astype(np.int64))
    print(f"wrote {args.out}: {n} images")


if __name__ == "__main__":
    main()
