#!/usr/bin/env bash
# One build-test-benchmark cycle on a Hopper machine without internet, as one command:
#   scripts/gpu_cycle.sh OUT_DIR
# 1. installs the local wheels in $WHEELS (default .whl: nvidia-cutlass, flash-attn3-jax) into
#    /tmp/site, 2. builds and installs jax_fa3 with all cores (no build isolation; CUTLASS from the
#    wheel or $CUTLASS_DIR), 3. summarises the SASS (HGMMA count, local-memory spills),
#    4. runs the compute-sanitizer gate (scripts/sanitize.sh: memcheck, racecheck, initcheck,
#    synccheck over every compiled kernel), 5. runs `pytest -m gpu`, 6. runs the side-by-side
#    benchmark.
# Knobs (environment): FA3_HEAD_DIMS, FA3_DTYPES, FA3_DIRECTIONS restrict the instantiations;
# FA3_KERNEL_DEFINES sets an experiment's build switch (docs/experiments.md);
# PYTEST_ARGS (default "-m gpu tests"), BENCH_ARGS (passed to benchmarks/bench_attention.py),
# TEST_SHARDS (parallel pytest processes), TEST_GPUS (e.g. "0 1": shard i runs on the i-th listed GPU,
# round robin; default all visible), SKIP_BUILD=1 (use what is installed), SKIP_SANITIZE=1, SKIP_TESTS=1, SKIP_BENCH=1,
# FP8_BENCH_ARGS (set, even empty: also run benchmarks/bench_fp8.py with these arguments; with
# SKIP_BENCH=1 for the file limit below), TEST_TIMEOUT / BENCH_TIMEOUT / FP8_BENCH_TIMEOUT
# (seconds; a hung kernel ends there), BUILD_TIMEOUT (seconds), INSTALL_TARGET (install jax_fa3
# into this folder, put first on PYTHONPATH, instead of site-packages: variants side by side),
# PREBUILT (a folder from scripts/prebuild_wheel.sh: install its wheel instead of building).
# Leaves at most 8 files in OUT_DIR: build.log, info.txt, sanitize.txt, pytest_gpu.log and the
# benchmark's json, md, png and bench.log (the device tool returns 8).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_cycle.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
status=0

WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export CUTLASS_DIR=${CUTLASS_DIR:-/tmp/site/cutlass_library/source/include}

if [ -n "${INSTALL_TARGET:-}" ]; then
  target_args=(--target "$INSTALL_TARGET" --upgrade)
  export PYTHONPATH=$INSTALL_TARGET${PYTHONPATH:+:$PYTHONPATH}
else
  target_args=()
fi

