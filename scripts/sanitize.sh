#!/usr/bin/env bash
# compute-sanitizer gate for the installed jax_fa3 kernels (run on a Hopper machine):
#   scripts/sanitize.sh OUT_DIR
# runs scripts/sanitize_cases.py (small forward + backward calls that launch every compiled
# kernel) under memcheck, racecheck, initcheck and synccheck, the four side by side, plus one
# run without a sanitizer under the JAX profiler that checks every compiled fa3 kernel was
# launched. Exits non-zero on any error or hazard of any tool, on a tool that did not finish,
# and on a kernel that no case launched. Writes OUT_DIR/sanitize.md (the table) and
# OUT_DIR/sanitize.log (every tool's report, then the coverage run).
# Knobs (environment): SANITIZE_TOOLS (default "memcheck racecheck initcheck synccheck"),
# SANITIZE_SET (all | issue24: the five shapes of issue 24), SANITIZE_COVERAGE=0 (skip the
# coverage run), SANITIZE_TIMEOUT (seconds per tool, default 480), COMPUTE_SANITIZER (the tool).
# The jax_fa3 under test is whatever python3 imports (PYTHONPATH).
set -uo pipefail
OUT=${1:?usage: scripts/sanitize.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
tools=${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}
set_name=${SANITIZE_SET:-all}
cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
[ -x "$cs" ] || { echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2; exit 2; }
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# One cudaMalloc per buffer (memcheck then sees each buffer's end), and no CUDA graphs around
# the calls (each kernel launch is the sanitizer's plain unit).
export XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="

t_start=$(date +%s)
for tool in $tools; do
  args=(--tool "$tool" --error-exitcode 99 --print-limit 200)
  # initcheck must see XLA's kernels write the buffers ours read; the other tools check ours only.
  [ "$tool" = initcheck ] || args+=(--kernel-name kns=fa3)
  [ "$tool" = racecheck ] && args+=(--racecheck-report all)
  (
    t0=$(date +%s)
    timeout "${SANITIZE_TIMEOUT:-480}" "$cs" "${args[@]}" python3 -P scripts/sanitize_cases.py --set "$set_name" \
      >"$work/$tool.log" 2>&1
    echo "$? $(( $(date +%s) - t0 ))" >"$work/$tool.rc"
  ) &
done
if [ "${SANITIZE_COVERAGE:-1}" = 1 ]; then
  (
    t0=$(date +%s)
    timeout "${SANITIZE_TIMEOUT:-480}" python3 -P scripts/sanitize_cases.py --set "$set_name" --coverage \
      >"$work/coverage.log" 2>&1
    echo "$? $(( $(date +%s) - t0 ))" >"$work/coverage.rc"
  ) &
fi
wait

status=0
{
  echo "# compute-sanitizer over scripts/sanitize_cases.py --set $set_name"
  echo
  echo "$(date -u +%F) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1);" \
       "$("$cs" --version 2>/dev/null | grep -i version | head -1);" \
       "$(python3 -P -c 'import jax, jax_fa3; print("jax", jax.__version__, "| build", jax_fa3.build_info())' 2>&1 | tail -1)"
  echo "Cases: $(grep -h "cases ran" "$work"/*.log | head -1 | sed 's/sanitize_cases: //')"
  echo
  echo "| tool | exit | errors | hazards (racecheck) | seconds |"
  echo "| --- | --- | --- | --- | --- |"
} >"$OUT/sanitize.md"
for tool in $tools; do
  read -r rc secs <"$work/$tool.rc"
  log=$work/$tool.log
  errors=$(grep -hoE "ERROR SUMMARY: [0-9]+ error" "$log" | tail -1 | grep -oE "[0-9]+")
  hazards=$(grep -hoE "RACECHECK SUMMARY: [0-9]+ hazard" "$log" | tail -1 | grep -oE "[0-9]+")
  ok=1
  [ "$rc" = 0 ] || ok=0
  [ -n "$errors$hazards" ] || ok=0  # no summary line: the tool did not finish
  [ "${errors:-1}" = 0 ] || ok=0
  [ "${hazards:-0}" = 0 ] || ok=0
  grep -q "cases ran" "$log" || ok=0
  [ $ok = 1 ] || status=1
  echo "| $tool | $rc | ${errors:-none} | ${hazards:--} | $secs |" >>"$OUT/sanitize.md"
done
if [ "${SANITIZE_COVERAGE:-1}" = 1 ]; then
  read -r rc secs <"$work/coverage.rc"
  [ "$rc" = 0 ] || status=1
  echo >>"$OUT/sanitize.md"
  echo "Coverage (JAX profiler, no sanitizer; exit $rc, $secs s): $(grep -h "^coverage:" "$work/coverage.log" | tr '\n' ' ')" >>"$OUT/sanitize.md"
  grep -h "NOT LAUNCHED" "$work/coverage.log" >>"$OUT/sanitize.md"
fi
{
  echo
  echo "Result: $([ $status = 0 ] && echo clean || echo FAILED) ($(( $(date +%s) - t_start )) s)."
  # The distinct reports: racecheck's hazard pairs, the other tools' first line of each error.
  echo
  echo "## Reports (distinct)"
  for tool in $tools; do
    echo
    echo "### $tool"
    echo '```'
    grep -hE "^========= (Error|Warning|Invalid|Uninitialized|Barrier|Race|Program hit)" "$work/$tool.log" |
      sed -E 's/0x[0-9a-f]{8,}/ADDR/g' | sort | uniq -c | sort -rn | head -40
    echo '```'
  done
} >>"$OUT/sanitize.md"

for f in $tools coverage; do
  [ -f "$work/$f.log" ] || continue
  echo "==================== $f"
  cat "$work/$f.log"
done >"$OUT/sanitize.log"
cat "$OUT/sanitize.md"
rm -rf "$work"
exit $status
