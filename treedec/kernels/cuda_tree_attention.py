"""The ``cuda`` kernels: CuTe tree attention (wgmma on sm_90a, mma.sync on sm_80+) on a
persistent, load-balanced grid, launched from tensors and plain parameters.

Stage 1 (``cuda/partial_ws_kernel.cuh``, ``cuda/partial_kernel.cuh``) runs a fixed grid of CTAs,
each looping over the units a persistent schedule gave it: one work item's chunk x one KV head x up to
:func:`rows_per_unit` rows (queries x heads of the GQA group; 128 on sm_90a: two consumer
warpgroups of the warp-specialized wgmma kernel, every head dim; elsewhere 8 warps of mma.sync, 4 for
head dim 256). Dead tiles (no row reads them) are neither loaded nor computed; entries that are
their query's only partial write the output directly, the rest write fp32 partial states.
Stage 2 merges each query's partials in the plan's CSR order (deterministic, no atomics).
Each KV tile size of :data:`TILE_SIZES` has its own stage-1 kernel, and each logit variant key (the hooks
of ``cuda/variants.cuh``, e.g. ``("softcap",)``) its own extension (:func:`extension`).

What to launch (the schedule, the tile, the workspace, the merge kernel) is decided by the
attention layer's cuda backend (``treedec.attention.backends.cuda_backend``) at plan time.
"""
from __future__ import annotations

import functools

import torch

from treedec.kernels.cuda_build import load_extension

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Rows (query x head pairs) of one stage-1 unit per head dim on sm_90a (the warp-specialized kernel: ws::kRows) and
# elsewhere (mma.sync: PartialConfig's warps x 16 in cuda/tile_sizes.cuh); a GPU test checks them against the build.
ROWS_PER_UNIT = {64: 128, 128: 128, 256: 128}
ROWS_PER_UNIT_MMA = {64: 128, 128: 128, 256: 64}


def rows_per_unit(capability: tuple[int, int], head_dim: int) -> int:
    """Rows of one stage-1 unit of head dim ``head_dim`` on a GPU of ``capability`` (the kernel the build runs)."""
    return (ROWS_PER_UNIT if tuple(capability) == (9, 0) else ROWS_PER_UNIT_MMA)[head_dim]
TILE_TOKENS = 64          # the KV tile every stage-1 kernel takes
TILE_SIZES = (64, 96)     # KV tiles some stage-1 kernel takes (multiples of 32: whole mask words)


def check_tile_tokens(tile_tokens, dtype: torch.dtype, head_dim: int, ext, what: str = "tile_tokens") -> int:
    """``tile_tokens`` if a stage-1 kernel of ``ext`` takes tiles of that size for ``dtype`` and
    ``head_dim``, else ValueError naming ``what`` and the sizes it takes."""
    bf16 = dtype == torch.bfloat16
    if tile_tokens not in TILE_SIZES or not ext.takes_tile(bf16, head_dim, tile_tokens):
        supported = [t for t in TILE_SIZES if ext.takes_tile(bf16, head_dim, t)]
        raise ValueError(f"{what}: the cuda kernels for {dtype}, head_dim={head_dim} on this GPU take tiles of "
                         f"{supported} tokens")
    return int(tile_tokens)


def extension(device: torch.device, kernel_key: tuple[str, ...] = ()):
    """The compiled extension for ``device``'s arch and the logit variant key ``kernel_key`` (built on first use)."""
    return load_extension(torch.cuda.get_device_capability(device), kernel_key)


