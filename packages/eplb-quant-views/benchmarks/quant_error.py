"""Quantization error of each format's reference kernel against a float64 fused MoE.

Prints, per format, the documented bound and the measured relative Frobenius error
(`ascend_eplb.quant_views.quantization_error`) over several seeds, at the size the tests use and at a
larger one. Run (repository root): ``hatch run python packages/eplb-quant-views/benchmarks/quant_error.py``.
"""

from __future__ import annotations

import argparse

import torch

from ascend_eplb.quant_views import get_format, quantization_error, supported_formats

SIZES = {
    "test (p=4, H=128, I=64, T=24, K=2)": dict(
        num_experts=4, hidden_size=128, intermediate_size=64, num_tokens=24
    ),
    "large (p=8, H=512, I=256, T=64, K=2)": dict(
        num_experts=8, hidden_size=512, intermediate_size=256, num_tokens=64
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="seeds per size (default 10)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = ["format", "bound"] + [f"max {k}" for k in SIZES] + ["mean (large)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in supported_formats():
        fmt = get_format(name)
        cells = [name, f"{fmt.error_bound:.3g}"]
        mean = 0.0
        for size in SIZES.values():
            errs = [quantization_error(fmt, seed=s, **size) for s in range(args.seeds)]
            cells.append(f"{max(errs):.4f}")
            mean = sum(errs) / len(errs)
        cells.append(f"{mean:.4f}")
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
