#!/usr/bin/env bash
# A/B of kernel build variants in one device call: for each variant, build (no tests) and run
# the same benchmark, tagged with the variant's name; the tables come back side by side.
#   scripts/ab_variants.sh OUT_DIR NAME=DEFINES [NAME=DEFINES ...]
#   e.g. scripts/ab_variants.sh $OUT base= x="FA3_EXP_X=1"
# DEFINES are an experiment's switches (FA3_KERNEL_DEFINES, scripts/build_variant.sh); the build set is
# FA3_HEAD_DIMS / FA3_DTYPES / FA3_DIRECTIONS as for scripts/gpu_cycle.sh, the benchmark
# BENCH_ARGS (passed to benchmarks/bench_attention.py; give it --impls ... cudnn for a yardstick).
# AB_BENCH=fp8 times benchmarks/bench_fp8.py instead (BENCH_ARGS go to it; e.g. "--impls
# jax_fa3_fp8 --no-gemm --head-dims 256").
# Each variant is installed into its own folder (/tmp/variant_NAME), so an installed build and a
# GPU suite running from it (scripts/gpu_cycle.sh on another GPU) are left alone; AB_GPU picks
# the benchmark's GPU (CUDA_VISIBLE_DEVICES).
# AB_PIPELINE=1 builds the next variant (at nice 19) while this one is benchmarked: ~40% less
# device time. The timing loop no longer waits on the host per call (bench_attention.py), but
# measure a variant pair both ways before trusting pipelined figures for a close call.
# AB_PIPELINE=parallel starts every variant's build at once (a build narrowed to a few head dims
# compiles a handful of translation units, so one build uses a few of the cores).
# AB_REUSE=1 benchmarks a variant already built by scripts/suite_variants.sh (or an earlier run)
# instead of building it again.
# AB_ABBA=1 then benchmarks the variants again in reverse order (base, x, x, base), so a drift of
# the card over the call cancels in the geometric mean (session 7: a comparison across two
# runs, one with peers between our loops, was off by up to 7%).
# OUT_DIR gets ab.log, ab_tables.md (every run's table, in order) and ab_summary.md (per point,
# each variant's geometric mean over its runs and its ratio to the first variant:
# benchmarks/ab_compare.py).
set -uo pipefail
OUT=${1:?usage: scripts/ab_variants.sh OUT_DIR NAME=DEFINES [NAME=DEFINES ...]}
shift
[ $# -ge 1 ] || { echo "ab_variants: name at least one variant (NAME=DEFINES)" >&2; exit 2; }
case ${AB_PIPELINE:-0} in 0 | 1 | parallel) ;; *) echo "ab_variants: AB_PIPELINE is 0, 1 or parallel" >&2; exit 2 ;; esac
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
build() {  # build NAME DEFINES: install into /tmp/variant_NAME; rc in /tmp/ab_NAME.rc
  ${AB_PIPELINE:+nice -n 19} scripts/build_variant.sh "$1" "$2"
}

run_all() {
  local status=0 spec name
  for spec in "$@"; do
    name=${spec%%=*}
    [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "ab_variants: bad variant name '$name'"; return 2; }
    [ "${AB_REUSE:-0}" = 1 ] && [ -f "/tmp/ab_$name.rc" ] || rm -f "/tmp/ab_$name.rc"
  done
  if [ "${AB_PIPELINE:-0}" = 1 ]; then  # every build, one after another, in the background
    (for spec in "$@"; do [ -f "/tmp/ab_${spec%%=*}.rc" ] || build "${spec%%=*}" "${spec#*=}"; done) &
  elif [ "${AB_PIPELINE:-0}" = parallel ]; then  # every build at once (one TU per head dim and
    for spec in "$@"; do  # direction: a narrowed build leaves most of the cores idle)
      [ -f "/tmp/ab_${spec%%=*}.rc" ] || build "${spec%%=*}" "${spec#*=}" &
    done
  fi
  for spec in "$@"; do
    name=${spec%%=*}
    echo "== variant $name: defines '${spec#*=}'"
    if [ "${AB_PIPELINE:-0}" != 0 ]; then
      while [ ! -f "/tmp/ab_$name.rc" ]; do sleep 2; done
    elif [ ! -f "/tmp/ab_$name.rc" ]; then
      build "$name" "${spec#*=}"
    fi
    if [ "$(cat "/tmp/ab_$name.rc")" != 0 ]; then
      echo "variant $name: build failed"; tail -20 "/tmp/ab_$name.log"; status=1; continue
    fi
    grep -sE "built in|LDL/STL=[1-9]" "/tmp/ab_$name.log"
    bench "$name" || status=1
  done
  wait
  if [ "${AB_ABBA:-0}" = 1 ]; then  # the same benchmarks again, last variant first
    local names=() i
    for spec in "$@"; do [ "$(cat "/tmp/ab_${spec%%=*}.rc" 2>/dev/null)" = 0 ] && names+=("${spec%%=*}"); done
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do
      echo "== variant ${names[i]} (second round)"
      bench "${names[i]}" || status=1
    done
  fi
  if [ -f "$OUT/ab_tables.md" ]; then
    python3 benchmarks/ab_compare.py "$OUT/ab_tables.md" --out "$OUT/ab_summary.md" || status=1
  else
    echo "ab_variants: no variant's benchmark timed a point, so there is no summary"; status=1
  fi
  return $status
}

bench() {  # bench NAME: the benchmark of /tmp/variant_NAME, its table appended to ab_tables.md
  # The per-point timing lines are left out of the log; "unsupported" and warnings stay.
  local script=benchmarks/bench_attention.py rows="^\| (fwd|bwd) \| [0-9]+ \| (no|yes) \| [0-9]+ \| [0-9.]+ \|"
  if [ "${AB_BENCH:-}" = fp8 ]; then
    script=benchmarks/bench_fp8.py rows="^\| [0-9]+ \| (no|yes) \| [0-9]+ \| [0-9.]+ \|"
  fi
  rm -f /tmp/ab_results/*-"$1".md
  CUDA_VISIBLE_DEVICES=${AB_GPU:-0} PYTHONPATH="/tmp/variant_$1:/tmp/site" timeout "${BENCH_TIMEOUT:-240}" python3 -P $script \
    --out /tmp/ab_results --tag "$1" ${BENCH_ARGS:-} 2>&1 | grep -v " TFLOP/s$"
  local rc=${PIPESTATUS[0]}
  # Session 29: a variant whose kernel hung was cut here with nothing in the log.
  [ "$rc" != 124 ] || { echo "variant $1: the benchmark was cut at its ${BENCH_TIMEOUT:-240} s limit"; return 1; }
  [ "$rc" = 0 ] || { echo "variant $1: the benchmark exited with status $rc"; return 1; }
  cat /tmp/ab_results/*-"$1".md >>"$OUT/ab_tables.md"
  # A table without timed rows is a failed variant, not an empty A/B (session 8: a backward-only
  # build has no forward kernel, so jax_fa3 could run no point, and nothing said so).
  grep -qE "$rows" /tmp/ab_results/*-"$1".md || { echo "variant $1: the benchmark timed no point"; return 1; }
}

run_all "$@" 2>&1 | tee "$OUT/ab.log"
exit "${PIPESTATUS[0]}"
