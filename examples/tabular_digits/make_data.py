"""Write scikit-learn's digits as a Parquet table (64 pixel columns and ``label``): a real
table available offline.

    python examples/tabular_digits/make_data.py
"""

from pathlib import Path

from sklearn.datasets import load_digits

HERE = Path(__file__).resolve().parent


def main(out: Path = HERE / "digits.parquet") -> Path:
    frame = load_digits(as_frame=True).frame.rename(columns={"target": "label"})
    frame.to_parquet(out, index=False)
    print(f"wrote {out}: {len(frame)} rows, {frame.shape[1] - 1} features")
    return out


if __name__ == "__main__":
    main()
