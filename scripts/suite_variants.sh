#!/usr/bin/env bash
# The GPU suite for several kernel build variants in one device call: build each variant (one
# after another, scripts/build_variant.sh: into /tmp/variant_NAME, so scripts/ab_variants.sh
# AB_REUSE=1 can benchmark the same build), then test them side by side, variant i on the i-th
# GPU in SUITE_GPUS (default "0 1 ..."), TEST_SHARDS processes each.
#   scripts/suite_variants.sh OUT_DIR NAME=DEFINES [NAME=DEFINES ...]
#   e.g. PYTEST_ARGS_x="-m gpu tests/test_bwd_gpu.py" scripts/suite_variants.sh $OUT base= x="FA3_EXP_X=1"
# DEFINES are an experiment's switches (FA3_KERNEL_DEFINES, scripts/build_variant.sh); PYTEST_ARGS_NAME
# narrows one variant's tests (default PYTEST_ARGS, else "-m gpu tests"). OUT_DIR/NAME gets that
# variant's build.log, info.txt and pytest_gpu.log; the exit status is 0 only if every build and
# every suite passed.
set -uo pipefail
OUT=${1:?usage: scripts/suite_variants.sh OUT_DIR NAME=DEFINES [NAME=DEFINES ...]}
shift
[ $# -ge 1 ] || { echo "suite_variants: name at least one variant (NAME=DEFINES)" >&2; exit 2; }
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
read -r -a gpus <<<"${SUITE_GPUS:-$(seq -s ' ' 0 $(($# - 1)))}"
status=0

for spec in "$@"; do  # builds one after another: each takes every core
  name=${spec%%=*}
  echo "== build $name: defines '${spec#*=}'"
  scripts/build_variant.sh "$name" "${spec#*=}"
  rc=$?
  mkdir -p "$OUT/$name"
  cp "/tmp/ab_$name.log" "$OUT/$name.build.txt"
  cp /tmp/ab_"$name"/{build.log,info.txt} "$OUT/$name/" 2>/dev/null
  grep -E "built in|LDL/STL=[1-9]" "$OUT/$name.build.txt"
  [ $rc -eq 0 ] || { echo "build $name failed"; tail -20 "$OUT/$name.build.txt"; status=1; }
done
[ $status -eq 0 ] || exit $status

# Stopped (e.g. by `timeout`): end the suites too (gpu_cycle.sh then ends its shards and keeps
# their partial logs), so none runs on beside whatever the caller does next.
trap 'kill $(jobs -p) 2>/dev/null; wait; exit 143' TERM INT
i=0
for spec in "$@"; do  # suites side by side; the wheels are already in /tmp/site
  name=${spec%%=*}
  args_var=PYTEST_ARGS_$name
  WHEELS=/nonexistent PYTHONPATH=/tmp/site INSTALL_TARGET="/tmp/variant_$name" SKIP_BUILD=1 SKIP_SANITIZE=1 SKIP_BENCH=1 \
    TEST_GPUS=${gpus[i % ${#gpus[@]}]} PYTEST_ARGS="${!args_var:-${PYTEST_ARGS:--m gpu tests}}" \
    scripts/gpu_cycle.sh "$OUT/$name" >"$OUT/$name.suite.txt" 2>&1 &
  i=$((i + 1))
done
for spec in "$@"; do wait -n || status=1; done
for spec in "$@"; do echo "== suite ${spec%%=*}"; cat "$OUT/${spec%%=*}.suite.txt"; done
exit $status
