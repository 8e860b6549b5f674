#!/usr/bin/env bash
# Nsight Compute on one grid point (benchmarks/profile_point.py), after jax_fa3 is installed
# (scripts/gpu_cycle.sh with SKIP_SANITIZE=1 SKIP_TESTS=1 SKIP_BENCH=1):
#   scripts/ncu_point.sh OUT_DIR --impl jax_fa3 --direction bwd --head-dim 256 --seqlen 8192 --causal 1
# Profiles the last launch of each kernel matching $KERNELS (default: our forward and backward
# main kernels, the split-D hd256 one included) with the sections that say where the time
# goes: speed of light, compute workload (tensor pipe), warp states (stall reasons), occupancy,
# memory. Clocks stay as they are (--clock-control none). Writes OUT_DIR/ncu_<tag>.txt (and .ncu-rep unless NCU_REP=0).
# $KERNELS matches the demangled name: FA3's kernels are all `cutlass::device_kernel<...>` by their
# function name (session 27's FA3 profile matched none), so name them by their template, e.g.
# KERNELS="FlashAttnBwdSm90".
# NCU_SECTIONS: the sections, space-separated (e.g. "SpeedOfLight" for kernel durations alone).
# Per-kernel times of a whole call: NCU_DURATIONS=1 (one metric, gpu__time_duration.sum, so one
# pass and no replay: ~20 s a point; every kernel but XLA's loop/concatenate fusions, from the
# first launch; session 11 split the backward into pre/main/post this way, ours and cuDNN's).
# With sections, name the kernels (a bare "." catches XLA's fusions, and session 10 saw ncu fail
# to replay input_concatenate_fusion and stop; multi-pass replays of a whole call are slow).
# NCU_SOURCE=1: also the warp-stall sampling per SASS instruction (the SourceCounters section and
# the report's source page), summarized by scripts/ncu_source_summary.py into
# OUT_DIR/ncu_<tag>_source.txt (stall reasons, the hottest instructions with what precedes them,
# the main loop's instruction mix); the report itself is not kept (NCU_REP is forced off).
# NCU_EXTRA: more ncu options, word-split (e.g. the stall breakdown, which the sections' headers
# lack here: NCU_EXTRA="--print-details all" or
# NCU_EXTRA="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio").
set -uo pipefail
OUT=${1:?usage: scripts/ncu_point.sh OUT_DIR [profile_point.py arguments]}
shift
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
tag=$(echo "$*" | tr -c 'A-Za-z0-9' '_' | sed 's/__*/_/g; s/^_//; s/_$//')
tag=${tag:-default}
sections=()
if [ "${NCU_DURATIONS:-0}" = 1 ]; then
  sections=(--metrics gpu__time_duration.sum)
  KERNELS=${KERNELS:-'^(?!.*(input_concatenate|loop_))'} NCU_SKIP=${NCU_SKIP:-0} NCU_COUNT=${NCU_COUNT:-40} NCU_REP=${NCU_REP:-0}
else
  for sec in ${NCU_SECTIONS:-SpeedOfLight ComputeWorkloadAnalysis WarpStateStats Occupancy MemoryWorkloadAnalysis LaunchStats}; do
    sections+=(--section "$sec")
  done
fi
rep=()
if [ "${NCU_SOURCE:-0}" = 1 ]; then
  sections+=(--section SourceCounters --import-source no)
  rep=(--export "/tmp/ncu_source_$tag" --force-overwrite)
elif [ "${NCU_REP:-1}" = 1 ]; then
  rep=(--export "$OUT/ncu_$tag" --force-overwrite)
fi
PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${NCU_TIMEOUT:-300}" \
  ncu --clock-control none --target-processes all \
    --kernel-name-base demangled --kernel-name "regex:${KERNELS:-fwd_kernel|bwd_main_kernel|bwd_split_d_kernel}" --launch-skip "${NCU_SKIP:-1}" --launch-count "${NCU_COUNT:-1}" \
    "${sections[@]}" ${NCU_EXTRA:-} "${rep[@]}" python3 -P benchmarks/profile_point.py "$@" 2>&1 | tee "$OUT/ncu_$tag.txt" | tail -120
status=${PIPESTATUS[0]}
if [ "${NCU_SOURCE:-0}" = 1 ]; then
  ncu -i "/tmp/ncu_source_$tag.ncu-rep" >>"$OUT/ncu_$tag.txt" 2>&1  # the sections, as text
  ncu -i "/tmp/ncu_source_$tag.ncu-rep" --page source --csv --print-source sass >"/tmp/ncu_source_$tag.csv" 2>&1
  python3 scripts/ncu_source_summary.py "/tmp/ncu_source_$tag.csv" >"$OUT/ncu_${tag}_source.txt" 2>&1 || status=1
  head -40 "$OUT/ncu_${tag}_source.txt"
fi
exit "$status"
