"""fp8 projections of few rows: the weight-only GEMV against torch._scaled_mm and the bf16 GEMM (issue #52).

For each projection of a model shape (Llama-3-8B's by default: qkv, o, gate_up, down, the LM head) and each row
count (``--rows``, default 1, 2, 4, 8, 16, 32, 64), the median us per call (``triton.testing.do_bench``, L2
flushed) of: the bf16 ``F.linear``; :func:`treedec.models.fp8.scaled_mm` (the activations quantized per row,
``torch._scaled_mm``); the weight-only GEMV (:mod:`treedec.kernels.fp8_gemv`, at most 16 rows); the fp8 x fp8
Triton GEMM (:mod:`treedec.kernels.fp8_matmul`) with the rows quantized by torch (``fp8_matmul``: eager, each
quantization's kernels timed; under ``torch.compile`` they fuse with the step's norm) and on rows quantized
beforehand (``fp8_matmul_gemm``: the GEMM alone); and each one's
weight bandwidth (weight bytes / time) against the copy bandwidth measured first. Correctness first: each
method's output against the fp32 product of the same de-quantized weights (relative error, recorded).

    python bench/fp8_gemv.py                              # GPU: llama3-8b's projections
    python bench/fp8_gemv.py --model qwen3-8b --rows 1,4,16
    python bench/fp8_gemv.py --sweep --rows 1,8            # GPU: every GEMV tile schedule, the best per shape
    python bench/fp8_gemv.py --sweep-matmul --rows 1,16,64,256   # GPU: fp8 GEMM tilings, the best per shape

``--sweep`` times the GEMV under every schedule of a grid (tile width, K tile, K splits, tensor cores or not,
warps, stages) for each projection and row count and prints the best beside :func:`launch_config`'s choice
(what the heuristic is tuned from).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.results_file import device_name, versions, write_results  # noqa: E402
from bench.timing import copy_bandwidth  # noqa: E402
from treedec.models import ModelConfig  # noqa: E402
from treedec.models.fp8 import dequantize, quantize_rows, scaled_mm  # noqa: E402


def projections(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """name -> (out features N, in features K) of one layer's projections and the LM head."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b", help="a named size of treedec.models.MODEL_SIZES")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64", help="row counts (comma-separated)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--tag", default="")
    parser.add_argument("--sweep", action="store_true", help="time every GEMV schedule of a grid (see above)")
    parser.add_argument("--sweep-matmul", action="store_true", help="time fp8 x fp8 GEMM tilings (block shapes, "
                        "stages, K splits) per projection and row count, beside fp8_matmul_tiles' choice")
    parser.add_argument("--sweep-schedules", choices=["all", "swap_ab"], default="all",
                        help="the sweep's grid: every schedule, or the swapped-operand ones only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp8_gemv.py needs a CUDA device (tests/kernels/test_fp8_gemv.py checks the kernel "
                         "on the CPU)")
    from triton.testing import do_bench

    from treedec.kernels.fp8_gemv import MAX_ROWS, fp8_gemv
    from treedec.kernels.fp8_matmul import fp8_matmul
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    rows_list = [int(r) for r in args.rows.split(",")]
    config = ModelConfig.from_name(args.model)
    results = {"device": device_name(device), "date": datetime.date.today().isoformat(),
               "versions": versions("triton"), "model": args.model, "copy_bandwidth_TBps": bandwidth / 1e12,
               "runs": []}
    if args.sweep:
        return sweep(results, config, rows_list, args, do_bench, bandwidth)
    if args.sweep_matmul:
        return sweep_matmul(results, config, rows_list, args, do_bench, bandwidth)
    print(f"{results['device']}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, {args.model}; us per call "
          "(weight TB/s)")
    shown = ("bf16", "scaled_mm", "gemv", "fp8_matmul", "fp8_matmul_gemm")
    print(f"{'projection':>10} {'rows':>5} " + " ".join(f"{m_:>16}" for m_ in shown) + "  rel err (fp8 ones)")
    gen = torch.Generator(device).manual_seed(0)
    for name, (n, k) in projections(config).items():
        w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
        q, s = quantize_rows(w)
        s = s.view(-1)
        w_deq = dequantize(q, s, torch.bfloat16)
        for m in rows_list:
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            ref = x.float() @ dequantize(q, s, torch.float32).T
            methods = {"bf16": lambda x=x, w=w_deq: F.linear(x, w),
                       "scaled_mm": lambda x=x, q=q, s=s: scaled_mm(x, q, s, None)}
            if m <= MAX_ROWS:
                methods["gemv"] = lambda x=x, q=q, s=s: fp8_gemv(x, q, s)
            xq, x_scale = quantize_rows(x)
            methods["fp8_matmul"] = lambda x=x, q=q, s=s: fp8_matmul(*quantize_rows(x), q, s, None, torch.bfloat16)
            methods["fp8_matmul_gemm"] = lambda xq=xq, xs=x_scale, q=q, s=s: fp8_matmul(xq, xs, q, s, None,
                                                                                    torch.bfloat16)
            run = {"projection": name, "N": n, "K": k, "rows": m}
            for method, fn in methods.items():
                out = fn().float()
                run[f"{method}_rel_err"] = float((out - ref).norm() / ref.norm())
                us = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
                weight_bytes = n * k * (2 if method == "bf16" else 1)
                run[f"{method}_us"], run[f"{method}_TBps"] = us, weight_bytes / (us * 1e-6) / 1e12
            results["runs"].append(run)
            cells = [f"{run[f'{m_}_us']:8.1f} ({run[f'{m_}_TBps']:4.2f})" if f"{m_}_us" in run else f"{'-':>16}"
                     for m_ in shown]
            errs = ", ".join(f"{run[f'{m_}_rel_err']:.1e}" for m_ in shown[1:] if f"{m_}_rel_err" in run)
            print(f"{name:>10} {m:>5} {' '.join(cells)}  {errs}", flush=True)
    write_results(results, args.out, "fp8-gemv", tag=args.tag or None)


