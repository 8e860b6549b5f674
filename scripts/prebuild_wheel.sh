#!/usr/bin/env bash
# Build, on the CPU machine, the jax_fa3 wheel a device call installs instead of building:
#   scripts/prebuild_wheel.sh NAME [DEFINES]        -> .whl/prebuilt/NAME/
# Why: the device's minutes go to tests and benchmarks, and a device build can run far slower
# than usual (session 35: builds that had taken 150 s ran past 600 s). A wheel installs there in
# seconds (session 36: every head dim, bf16 / fp16 / e4m3, forward and backward).
# The wheel is the device's: CPython 3.12, the FFI headers of jax 0.11.2 (the device's JAX),
# CUTLASS from the nvidia-cutlass wheel in .whl/; cudart is linked statically, so the extension
# needs only libc / libstdc++ / libm. The build set is FA3_HEAD_DIMS / FA3_DTYPES /
# FA3_DIRECTIONS, and VARIANT_SRC_NAME=DIR builds from another source tree, as for
# scripts/build_variant.sh (scripts/variant_env.sh); DEFINES go to FA3_KERNEL_DEFINES.
# NAME/ holds the wheel, source.txt (the source fingerprint, the build set, the defines) and
# build.log (ptxas lines only: it travels to the device with .whl/, 64 MiB in all).
# On the device: scripts/build_variant.sh NAME installs .whl/prebuilt/NAME when it is there;
# scripts/gpu_cycle.sh with PREBUILT=.whl/prebuilt/NAME does the same for a whole cycle. Both
# refuse a wheel whose fingerprint (scripts/source_fingerprint.sh) is not the tree's.
# Python 3.12 ($PREBUILD_PYTHON, default python3.12) makes a venv in $PREBUILD_VENV (default
# build/prebuild-venv) with the pinned build tools the first time (needs PyPI).
set -uo pipefail
name=${1:?usage: scripts/prebuild_wheel.sh NAME [DEFINES]}
defines=${2-}
cd "$(dirname "$0")/.."
root=$PWD
source scripts/variant_env.sh
variant_env "$name" || exit 2
src=$(cd "$variant_src" && pwd)

venv=${PREBUILD_VENV:-$root/build/prebuild-venv}
if [ ! -f "$venv/tools-installed" ]; then
  py=${PREBUILD_PYTHON:-}
  for c in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    [ -n "$py" ] && break
    "$c" -c '' 2>/dev/null && py=$c
  done
  [ -n "$py" ] || { echo "prebuild_wheel: no Python 3.12 found; set PREBUILD_PYTHON" >&2; exit 1; }
  echo "== making $venv ($py and the device's build tools)"
  rm -rf "$venv" && "$py" -m venv "$venv" && "$venv/bin/python" -m pip install -q scikit-build-core==0.11.6 \
    nanobind==2.9.2 jax==0.11.2 jaxlib==0.11.2 cmake==4.4.5 ninja==1.13.2 && touch "$venv/tools-installed" || exit 1
fi
[ "$("$venv/bin/python" -c 'import sys; print(sys.version_info[:2] == (3, 12))')" = True ] ||
  { echo "prebuild_wheel: $venv is not Python 3.12 (the device's)" >&2; exit 1; }

cutlass=${CUTLASS_DIR:-}
if [ -z "$cutlass" ]; then
  whl=$(compgen -G ".whl/nvidia_cutlass-*.whl" | head -1)
  [ -n "$whl" ] || { echo "prebuild_wheel: no CUTLASS: set CUTLASS_DIR or run ../shared/tools/gpu_wheels.sh .whl" >&2; exit 1; }
  "$venv/bin/python" -m pip install -q --no-index --no-deps --target build/prebuild-cutlass --upgrade "$whl" || exit 1
  cutlass=$root/build/prebuild-cutlass/cutlass_library/source/include
fi

# Built into NAME.new, which replaces NAME only once the build succeeded.
out=$root/.whl/prebuilt/$name
new=$out.new
rm -rf "$new" && mkdir -p "$new"
log=$root/build/prebuild_$name.log
echo "== $name: dims=${FA3_HEAD_DIMS:-all} dtypes=${FA3_DTYPES:-all} dirs=${FA3_DIRECTIONS:-default} defines=${defines:-none} ($(nproc) cores)"
t0=$(date +%s)
(cd "$src" && PATH=$venv/bin:$PATH FA3_CUDA=ON FA3_PTXAS_VERBOSE=ON FA3_KERNEL_DEFINES="$defines" \
  CUTLASS_DIR=$cutlass CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) SKBUILD_BUILD_DIR=$root/build/prebuild_$name \
  python -m pip wheel -v --no-build-isolation --no-deps -w "$new" .) >"$log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  grep -E "error|Error" "$log" | head -40; tail -20 "$log"; rm -rf "$new"; exit 1
fi
grep -E "Compiling entry|Used [0-9]+ registers|spill|C75[0-9][0-9]|warning" "$log" >"$new/build.log"
{
  echo "fingerprint $(scripts/source_fingerprint.sh "$src")"
  echo "defines ${defines}"
  echo "build dims=${FA3_HEAD_DIMS:-all} dtypes=${FA3_DTYPES:-all} dirs=${FA3_DIRECTIONS:-default}"
  echo "commit $(git -C "$src" rev-parse --short HEAD 2>/dev/null || echo none)$(git -C "$src" diff --quiet HEAD -- cpp jax_fa3 CMakeLists.txt pyproject.toml 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built $(date -u +%FT%TZ) in $(( $(date +%s) - t0 )) s"
} >"$new/source.txt"
rm -rf "$out" && mv "$new" "$out"
echo "== $name: $(ls "$out"/*.whl) ($(du -h "$out"/*.whl | cut -f1)), built in $(( $(date +%s) - t0 )) s"
echo "   ptxas: $(grep -c C7512 "$out/build.log") C7512 notes (serialized WGMMAs), $(grep -cE 'stack frame, [1-9][0-9]* bytes spill stores' "$out/build.log") functions with spill stores (docs/kernels.md lists where)"