if [ "${SKIP_BUILD:-0}" != 1 ]; then
if [ -n "${PREBUILT:-}" ]; then
# A wheel built on the CPU machine (scripts/prebuild_wheel.sh): installed, not built, once its
# sources and defines are this tree's and this call's.
[ -f "$PREBUILT/source.txt" ] || { echo "PREBUILT=$PREBUILT: no source.txt there (scripts/prebuild_wheel.sh writes it)"; exit 1; }
echo "== install the prebuilt wheel $PREBUILT ($(grep -E '^(build|commit)' "$PREBUILT/source.txt" | tr '\n' ' '))"
have=$(sed -n 's/^fingerprint //p' "$PREBUILT/source.txt") want=$(scripts/source_fingerprint.sh)
[ "$have" = "$want" ] || { echo "PREBUILT=$PREBUILT was built from other sources (fingerprint $have, this tree $want): rebuild it with scripts/prebuild_wheel.sh or delete it"; exit 1; }
have=$(sed -n 's/^defines //p' "$PREBUILT/source.txt")
[ "$have" = "${FA3_KERNEL_DEFINES:-}" ] || { echo "PREBUILT=$PREBUILT has defines '$have', this call asks '${FA3_KERNEL_DEFINES:-}'"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --force-reinstall "${target_args[@]}" "$PREBUILT"/*.whl >"$OUT/build.log" 2>&1 ||
  { cat "$OUT/build.log"; exit 1; }
cat "$PREBUILT/build.log" >>"$OUT/build.log"
else
echo "== build ($(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); dims=${FA3_HEAD_DIMS:-all} dtypes=${FA3_DTYPES:-all} dirs=${FA3_DIRECTIONS:-default} defines=${FA3_KERNEL_DEFINES:-none})"
# A build sharing the cores (a build left running by an earlier call that was cut off, or
# variants built side by side) is slower: say so, the log then explains a slow build.
others=$(pgrep -c -x 'cicc|ptxas|nvcc' || true)
[ "${others:-0}" = 0 ] || echo "note: $others compiler processes already running; this build shares the cores"
t0=$(date +%s)
# BUILD_TIMEOUT (seconds; default none) ends a build that would outlast the device call: the
# caller's later steps still run, and the log says how far the build got.
FA3_CUDA=ON FA3_PTXAS_VERBOSE=ON CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "${BUILD_TIMEOUT:-0}" \
  python3 -m pip install -v --no-build-isolation --no-deps "${target_args[@]}" . >"$OUT/build.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  [ $rc -ne 124 ] || echo "build cut at BUILD_TIMEOUT=${BUILD_TIMEOUT} s, at step $(grep -oE '\[[0-9]+/[0-9]+\]' "$OUT/build.log" | tail -1)"
  grep -E "error|Error" "$OUT/build.log" | head -40; tail -30 "$OUT/build.log"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
fi

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -P -c "import jax, jax_fa3; print('jax', jax.__version__, jax.devices()); print(jax_fa3.build_info())"
  so=$(python3 -P -c "import jax_fa3._fa3_cuda as m; print(m.__file__)")
  echo "== ptxas (kernels: registers, spills)"
  grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" | sed 's/^ *//' | sort | uniq -c | head -80
  # C7512: ptxas serialized a kernel's WGMMAs (too few registers), a wait after each.
  echo "== ptxas: kernels with serialized WGMMAs (C7512): $(grep -c "C7512" "$OUT/build.log")"
  grep -E "C7512" "$OUT/build.log" | sed 's/^ *//' | head -20
  echo "== SASS: WGMMA (HGMMA bf16/fp16, QGMMA FP8) / local-memory instructions per kernel"
  cuobjdump --dump-sass "$so" | awk '/Function :/{f=$3} /[HQ]GMMA/{h[f]++} /LDL|STL/{l[f]++} END{for(k in h) printf "%s WGMMA=%d LDL/STL=%d\n", k, h[k], l[k]+0}'
} >"$OUT/info.txt" 2>&1
cat "$OUT/info.txt" | head -60
fi

