#!/usr/bin/env bash
# The fingerprint of what a jax_fa3 build is made of: one sha1 over the build's inputs (cpp/,
# jax_fa3/, CMakeLists.txt, pyproject.toml) in a source tree, git or not.
#   scripts/source_fingerprint.sh [TREE]      (default: this checkout)
# scripts/prebuild_wheel.sh records it beside a wheel; scripts/gpu_cycle.sh PREBUILT=... refuses
# a wheel whose fingerprint is not the tree's, so a stale wheel cannot be tested as new code.
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
find cpp jax_fa3 CMakeLists.txt pyproject.toml -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' \
  -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1
