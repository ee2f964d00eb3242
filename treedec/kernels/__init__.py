"""Attention kernels: Triton (``triton`` backend); CUDA sources + JIT build (``cuda`` backend)."""
