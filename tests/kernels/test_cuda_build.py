"""Building the cuda backend's sources (treedec/kernels/cuda_build.py) on the CPU: the kernel sources compile
with this machine's nvcc for sm_90a, in the default build and in the bench-only trace build."""
import shutil

import pytest

from treedec.errors import BackendUnavailableError
from treedec.kernels.cuda_build import compile_sources, cutlass_include_dir, variant_flags


def _has_cutlass_headers() -> bool:
    try:
        cutlass_include_dir()
    except BackendUnavailableError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile the kernels")
@pytest.mark.skipif(not _has_cutlass_headers(), reason="needs the CUTLASS headers: pip install 'treedec[cuda]'")
def test_kernel_sources_compile_for_sm90(tmp_path):
    objects = compile_sources("sm_90a", tmp_path)
    assert [o.name for o in objects] == ["partial_fp16.sm_90a.o", "partial_bf16.sm_90a.o", "dispatch.sm_90a.o"]
    assert all(o.stat().st_size > 0 for o in objects)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile the kernels")
@pytest.mark.skipif(not _has_cutlass_headers(), reason="needs the CUTLASS headers: pip install 'treedec[cuda]'")
def test_trace_build_sources_compile_for_sm90(tmp_path):
    """The bench-only trace build (bench/stage1_trace.py's -DTREEDEC_WS_TRACE=1) keeps compiling: the
    kernels of one dtype (the trace stamps are dtype-free) and the dispatch."""
    objects = compile_sources("sm_90a", tmp_path, flags=("-DTREEDEC_WS_TRACE=1",),
                              sources=("partial_bf16.cu", "dispatch.cu"))
    assert [o.name for o in objects] == ["partial_bf16.sm_90a.o", "dispatch.sm_90a.o"]
    assert all(o.stat().st_size > 0 for o in objects)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile the kernels")
@pytest.mark.skipif(not _has_cutlass_headers(), reason="needs the CUTLASS headers: pip install 'treedec[cuda]'")
def test_soft_capped_kernels_compile_for_sm90(tmp_path):
    """The build of the variant key ('softcap',) (AttentionVariant.kernel_key): its own objects, the hook compiled in."""
    objects = compile_sources("sm_90a", tmp_path, kernel_key=("softcap",))
    assert [o.name for o in objects] == ["partial_fp16.softcap.sm_90a.o", "partial_bf16.softcap.sm_90a.o",
                                         "dispatch.softcap.sm_90a.o"]
    assert all(o.stat().st_size > 0 for o in objects)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile the kernels")
@pytest.mark.skipif(not _has_cutlass_headers(), reason="needs the CUTLASS headers: pip install 'treedec[cuda]'")
def test_fp8_kv_kernels_compile_for_sm90(tmp_path):
    """The build of the variant key ('kv_fp8',) (an fp8 KV cache: e4m3 tiles staged and widened before the wgmmas,
    kernels/cuda/kv_fp8.cuh): its own objects; sm_80 has no fp8 KV kernels and says so."""
    objects = compile_sources("sm_90a", tmp_path, kernel_key=("kv_fp8",))
    assert [o.name for o in objects] == ["partial_fp16.kv_fp8.sm_90a.o", "partial_bf16.kv_fp8.sm_90a.o",
                                         "dispatch.kv_fp8.sm_90a.o"]
    assert all(o.stat().st_size > 0 for o in objects)
    with pytest.raises(RuntimeError, match="the fp8 KV kernels .* are the warp-specialized sm_90a ones"):
        compile_sources("sm_80", tmp_path, sources=("dispatch.cu",), kernel_key=("kv_fp8",))


def test_variant_keys_map_to_the_kernels_defines():
    assert variant_flags(()) == []
    assert variant_flags(("softcap",)) == ["-DTREEDEC_LOGITS_SOFTCAP=1"]
    assert variant_flags(("kv_fp8",)) == ["-DTREEDEC_KV_FP8=1"]
    for key in (("alibi",), ("softcap", "softcap")):
        with pytest.raises(ValueError, match="a variant key names distinct hooks of \\['kv_fp8', 'softcap'\\]"):
            variant_flags(key)