if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
  # The gate before the tests: a race or an out-of-bounds access can pass a numerical test.
  echo "== compute-sanitizer (scripts/sanitize.sh)"
  san=$(mktemp -d)
  scripts/sanitize.sh "$san" >/dev/null 2>&1 || { status=1; echo "sanitize: FAILED (see sanitize.txt)"; }
  cat "$san/sanitize.md" "$san/sanitize.log" >"$OUT/sanitize.txt" 2>/dev/null
  sed -n '/^| tool/,/^Result/p' "$san/sanitize.md"
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # TEST_SHARDS=n runs n pytest processes side by side on the one GPU (tests/conftest.py
  # FA3_TEST_SHARD): compilation and the CPU oracle dominate the suite's time, not the GPU.
  shards=${TEST_SHARDS:-1}
  echo "== pytest ${PYTEST_ARGS:--m gpu tests} ($shards shards)"
  read -r -a gpus <<<"${TEST_GPUS:-}"
  logs=$(mktemp -d)  # per run: two cycles may test side by side (scripts/suite_variants.sh)
  # A shard cut at its limit ends mid-line: each shard's header starts a line of its own.
  collect_logs() {
    for ((i = 0; i < shards; i++)); do echo; echo "---- shard $i/$shards"; cat "$logs/shard_$i.log"; done >"$OUT/pytest_gpu.log"
    python3 -P scripts/tests_not_reached.py "$logs" "$shards" >>"$OUT/pytest_gpu.log"
  }
  # Stopped from outside (an enclosing `timeout`, or scripts/suite_variants.sh): end the shards
  # (each shard's `timeout` passes the signal on to its pytest) and keep what they logged so far.
  # A plain `timeout` signals the whole process group anyway; `timeout --foreground` and a
  # parent's `kill` reach only this script.
  trap 'kill $(jobs -p) 2>/dev/null; wait; collect_logs; echo "pytest: stopped by a signal; partial logs in pytest_gpu.log"; exit 143' TERM INT
  pids=()
  for ((i = 0; i < shards; i++)); do
    gpu_env=()
    [ ${#gpus[@]} -gt 0 ] && gpu_env=(CUDA_VISIBLE_DEVICES=${gpus[i % ${#gpus[@]}]})
    # XLA's GEMM autotuning is off for the tests (as for the sanitizer): each test compiles its
    # XLA baseline for shapes of its own, and the baseline's error (the yardstick of the error-ratio
    # rule) comes from the bf16 rounding of its output, not from the GEMM algorithm. TEST_XLA_FLAGS
    # overrides it. --durations: the slowest tests of each shard that finishes.
    env "${gpu_env[@]}" FA3_TEST_SHARD=$i/$shards XLA_PYTHON_CLIENT_PREALLOCATE=false \
      XLA_FLAGS="${XLA_FLAGS:-} ${TEST_XLA_FLAGS---xla_gpu_autotune_level=0}" \
      FA3_TEST_SHARD_LIST=$logs/shard_$i.ids timeout --foreground "${TEST_TIMEOUT:-400}" python3 -P -m pytest ${PYTEST_ARGS:--m gpu tests} -v --no-header \
      -p no:cacheprovider -rfEsxX --durations=8 >"$logs/shard_$i.log" 2>&1 &
    pids+=($!)
  done
  # A shard cut at TEST_TIMEOUT prints no summary: tests/conftest.py prints each failure's report
  # as it happens in these shards (FA3_TEST_SHARD), so the messages survive the cut.
  # A shard that the split left without tests exits 5 (a small file, many shards): not a
  # failure by itself; a run in which no shard passed a test is (below).
  failed=0
  for pid in "${pids[@]}"; do wait "$pid"; rc=$?; [ $rc -eq 0 ] || [ $rc -eq 5 ] || failed=1; done
  trap - TERM INT
  collect_logs
  grep -hE "^(FAILED|ERROR|XPASS)|(passed|failed|error|skipped).* in [0-9.]+s|^not reached" "$OUT/pytest_gpu.log" | head -60
  [ $failed -eq 0 ] || { status=1; echo "pytest: a shard failed or timed out (rc != 0): see pytest_gpu.log"; }
  grep -qE "[0-9]+ passed" "$OUT/pytest_gpu.log" || { status=1; echo "pytest: no shard passed a test (all skipped or none collected)"; }
fi

if [ -n "${FP8_BENCH_ARGS+set}" ]; then
  # The FP8 forward side by side (benchmarks/bench_fp8.py): its json and md go to OUT too, so
  # run it with SKIP_BENCH=1 to stay within the device tool's 8 returned files.
  echo "== FP8 benchmark ${FP8_BENCH_ARGS}"
  timeout "${FP8_BENCH_TIMEOUT:-400}" python3 -P benchmarks/bench_fp8.py --out "$OUT" ${FP8_BENCH_ARGS} \
    2>&1 | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== benchmark ${BENCH_ARGS:-}"
  timeout "${BENCH_TIMEOUT:-400}" python3 -P benchmarks/bench_attention.py --out "$OUT" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log" | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
