#!/usr/bin/env python3
"""Does the stage-1 kernel pipeline its K/V loads and use Hopper's matrix instructions?

Compiles ``_tree_attn_partial_kernel`` for sm_90a on the CPU (no GPU needed) and reports,
per configuration: asynchronous global->shared copies and their waits in the TTGIR
(software pipelining), wgmma in the PTX, and registers / spills / shared memory from ptxas.

    python bench/triton_ir.py [--dump DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even under the test environment

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from treedec.kernels import triton_tree_attention as kernels  # noqa: E402

INT_ARGS = ("stride_qq", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_oq",
            "stride_oh", "stride_lq", "stride_we", "stride_wh", "stride_le", "stride_me")
PLAN_ARGS = ("kv_slots_ptr", "chunk_kv_start_ptr", "entry_query_ptr", "entry_mask_ptr", "entry_direct_ptr",
             "item_chunk_ptr", "item_entry_start_ptr", "item_num_entries_ptr")


def compile_stage1(dtype: str, head_dim: int, group: int, block_m: int, config) -> triton.compiler.CompiledKernel:
    sig = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    sig.update({"lse_ptr": "*fp32", "o_ws_ptr": f"*{dtype}", "lse_ws_ptr": "*fp32"})
    sig.update({n: "*i32" for n in PLAN_ARGS})
    sig.update({n: "i32" for n in INT_ARGS})
    sig["qk_scale"] = "fp32"
    const = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=config.block_n,
                 ENTRIES_PER_PROG=block_m // group, SUBTILES=1, DOT_PRECISION="tf32")
    sig.update({k: "constexpr" for k in const})
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
               if (n.endswith("_ptr") and n not in PLAN_ARGS) or (n.startswith("stride") and n != "stride_me")}
    source = ASTSource(kernels._tree_attn_partial_kernel, sig, const, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


def ptxas_report(ptx: str, workdir: Path) -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    (workdir / "k.ptx").write_text(ptx)
    out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(workdir / "k.ptx"), "-o", str(workdir / "k.cubin")],
                         capture_output=True, text=True)
    return " ".join(line.split(":", 1)[-1].strip() for line in out.stderr.splitlines()
                    if "registers" in line or "spill" in line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", type=Path, default=Path("/tmp/treedec-triton-ir"))
    args = parser.parse_args()
    args.dump.mkdir(parents=True, exist_ok=True)
    for head_dim, group, block_m in [(128, 4, 64), (128, 4, 128), (128, 8, 64), (64, 4, 64), (256, 4, 64)]:
        config = kernels.launch_config(head_dim, block_m, torch.float16)
        k = compile_stage1("fp16", head_dim, group, block_m, config)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        name = f"D{head_dim}_G{group}_M{block_m}"
        (args.dump / f"{name}.ttgir").write_text(ttgir)
        print(f"{name} {config}: async copies {len(re.findall(r'async_copy_global_to_local', ttgir))}, "
              f"async waits {len(re.findall(r'async_wait', ttgir))}, "
              f"wgmma {len(re.findall(r'wgmma', ptx))}, mma.sync {len(re.findall(r'mma.sync', ptx))}, "
              f"smem {k.metadata.shared} B; {ptxas_report(ptx, args.dump)}")
    print(f"TTGIR written to {args.dump}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
