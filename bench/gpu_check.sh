#!/usr/bin/env bash
# GPU tests, the attention benchmark and the program benchmark on a GPU machine, in one command.
#
#   bash bench/gpu_check.sh [bench/attention.py arguments, e.g. --workloads tot_d5w10,fewshot_b30_p4k]
#
# Run from the repository root. Writes into $OUT (default /tmp/treedec-gpu-check): env.log,
# pytest-gpu.log, attention.log, programs.log, the results JSON and attention-table.md (the
# README table rendered from that JSON). Wheels in .whl/ (flashinfer-python, apache-tvm-ffi,
# nvidia-cutlass; see bench/README.md) are installed into /tmp/site first when present. The
# short tables are last. GPU_CHECK_TESTS=0 skips the GPU tests (`pytest -m "gpu or triton"`,
# compiled on the GPU), GPU_CHECK_ATTENTION=0 the attention suite, GPU_CHECK_PROGRAMS=0 the
# programs (`bench/programs.py --hf`; GPU_CHECK_PROGRAMS_ARGS adds arguments), GPU_CHECK_BATCH=0
# the batched programs (bench/batch.py: greedy with a shared system prompt, speculative with tree,
# Medusa-head, EAGLE-3 chain and draft-model drafts; bench/tot_batch.py: 16 ToT tasks), e.g. to
# split the work over calls of a 10-minute limit.
set -uo pipefail

OUT=${OUT:-/tmp/treedec-gpu-check}
mkdir -p "$OUT"
# One in-process Inductor compile thread: FlexAttention's background compile workers
# otherwise keep the host busy into the next workload's timings (seen on an H200 host).
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a TORCHINDUCTOR_COMPILE_THREADS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD"
fi

{
  nvidia-smi -L
  python3 - <<'EOF'
import platform, torch, triton
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'}")
try:
    import flashinfer
    print(f"flashinfer {flashinfer.__version__}")
except Exception as e:
    print(f"flashinfer unavailable: {type(e).__name__}: {e}")
EOF
} 2>&1 | tee "$OUT/env.log"

test_rc=0
if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
  python3 -m pytest -m "gpu or triton" -q 2>&1 | tee "$OUT/pytest-gpu.log"
  test_rc=${PIPESTATUS[0]}
  if [ "$test_rc" -eq 5 ]; then test_rc=0; fi   # 5: no GPU tests collected
fi

bench_rc=0
if [ "${GPU_CHECK_ATTENTION:-1}" != 0 ]; then
  python3 bench/attention.py --out "$OUT" --readme "$OUT/attention-table.md" "$@" 2>&1 | tee "$OUT/attention.log"
  bench_rc=${PIPESTATUS[0]}
fi
programs_rc=0
if [ "${GPU_CHECK_PROGRAMS:-1}" != 0 ]; then
  # shellcheck disable=SC2086  # extra arguments are split on purpose
  python3 bench/programs.py --hf --out "$OUT" ${GPU_CHECK_PROGRAMS_ARGS:-} 2>&1 | tee "$OUT/programs.log"
  programs_rc=${PIPESTATUS[0]}
fi
batch_rc=0
if [ "${GPU_CHECK_BATCH:-1}" != 0 ]; then
  {
    python3 bench/batch.py --requests 1,64 --compare-unshared --out "$OUT" &&
    python3 bench/batch.py --speculative --requests 1,8,32 --system 0 --question 4000 --out "$OUT" --tag tree &&
    python3 bench/batch.py --speculative --medusa-heads --requests 1,8,32 --system 0 --question 4000 --out "$OUT" \
      --tag heads &&
    python3 bench/batch.py --speculative --eagle eagle3 --eagle-tree chains --requests 1,8 --system 0 \
      --question 4000 --out "$OUT" --tag eagle3-chains &&
    python3 bench/batch.py --speculative --draft-model --requests 1,8 --system 0 --question 4000 --out "$OUT" \
      --tag draft-model &&
    python3 bench/tot_batch.py --out "$OUT"
  } 2>&1 | tee "$OUT/batch.log"
  batch_rc=${PIPESTATUS[0]}
fi

echo
echo "GPU tests exit code: $test_rc; bench/attention.py: $bench_rc; bench/programs.py: $programs_rc; batch: $batch_rc"
if compgen -G "$OUT/*.json" >/dev/null; then
  echo "results: $(cd "$OUT" && ls *.json) (copy into bench/results/, then: python bench/attention.py --render bench/results/<those files>)"
fi
mapfile -t attention_json < <(ls "$OUT"/*.json 2>/dev/null | grep -v -- '-programs\|-batch\|-tot-batch' || true)
if [ "${#attention_json[@]}" -gt 0 ]; then
  python3 bench/attention.py --render "${attention_json[@]}" --readme "$OUT/attention-table.md"
fi
if [ -f "$OUT/programs.log" ]; then
  sed -n '/^| program/,$p' "$OUT/programs.log"
fi
if [ -f "$OUT/batch.log" ]; then
  grep -E "^[0-9]+ (requests|ToT)" "$OUT/batch.log"
fi
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$programs_rc" -eq 0 ] && [ "$batch_rc" -eq 0 ]
