#!/usr/bin/env bash
# compute-sanitizer gate for the installed jax_fa3 kernels (run on a Hopper machine):
#   scripts/sanitize.sh OUT_DIR
# runs scripts/sanitize_cases.py (small forward + backward calls that launch every compiled
# kernel) first without a sanitizer, under the JAX profiler (it checks that every compiled fa3
# kernel was launched, and compiles every case into JAX's persistent cache), then under
# memcheck, racecheck, initcheck and synccheck, the four side by side, which load the compiled
# cases from that cache: XLA compiling under the sanitizer segfaulted now and then on the H200
# (session 16: 4 of 12 processes, each right after XLA's "Very slow compile" alarm). Exits non-zero on any error or hazard of any tool, on a tool that did not finish,
# and on a kernel that no case launched. Writes OUT_DIR/sanitize.md (the table) and
# OUT_DIR/sanitize.log (every tool's report, then the coverage run).
# Each tool runs the cases in SANITIZE_PARTS processes (default 3; sanitize_cases.py --part).
# initcheck runs with --check-api-memory-access no: it does not see TMA stores as writes (the
# backward's dK/dV leave through them), so the host's read-back of those outputs would be
# reported as uninitialised; kernels' reads of uninitialised memory are still checked (the
# outputs' every element being written is what the GPU tests check, on poisoned buffers). Nor
# does it see bulk stores: the backward's fp32 dQ accumulator at d <= 128 is written only by
# them (never cleared), so its postprocess reads it by a bulk copy too, which initcheck does not
# check either; the GPU tests' NaN-poisoned workspace checks that every block it reads was written.
# Knobs (environment): SANITIZE_TOOLS (default "memcheck racecheck initcheck synccheck"),
# SANITIZE_SET (all | issue24: the five shapes of issue 24 | fp8: the FP8 forward's cases, its
# kernels' coverage), SANITIZE_COVERAGE=0 (skip the coverage run), SANITIZE_TIMEOUT (seconds
# per tool, default 480), COMPUTE_SANITIZER (the tool).
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
export XLA_PYTHON_CLIENT_ALLOCATOR=platform
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"
parts=${SANITIZE_PARTS:-3}
api_flag=()
# (grep reads the whole help: with -q, pipefail would see the tool's SIGPIPE)
if "$cs" --help 2>&1 | grep -- "--check-api-memory-access" >/dev/null; then api_flag=(--check-api-memory-access no); fi

t_start=$(date +%s)
export JAX_COMPILATION_CACHE_DIR=$work/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
# The compile pass (and, unless SANITIZE_COVERAGE=0, the coverage check).
cov_flag=()
[ "${SANITIZE_COVERAGE:-1}" = 1 ] && cov_flag=(--coverage)
t0=$(date +%s)
timeout "${SANITIZE_TIMEOUT:-480}" python3 -P scripts/sanitize_cases.py --set "$set_name" "${cov_flag[@]}" \
  >"$work/coverage.log" 2>&1
echo "$? $(( $(date +%s) - t0 ))" >"$work/coverage.rc"
for tool in $tools; do
  args=(--tool "$tool" --error-exitcode 99 --print-limit 100)
  # initcheck must see XLA's kernels write the buffers ours read; the other tools check ours only.
  if [ "$tool" = initcheck ]; then args+=("${api_flag[@]}"); else args+=(--kernel-name kns=fa3); fi
  for ((i = 0; i < parts; i++)); do
    (
      t0=$(date +%s)
      timeout "${SANITIZE_TIMEOUT:-480}" "$cs" "${args[@]}" python3 -P scripts/sanitize_cases.py --set "$set_name" \
        --part "$i/$parts" >"$work/$tool.$i.log" 2>&1
      echo "$? $(( $(date +%s) - t0 ))" >"$work/$tool.$i.rc"
    ) &
  done
done
wait

status=0
{
  echo "# compute-sanitizer over scripts/sanitize_cases.py --set $set_name"
  echo
  echo "$(date -u +%F) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1);" \
       "$("$cs" --version 2>/dev/null | grep -i version | head -1);" \
       "$(python3 -P -c 'import jax, jax_fa3; print("jax", jax.__version__, "| build", jax_fa3.build_info())' 2>&1 | tail -1)"
  echo "Cases: $(grep -h "cases ran" "$work"/coverage.log "$work"/*.0.log 2>/dev/null | head -1 | sed 's/sanitize_cases: //')" \
       "(per process: cases I, I + $parts, ... of the set); initcheck flags: ${api_flag[*]:-none}"
  echo
  echo "| tool ($parts processes each) | exit | errors | hazards (racecheck) | seconds |"
  echo "| --- | --- | --- | --- | --- |"
} >"$OUT/sanitize.md"
for tool in $tools; do
  rcs="" errors="" hazards="" secs=0
  for ((i = 0; i < parts; i++)); do
    read -r rc s <"$work/$tool.$i.rc"
    log=$work/$tool.$i.log
    e=$(grep -hoE "ERROR SUMMARY: [0-9]+ error" "$log" | tail -1 | grep -oE "[0-9]+")
    h=$(grep -hoE "RACECHECK SUMMARY: [0-9]+ hazard" "$log" | tail -1 | grep -oE "[0-9]+")
    # A part is clean when it exited 0, printed its summary (it finished) with 0 errors and 0
    # hazards, and ran all its cases.
    if [ "$rc" != 0 ] || [ -z "$e$h" ] || [ "${e:-0}" != 0 ] || [ "${h:-0}" != 0 ] || ! grep -q "cases ran" "$log"; then
      status=1
    fi
    rcs+="${rcs:+/}$rc" errors+="${errors:+/}${e:-none}" hazards+="${hazards:+/}${h:--}"
    [ "$s" -gt "$secs" ] && secs=$s
  done
  echo "| $tool | $rcs | $errors | $hazards | $secs |" >>"$OUT/sanitize.md"
done
read -r rc secs <"$work/coverage.rc"
[ "$rc" = 0 ] || status=1
echo >>"$OUT/sanitize.md"
echo "Compile pass (no sanitizer; exit $rc, $secs s): $(grep -h "^coverage:" "$work/coverage.log" | tr '\n' ' ')" >>"$OUT/sanitize.md"
grep -h "NOT LAUNCHED" "$work/coverage.log" >>"$OUT/sanitize.md"
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
    cat "$work/$tool".*.log | grep -E "^========= +(Error|Warning|Invalid|Uninitialized|Barrier|Race|Program hit|Host API|Read|Write|and)" |
      sed -E 's/0x[0-9a-f]{8,}/ADDR/g; s/\([0-9]+,[0-9]+,[0-9]+\)/(x,y,z)/g; s/__shared__ 0x[0-9a-f]+/__shared__ ADDR/' |
      sort | uniq -c | sort -rn | head -40
    echo '```'
  done
} >>"$OUT/sanitize.md"

for f in $(cd "$work" && ls *.log); do
  echo "==================== ${f%.log}"
  cat "$work/$f"
done >"$OUT/sanitize.log"
cat "$OUT/sanitize.md"
rm -rf "$work"
exit $status
