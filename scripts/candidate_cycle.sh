#!/usr/bin/env bash
# One device call for a candidate tree: its full build, the sanitizer gate, its GPU tests, an A/B
# against a base build variant, and the side-by-side benchmark, with at most 8 files under OUT_DIR.
#   scripts/candidate_cycle.sh OUT_DIR BASE_DEFINES
#   e.g. FA3_HEAD_DIMS_base="64;128" FA3_DTYPES_base=bf16 PYTEST_ARGS="-m gpu tests/test_bwd_gpu.py" \
#        AB_BENCH_ARGS="--impls jax_fa3 --directions bwd --causal 0 --head-dims 64" \
#        scripts/candidate_cycle.sh $OUT "FA3_EXP_X=1"
# 1. builds the tree as it is (`cand`, every instantiation unless FA3_HEAD_DIMS_cand etc. narrow
#    it; CAND_DEFINES sets an experiment's switches, e.g. "FA3_EXP_X=1" against base "") and
#    `base` with BASE_DEFINES (narrow it with FA3_HEAD_DIMS_base etc.: only the A/B runs
#    it; VARIANT_SRC_base=DIR builds base from another source tree, e.g. the commit before a
#    refactor), at once (scripts/build_variant.sh);
# 2. the compute-sanitizer gate on cand (scripts/sanitize.sh; CAND_SANITIZE=0 skips it) ->
#    sanitize/sanitize.md (summary and reports; the tools' whole logs stay in /tmp/cand_sanitize);
#    the tests on cand (PYTEST_ARGS, default "-m gpu tests"; TEST_SHARDS 8) -> suite/pytest_gpu.log;
# 3. the A/B, cand then base then again the other way round (scripts/ab_variants.sh AB_ABBA=1,
#    benchmark AB_BENCH_ARGS) -> ab/{ab_tables.md, ab_summary.md} (the log: /tmp/cand_ab.log);
# 4. the side-by-side benchmark of cand (BENCH_ARGS, default cudnn, jax_fa3 and fa3 over the
#    whole grid) -> bench/ (json, md, png);
# and cand_info.txt (registers, spills, SASS counts). Each step has its own time limit
# (CAND_SANITIZE_TIMEOUT, CAND_TEST_TIMEOUT, CAND_AB_TIMEOUT, CAND_BENCH_TIMEOUT), so a hang costs
# one step, not the call. CAND_STEPS (default "build sanitize tests ab bench") runs a subset: the
# steps of one candidate can span chained device calls (the machine keeps /tmp while it is warm).
set -uo pipefail
OUT=${1:?usage: scripts/candidate_cycle.sh OUT_DIR BASE_DEFINES}
base_defines=${2-}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site

t0=$(date +%s)
step() { [[ " ${CAND_STEPS:-build sanitize tests ab bench} " == *" $1 "* ]]; }
if step build; then
# The wheels are in /tmp/site already: the two builds at once must not reinstall them there.
WHEELS=/nonexistent scripts/build_variant.sh cand "${CAND_DEFINES-}" &
WHEELS=/nonexistent scripts/build_variant.sh base "$base_defines" &
wait
for v in cand base; do
  echo "build $v: rc $(cat /tmp/ab_$v.rc); $(grep -hE "built in" /tmp/ab_$v.log)"
  grep -hE "LDL/STL=[1-9]" /tmp/ab_$v.log
done
cp /tmp/ab_cand/info.txt "$OUT/cand_info.txt"
[ "$(cat /tmp/ab_cand.rc)" = 0 ] || { tail -30 /tmp/ab_cand.log; exit 1; }
fi

if step sanitize && [ "${CAND_SANITIZE:-1}" = 1 ]; then
  echo "== compute-sanitizer on cand at $(( $(date +%s) - t0 )) s"
  mkdir -p "$OUT/sanitize"
  PYTHONPATH=/tmp/variant_cand:/tmp/site SANITIZE_TIMEOUT=${CAND_SANITIZE_TIMEOUT:-300} \
    scripts/sanitize.sh /tmp/cand_sanitize >/dev/null 2>&1 || status=1
  cp /tmp/cand_sanitize/sanitize.md "$OUT/sanitize/" 2>/dev/null
  sed -n '/^| tool/,/^Result/p' /tmp/cand_sanitize/sanitize.md
fi

if step tests; then
echo "== tests on cand at $(( $(date +%s) - t0 )) s"
WHEELS=/nonexistent INSTALL_TARGET=/tmp/variant_cand SKIP_BUILD=1 SKIP_SANITIZE=1 SKIP_BENCH=1 TEST_SHARDS=${TEST_SHARDS:-8} \
  TEST_TIMEOUT=${CAND_TEST_TIMEOUT:-220} scripts/gpu_cycle.sh "$OUT/suite" >/tmp/cand_suite.txt 2>&1 || status=1
grep -E "FAILED|ERROR|pytest:|passed|failed" /tmp/cand_suite.txt | head -40
fi

if step ab; then
echo "== A/B at $(( $(date +%s) - t0 )) s"
AB_REUSE=1 AB_ABBA=1 BENCH_TIMEOUT=${CAND_AB_RUN_TIMEOUT:-120} BENCH_ARGS="${AB_BENCH_ARGS:---impls jax_fa3}" \
  timeout "${CAND_AB_TIMEOUT:-200}" scripts/ab_variants.sh "$OUT/ab" cand= base="$base_defines" >/dev/null 2>&1 || status=1
cat "$OUT/ab/ab_summary.md" 2>/dev/null || tail -20 "$OUT/ab/ab.log"
mv "$OUT/ab/ab.log" /tmp/cand_ab.log 2>/dev/null  # 8 files in all come back: the log stays here
fi

if step bench; then
echo "== side-by-side benchmark at $(( $(date +%s) - t0 )) s"
PYTHONPATH=/tmp/variant_cand:/tmp/site timeout "${CAND_BENCH_TIMEOUT:-200}" python3 -P benchmarks/bench_attention.py \
  --out "$OUT/bench" ${BENCH_ARGS:---impls cudnn jax_fa3 fa3} >/tmp/cand_bench.log 2>&1 || { status=1; tail -20 /tmp/cand_bench.log; }
cat "$OUT"/bench/*.md 2>/dev/null
fi
echo "== done at $(( $(date +%s) - t0 )) s, status $status"
exit $status
