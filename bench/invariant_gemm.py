#!/usr/bin/env python3
"""The batch-invariant mode's GEMM against cuBLAS, at a model's projection shapes (issue #53's cost).

For each projection of ``--model`` (Llama-3-8B by default: qkv, o, gate_up, down, the LM head) and each ``--rows``
M: ``F.linear`` (cuBLAS) and :func:`~treedec.kernels.batch_invariant_matmul.batch_invariant_matmul` with its
tiling (:func:`~treedec.kernels.batch_invariant_matmul.batch_invariant_tiles`), the median of
``triton.testing.do_bench``, checked first: the product within bf16 rounding of fp32 ``F.linear``, and a row
computed in a batch of M equal to the same row alone. ``--sweep`` also times candidate tilings (K splits x block
shapes x stages x warps) to choose the rule from; the whole step's GEMM time (the sum over the projections, times
the layers) is reported per M and tiling.

    python bench/invariant_gemm.py                      # GPU: llama3-8b shapes, M = 1, 64, 256
    python bench/invariant_gemm.py --sweep --out bench/results
    python bench/invariant_gemm.py --smoke              # tiny shapes (CI; without CUDA: the interpreter)

Results: ``<out>/<date>-<device>-invariant-gemm[-tag].json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.results_file import device_name, versions, write_results  # noqa: E402
from treedec.models.config import MODEL_SIZES  # noqa: E402

#: block_m, block_n, block_k, num_stages, num_warps of the swept tilings (each with every split count). A tiling
#: of block_m < 64 is timed only at M <= 64: it is a candidate for a decode-size GEMM chosen by M (the default
#: mode may choose by M; the batch-invariant mode may not).
SHAPES = ((64, 128, 64, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 3, 8), (64, 64, 64, 5, 4), (64, 256, 64, 3, 8),
          (64, 64, 256, 3, 4), (64, 128, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 3, 4),
          (32, 64, 128, 4, 4))
SPLITS = (1, 2, 3, 4, 6, 8)


def projections(config) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, count per forward) of the model's GEMMs."""
    h, layers = config.hidden_size, config.num_layers
    return {"qkv": (config.qkv_size, h, layers), "o": (h, config.num_heads * config.head_dim, layers),
            "gate_up": (2 * config.intermediate_size, h, layers), "down": (h, config.intermediate_size, layers),
            "lm_head": (config.vocab_size, h, 1)}


def _time(fn, device) -> float:
    if device.type != "cuda":   # (the interpreter: one timed call, for the smoke run)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=40)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODEL_SIZES))
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--sweep", action="store_true", help="also time the candidate tilings")
    parser.add_argument("--smoke", action="store_true", help="the tiny model's shapes, M = 1, 3 (without CUDA: the interpreter, CI)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.rows = "tiny", "1,3"
        if not torch.cuda.is_available():   # (read when the kernels are decorated: before their import below)
            import os
            os.environ.setdefault("TRITON_INTERPRET", "1")
    from treedec.kernels.batch_invariant_matmul import MatmulTiles, sm_count, batch_invariant_matmul, \
        batch_invariant_tiles
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator(device).manual_seed(0)
    results = {"device": device_name(device), "versions": versions("triton"), "date": time.strftime("%Y-%m-%d"),
               "model": args.model, "dtype": str(dtype), "rows": rows, "projections": {}, "step_ms": {}}
    sms = sm_count(device)
    for name, (n, k, count) in projections(MODEL_SIZES[args.model]).items():
        w = torch.randn(n, k, generator=g, device=device, dtype=dtype) / k ** 0.5
        default = batch_invariant_tiles(n, k, sms, w.element_size())
        tilings = {"default": default}
        if args.sweep:
            for bm, bn, bk, stages, warps in SHAPES:
                for splits in SPLITS:
                    split_k = -(-(-(-k // bk)) // splits) * bk
                    if -(-k // split_k) == splits:   # (a split count that leaves none empty)
                        tilings[f"m{bm}n{bn}k{bk}s{stages}w{warps}x{splits}"] = MatmulTiles(bm, bn, bk, warps, stages,
                                                                                            splits, split_k)
        found = results["projections"][name] = {"n": n, "k": k, "count": count,
                                                "default_tiles": dataclasses.asdict(default), "ms": {}}
        for m in rows:
            x = torch.randn(m, k, generator=g, device=device, dtype=dtype)
            reference = torch.nn.functional.linear(x.float(), w.float())
            times = found["ms"][str(m)] = {"cublas": _time(lambda: torch.nn.functional.linear(x, w), device)}
            for label, tiles in tilings.items():
                if tiles.block_m < 64 and m > 64:
                    continue
                y = batch_invariant_matmul(x, w, tiles=tiles)
                error = (y.float() - reference).abs().max().item() / reference.abs().max().item()
                alone = batch_invariant_matmul(x[m - 1:], w, tiles=tiles)
                if error > 2e-2 or not torch.equal(alone, y[m - 1:]):
                    raise AssertionError(f"{name} M={m} {label}: relative error {error:.3g}, row alone == in "
                                         f"batch: {torch.equal(alone, y[m - 1:])}")
                times[label] = _time(lambda: batch_invariant_matmul(x, w, tiles=tiles), device)
            best = min((t, label) for label, t in times.items() if label != "cublas")
            print(f"{name:8s} N={n:6d} K={k:5d} M={m:4d}: cuBLAS {times['cublas'] * 1e3:8.1f} us, default "
                  f"{times['default'] * 1e3:8.1f} us ({times['default'] / times['cublas']:.2f}x)"
                  + (f", best {best[1]} {best[0] * 1e3:8.1f} us ({best[0] / times['cublas']:.2f}x)" if args.sweep
                     else ""))
    for m in rows:
        labels = [label for label in results["projections"]["qkv"]["ms"][str(m)]
                  if all(label in p["ms"][str(m)] for p in results["projections"].values())]
        results["step_ms"][str(m)] = {label: sum(p["ms"][str(m)][label] * p["count"]
                                                 for p in results["projections"].values()) for label in labels}
        step = results["step_ms"][str(m)]
        print(f"M={m}: a forward's GEMMs: cuBLAS {step['cublas']:.2f} ms, default tiling {step['default']:.2f} ms "
              f"({step['default'] / step['cublas']:.2f}x)")
    write_results(results, args.out, "invariant-gemm", smoke=args.smoke, tag=args.tag or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
