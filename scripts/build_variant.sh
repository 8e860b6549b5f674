#!/usr/bin/env bash
# Build and install one kernel build variant into /tmp/variant_NAME (no tests, no benchmark):
# the build step of scripts/ab_variants.sh and scripts/suite_variants.sh.
#   scripts/build_variant.sh NAME DEFINES
# DEFINES (NAME=VALUE;...) go to FA3_KERNEL_DEFINES (an experiment's switches). The build set is
# FA3_HEAD_DIMS / FA3_DTYPES / FA3_DIRECTIONS as for scripts/gpu_cycle.sh; the same knob with
# _NAME appended (e.g. FA3_HEAD_DIMS_h64="64", FA3_DIRECTIONS_xt=fwd) narrows one variant.
# VARIANT_SRC_NAME=DIR builds the variant from another source tree (e.g. the commit before a
# refactor, unpacked with `git archive`) with that tree's own scripts. The cycle's output
# folder is /tmp/ab_NAME (build.log, info.txt), its log /tmp/ab_NAME.log, and the exit status
# also goes to /tmp/ab_NAME.rc (what ab_variants.sh AB_REUSE=1 reads).
# A wheel built beforehand on the CPU machine (scripts/prebuild_wheel.sh NAME DEFINES, in
# .whl/prebuilt/NAME) is installed instead of building, if its sources and defines match.
set -uo pipefail
name=${1:?usage: scripts/build_variant.sh NAME DEFINES}
cd "$(dirname "$0")/.."
source scripts/variant_env.sh
variant_env "$name" || exit 2
src=$variant_src
# Each variant its own CMake build folder: ab_variants.sh AB_PIPELINE=parallel builds them at once.
prebuilt=$PWD/.whl/prebuilt/$name
[ -d "$prebuilt" ] || prebuilt=
(cd "$src" && env PREBUILT="$prebuilt" SKBUILD_BUILD_DIR="build/variant_$name" FA3_KERNEL_DEFINES="${2-}" \
  INSTALL_TARGET="/tmp/variant_$name" SKIP_SANITIZE=1 SKIP_TESTS=1 SKIP_BENCH=1 \
  scripts/gpu_cycle.sh "/tmp/ab_$name") >"/tmp/ab_$name.log" 2>&1
rc=$?
echo $rc >"/tmp/ab_$name.rc"
exit $rc