def sweep(results: dict, config: ModelConfig, rows_list: list[int], args, do_bench, bandwidth: float) -> None:
    from treedec.kernels.fp8_gemv import MAX_ROWS, GemvConfig, _sm_count, launch, launch_config
    device = torch.device("cuda")
    sms = _sm_count(device)
    grid = [GemvConfig(bn, bk, sk, dot, w, st, swap) for (dot, swap), bn, bk, sk, w, st in itertools.product(
        ((False, False), (True, False), (True, True)), (16, 32, 64, 128), (128, 256, 512), (1, 2, 4, 8), (4, 8),
        (3,)) if args.sweep_schedules == "all" or swap]
    gen = torch.Generator(device).manual_seed(0)
    print(f"{results['device']}: GEMV schedules, us (weight TB/s of {bandwidth / 1e12:.2f})")
    for name, (n, k) in projections(config).items():
        if name == "lm_head":   # (the LM head stays in the model dtype: Fp8Linear never holds it)
            continue
        q, s = quantize_rows(torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02)
        s = s.view(-1)
        for m in (r for r in rows_list if r <= MAX_ROWS):
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            ref = x.float() @ dequantize(q, s, torch.float32).T
            timed = []
            for cfg in grid:
                if cfg.block_k * cfg.split_k > k or (not cfg.dot and cfg.block_n * cfg.block_k > 16384):
                    continue
                try:
                    out = launch(x, q, s, None, cfg).float()
                except Exception as e:  # a schedule Triton cannot compile (resources): skipped, said
                    print(f"  {name} m={m} {cfg}: {type(e).__name__}", flush=True)
                    continue
                if float((out - ref).norm() / ref.norm()) > 1e-2:
                    raise SystemExit(f"{name} m={m} {cfg}: wrong result")
                timed.append((do_bench(lambda cfg=cfg: launch(x, q, s, None, cfg), warmup=5, rep=10,
                                       return_mode="median") * 1e3, cfg))
            timed.sort(key=lambda t: t[0])
            chosen = launch_config(m, n, k, sms)
            chosen_us = do_bench(lambda: launch(x, q, s, None, chosen), warmup=5, rep=20, return_mode="median") * 1e3
            best_us, best = timed[0]
            results["runs"].append({"projection": name, "N": n, "K": k, "rows": m, "best_us": best_us,
                                    "best": vars(best), "chosen_us": chosen_us, "chosen": vars(chosen),
                                    "top5": [(us, vars(c)) for us, c in timed[:5]]})
            print(f"{name:>8} m={m:<2} best {best_us:6.1f} us ({n * k / best_us / 1e6:4.2f} TB/s) {best}; "
                  f"heuristic {chosen_us:6.1f} us {chosen}", flush=True)
    write_results(results, args.out, "fp8-gemv-sweep", tag=args.tag or None)


def sweep_matmul(results: dict, config: ModelConfig, rows_list: list[int], args, do_bench, bandwidth: float) -> None:
    from treedec.kernels.batch_invariant_matmul import MatmulTiles, sm_count
    from treedec.kernels.fp8_matmul import fp8_matmul_tiles, launch
    device = torch.device("cuda")
    sms = sm_count(device)
    gen = torch.Generator(device).manual_seed(0)
    print(f"{results['device']}: fp8 GEMM tilings, us (weight TB/s of {bandwidth / 1e12:.2f})")
    for name, (n, k) in projections(config).items():
        if name == "lm_head":
            continue
        q, s = quantize_rows(torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * 0.02)
        s = s.view(-1)
        grid = {"chosen": fp8_matmul_tiles(n, k, sms)}
        for bn, bk, stages, splits in itertools.product((64, 128), (128, 256, 512), (3, 4), (1, 2, 4)):
            split_k = -(-(-(-k // bk)) // splits) * bk
            if -(-k // split_k) == splits:
                grid[f"n{bn}k{bk}s{stages}x{splits}"] = MatmulTiles(64, bn, bk, 4, stages, splits, split_k)
        for m in rows_list:
            x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
            xq, xs = quantize_rows(x)
            ref = dequantize(xq, xs.view(-1), torch.float32) @ dequantize(q, s, torch.float32).T
            timed = {}
            for label, tiles in grid.items():
                try:
                    out = launch(xq, xs, q, s, None, torch.bfloat16, tiles).float()
                except Exception as e:  # a tiling Triton cannot compile (shared memory): skipped, said
                    print(f"  {name} m={m} {label}: {type(e).__name__}", flush=True)
                    continue
                if float((out - ref).norm() / ref.norm()) > 1e-2:
                    raise SystemExit(f"{name} m={m} {label}: wrong result")
                timed[label] = do_bench(lambda t=tiles: launch(xq, xs, q, s, None, torch.bfloat16, t), warmup=5,
                                        rep=20, return_mode="median") * 1e3
            best = min(timed, key=timed.get)
            results["runs"].append({"projection": name, "N": n, "K": k, "rows": m, "us": timed, "best": best,
                                    "chosen": vars(grid["chosen"])})
            print(f"{name:>8} m={m:<3} chosen {timed['chosen']:6.1f} us ({n * k / timed['chosen'] / 1e6:4.2f} TB/s); "
                  f"best {best} {timed[best]:6.1f} us ({n * k / timed[best] / 1e6:4.2f} TB/s)", flush=True)
    write_results(results, args.out, "fp8-matmul-sweep", tag=args.tag or None)


if __name__ == "__main__":
    main()
