"""What the W4A8 path's sign fold and its int8 rounding each cost one linear layer; prints its figures.

Marlin's int8-activation kernel reads group scales as unsigned, so marlin-int8-signed-scales folds a negative scale's
sign into the codes, and -8 under a negative scale comes back as +7. How often that happens depends on the codes:
the stand-in's (servekit/image/standin.py, AutoRound's shape: each group's largest weight at -8) against uniform
random codes (the stand-in before). For each: the relative RMS error of the layer's output with the folded weights,
and with the input rounded to int8 per token (vLLM's per_token_quant_int8 arithmetic) as the other term of W4A8.

Run: .venv/bin/python bench/w4a8_fold_error.py [--rows N] [--columns N] [--tokens N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from servekit.image import standin  # noqa: E402


def relative_error(exact: np.ndarray, approximate: np.ndarray) -> float:
    return float(np.sqrt(((approximate - exact) ** 2).sum() / (exact ** 2).sum()))


def layer_errors(codes: np.ndarray, scales: np.ndarray, inputs: np.ndarray) -> dict[str, float]:
    per_weight = np.repeat(scales.astype(np.float64), standin.GROUP, axis=1)
    weights = (codes - 8) * per_weight
    negative = per_weight < 0
    # marlin-int8-signed-scales' fold_negative_group_scales (vLLM's code, in the image only), in numpy
    folded = (np.where(negative, np.minimum(16 - codes, 15), codes) - 8) * np.abs(per_weight)
    exact = inputs @ weights.T
    step = np.abs(inputs).max(axis=1, keepdims=True) / 127  # per token, the largest magnitude over 127
    rounded = np.round(inputs / step) * step
    return {"fold": relative_error(exact, inputs @ folded.T), "int8 input": relative_error(exact, rounded @ weights.T),
            "weights a step short": float(((codes == 0) & negative).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--columns", type=int, default=5120)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    inputs = rng.standard_normal((args.tokens, args.columns))
    written = standin.Weights(0, 1).int4("layer", args.rows, args.columns)
    scales = written["layer.weight_scale"].astype(np.float32)
    cases = {"AutoRound's shape (the stand-in)": standin.int4_codes(written["layer.weight_packed"]),
             "uniform codes": rng.integers(0, 16, size=(args.rows, args.columns))}
    print(f"one {args.rows} x {args.columns} layer, {args.tokens} normal inputs, the stand-in's scales "
          f"({(scales < 0).mean():.0%} negative); relative RMS error of the output:")
    for name, codes in cases.items():
        errors = layer_errors(codes, scales, inputs)
        print(f"  {name}: the sign fold {errors['fold']:.1%}, the int8 input {errors['int8 input']:.1%} "
              f"({errors['weights a step short']:.2%} of the weights a step short)")


if __name__ == "__main__":
    main()
