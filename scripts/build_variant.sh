#!/usr/bin/env bash
# Build and install one kernel build variant into /tmp/variant_NAME (no tests, no benchmark):
# the build step of scripts/ab_variants.sh and scripts/suite_variants.sh.
#   scripts/build_variant.sh NAME DEFINES
# DEFINES (NAME=VALUE;...): the FA3_FWD_* ones go to FA3_FWD_DEFINES, the FA3_BWD_* ones to
# FA3_BWD_DEFINES (so one variant may set both), others by AB_DIRECTION (fwd, or bwd); a
# direction with none keeps the caller's FA3_*_DEFINES. The build set is
# FA3_HEAD_DIMS / FA3_DTYPES / FA3_DIRECTIONS as for scripts/gpu_cycle.sh; the same knob with
# _NAME appended (e.g. FA3_HEAD_DIMS_h64="64", FA3_DIRECTIONS_xt=fwd) narrows one variant. The cycle's output
# folder is /tmp/ab_NAME (build.log, info.txt), its log /tmp/ab_NAME.log, and the exit status
# also goes to /tmp/ab_NAME.rc (what ab_variants.sh AB_REUSE=1 reads).
set -uo pipefail
name=${1:?usage: scripts/build_variant.sh NAME DEFINES}
[[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || { echo "build_variant: bad variant name '$name'" >&2; exit 2; }
cd "$(dirname "$0")/.."
fwd=() bwd=()
IFS=';' read -r -a defines <<<"${2-}"
for d in "${defines[@]}"; do
  case $d in
    "") ;;
    FA3_FWD_*) fwd+=("$d") ;;
    FA3_BWD_*) bwd+=("$d") ;;
    *) if [ "${AB_DIRECTION:-fwd}" = bwd ]; then bwd+=("$d"); else fwd+=("$d"); fi ;;
  esac
done
joined() { local IFS=';'; echo "$*"; }
fwd_defs=$(joined "${fwd[@]}") bwd_defs=$(joined "${bwd[@]}")
for knob in FA3_HEAD_DIMS FA3_DTYPES FA3_DIRECTIONS; do
  own=${knob}_$name
  [ -z "${!own:-}" ] || export "$knob=${!own}"
done
# Each variant its own CMake build folder: ab_variants.sh AB_PIPELINE=parallel builds them at once.
env SKBUILD_BUILD_DIR="build/variant_$name" FA3_FWD_DEFINES="${fwd_defs:-${FA3_FWD_DEFINES:-}}" FA3_BWD_DEFINES="${bwd_defs:-${FA3_BWD_DEFINES:-}}" \
  INSTALL_TARGET="/tmp/variant_$name" SKIP_SANITIZE=1 SKIP_TESTS=1 SKIP_BENCH=1 \
  scripts/gpu_cycle.sh "/tmp/ab_$name" >"/tmp/ab_$name.log" 2>&1
rc=$?
echo $rc >"/tmp/ab_$name.rc"
exit $rc