@functools.lru_cache(maxsize=None)
def persistent_grid_size(device_index: int, dtype: torch.dtype, head_dim: int, kernel_key: tuple[str, ...] = ()
                         ) -> int:
    """CTAs of the persistent stage-1 grid of ``kernel_key``'s kernels: SMs x resident CTAs per SM."""
    device = torch.device("cuda", device_index)
    per_sm = extension(device, kernel_key).ctas_per_sm(dtype == torch.bfloat16, head_dim)
    if per_sm < 1:
        raise RuntimeError(f"the cuda stage-1 kernel cannot be resident on {torch.cuda.get_device_name(device)} "
                           f"for {dtype}, head_dim={head_dim} (shared memory or registers)")
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def check_dtype(q: torch.Tensor) -> None:
    """TypeError unless q's dtype is one the cuda kernels take."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the cuda backend takes {SUPPORTED_DTYPES}, got {q.dtype} (use 'triton' or 'torch' for fp32)")


#: Head dims whose kernels read fp8 K/V (the ("kv_fp8",) build: 64-token tiles, kernels/cuda/kv_fp8.cuh).
FP8_KV_HEAD_DIMS = (64, 128)


def variant_problem(kernel_key: tuple[str, ...], head_dim: int | None = None,
                    capability: tuple[int, int] | None = None) -> str | None:
    """None if cuda kernels are built for the variant key ``kernel_key`` at ``head_dim`` on a GPU of ``capability``
    (None: any), else why not (a sentence): fp8 K/V (``"kv_fp8"``) are read by the sm_90a warp-specialized kernel
    of head dims :data:`FP8_KV_HEAD_DIMS`, without the soft-cap."""
    if "kv_fp8" not in kernel_key:
        return None
    if "softcap" in kernel_key:
        return "the cuda kernels do not read an fp8 KV cache under a logit soft-cap (the triton kernels do)"
    if head_dim is not None and head_dim not in FP8_KV_HEAD_DIMS:
        return (f"the cuda kernels read an fp8 KV cache at head dims {list(FP8_KV_HEAD_DIMS)}, not {head_dim} "
                f"(the triton kernels do)")
    if capability is not None and tuple(capability) != (9, 0):
        return (f"the cuda kernels read an fp8 KV cache on sm_90a (H100/H200), not compute capability "
                f"{capability[0]}.{capability[1]} (the triton kernels do)")
    return None


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fp8_kv: bool = False) -> None:
    """Raise a clear error for inputs the cuda kernels cannot take (beyond TreeAttention's checks); ``fp8_kv``: the
    caches hold e4m3 (16-byte aligned rows of 16 values)."""
    if q.device.type != "cuda":
        raise ValueError(f"the cuda backend needs CUDA tensors, got q on {q.device}")
    check_dtype(q)
    if q.dim() != 3 or q.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the cuda backend needs q [Q, Hq, D] with D in {SUPPORTED_HEAD_DIMS}, got {tuple(q.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        per_row = 16 // t.element_size()   # (elements in 16 bytes)
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % per_row for s in t.stride()[:-1]):
            raise ValueError(f"the cuda backend needs 16-byte aligned rows: {name} must have a contiguous last dim, "
                             f"a 16-byte aligned data pointer and strides that are multiples of {per_row}, "
                             f"got strides {t.stride()}")
        dtype = torch.float8_e4m3fn if fp8_kv and name != "q" else q.dtype
        if t.dtype != dtype or t.device != q.device:
            raise ValueError(f"{name} must be {dtype} on {q.device}, got {t.dtype} on {t.device}")


def launch(q, k_flat, v_flat, out, lse, o_ws, lse_ws, arrays: dict, cta_unit_start, unit_info, mask_stride: int,
           scale_log2: float, softcap_scale: float, merge: bool, tile_tokens: int, max_query_entries: int,
           ext, kv_scale=None) -> None:
    """Launch stage 1 (and stage 2 when ``merge``) on the current stream.

    ``arrays`` holds the plan's int32 tensors by name (``kv_slots``, ``chunk_kv_start``, ``entry_query``,
    ``entry_mask``, ``entry_direct``, ``query_entry_start``, ``query_entries``; see ``TreePlan``);
    ``q`` [>=Q, Hq, D], ``k_flat``/``v_flat`` [slots, Hkv, D], ``out`` like q, ``lse`` [rows of q, Hq];
    ``unit_info`` a schedule's device array of ``tile_tokens``-token tiles (the kernel of that tile runs);
    ``max_query_entries`` the most partial entries of any query, or a bound on it (it picks the merge
    kernel: partial rows loaded 4, 8 or 16 at a time; the result is the same);
    ``scale_log2``, ``softcap_scale`` the logit arguments (``AttentionVariant.logit_args``: a score ``s`` becomes
    ``t * scale_log2``, ``t = tanh(s * softcap_scale)`` in the soft-capped build, else ``s``); ``ext`` the
    compiled extension of the variant's key (:func:`extension`; its kernels check that ``softcap_scale`` is theirs);
    ``kv_scale`` [2, Hkv] float32, the K and V scales of e4m3 ``k_flat`` / ``v_flat`` (the ``("kv_fp8",)`` build's
    kernels; None for the others: the binding checks that the build and the caches agree).
    """
    group = q.shape[1] // k_flat.shape[1]
    ext.attend(q, k_flat, v_flat, out, lse, o_ws, lse_ws, arrays["kv_slots"], arrays["chunk_kv_start"],
               arrays["entry_query"], arrays["entry_mask"], arrays["entry_direct"], arrays["query_entry_start"],
               arrays["query_entries"], cta_unit_start, unit_info, group, mask_stride, scale_log2, softcap_scale,
               merge, tile_tokens, max_query_entries, kv_scale)
