#!/usr/bin/env bash
# A/B of compile-time variants of the cuda kernels on a GPU machine, in one command.
#
#   bash bench/cuda_variants.sh "" "-DTREEDEC_WS_STAGES=5" ...   [-- bench/attention.py arguments]
#
# Each argument before `--` is one variant's TREEDEC_CUDA_FLAGS ("" = the defaults); each is built
# into its own cache dir and runs bench/attention.py (cuda backend, flatten, no peers) with results
# `<date>-<device>-variant<i>.json` in $OUT. The knobs are the TREEDEC_* macros of
# treedec/kernels/cuda/*.cuh. Prints, per workload, each variant's eager and graphed microseconds
# last (eager times of the small trees carry host noise; the graphed ones are the kernels').
set -uo pipefail
OUT=${OUT:-/tmp/treedec-variants}
mkdir -p "$OUT"
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
fi
export PYTHONPATH="/tmp/site:$PWD"
i=0
for flags in "${variants[@]}"; do
  i=$((i + 1))
  echo "=== variant $i: TREEDEC_CUDA_FLAGS='$flags'"
  TREEDEC_CUDA_FLAGS="$flags" TREEDEC_CACHE_DIR="/tmp/treedec-variant$i" python3 bench/attention.py --backends cuda \
    --planners flatten --peers none --out "$OUT" --readme none --tag "variant$i" "$@" > "$OUT/variant$i.log" 2>&1 \
    || { echo "variant $i failed:"; tail -20 "$OUT/variant$i.log"; }
done
python3 - "$OUT" "${variants[@]}" <<'PY'
import glob, json, sys
out, variants = sys.argv[1], sys.argv[2:]
rows = {}
for i, flags in enumerate(variants, 1):
    for path in glob.glob(f"{out}/*-variant{i}.json"):
        for name, w in json.load(open(path))["workloads"].items():
            for method, r in w["methods"].items():
                rows.setdefault(name, {})[i] = (r.get("us"), r.get("graphed_us"))
fmt = lambda x: f"{x:7.1f}" if x else "      -"
print("workload".ljust(22) + "".join(f"v{i} eager/graphed".rjust(18) for i in range(1, len(variants) + 1)))
for name, by in rows.items():
    print(name.ljust(22) + "".join(fmt(by.get(i, (None, None))[0]).rjust(10) + fmt(by.get(i, (None, None))[1]).rjust(8)
                                   for i in range(1, len(variants) + 1)))
for i, flags in enumerate(variants, 1):
    print(f"v{i}: TREEDEC_CUDA_FLAGS='{flags}'")
PY
