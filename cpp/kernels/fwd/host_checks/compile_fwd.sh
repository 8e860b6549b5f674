#!/usr/bin/env bash
# Compile-check forward instantiations for sm_90a (no GPU) and summarise, per kernel, registers,
# spills, ptxas performance notes (C75xx: serialised WGMMA, injected waits) and, when cuobjdump
# is found, HGMMA / local-memory (LDL/STL) counts, the highest register of the SASS and the WGMMA
# in-flight register check.
#   compile_fwd.sh 'fa3::FwdTraits<cutlass::bfloat16_t, 128, 128, 176, 2, true, false>' [out.cubin]
#   compile_fwd.sh 128 [out.cubin] [cutlass::half_t]     # the tile table of head dim 128
# CUTLASS_INC (default: the nvidia-cutlass wheel in /work/venv), CUOBJDUMP (optional),
# FWD_DEFINES (e.g. "-DFA3_FWD_DIRECT_O=0 -DFA3_FWD_DYNAMIC_CODE=0", the A/B switches).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=$(cd "$here/../../../.." && pwd)
what=${1:?traits type or head dim}
out=${2:-/tmp/fwd_check_$$.cubin}
inc=${CUTLASS_INC:-/work/venv/lib/python3.11/site-packages/cutlass_library/source/include}
hdr=$(mktemp /tmp/fwd_traits_XXXX.h)
if [[ "$what" =~ ^[0-9]+$ ]]; then
  printf '#define FWD_HEAD_DIM %s\n#define FWD_ELEMENT %s\n' "$what" "${3:-cutlass::bfloat16_t}" > "$hdr"
else
  echo "#define FWD_TRAITS $what" > "$hdr"   # via a header: nvcc splits -D values at commas
fi
nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math \
  -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -cubin ${FWD_DEFINES:-} \
  -I"$tree/cpp/include" -I"$tree/cpp/kernels" -I"$inc" \
  -include "$hdr" "$here/compile_fwd.cu" -o "$out" 2>&1 |
  grep -E "Compiling entry|registers|spill|error|warning|C75" | grep -v "^$" |
  sed -E 's/.*(Compiling entry function).*FwdTraitsIN7cutlass[0-9]+([a-z0-9_]+)ELi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELb([01])(ELb([01]))?.*/\1 fwd<\2, d=\3, \4x\5, stages=\6, pp=\7, banded=\9>/' | cut -c1-220 || true
rm -f "$hdr"
cuobj=${CUOBJDUMP:-$(command -v cuobjdump || echo /tmp/cuobj/nvidia/cu13/bin/cuobjdump)}
if [ -x "$cuobj" ]; then
  "$cuobj" -sass "$out" > "$out.sass"
  python3 "$here/sass_summary.py" "$out.sass"
  # WGMMA register hazards along every control-flow path (host_checks/wgmma_inflight_check.py).
  python3 "$here/../../host_checks/wgmma_inflight_check.py" "$out.sass" 2>&1 | tail -n 40 |
    sed -E 's/_ZN3fa310fwd_kernelINS_9FwdTraitsIN7cutlass[0-9]+([a-z0-9_]+)ELi([0-9]+)ELi([0-9]+)ELi([0-9]+)ELi([0-9]+)[A-Za-z0-9_]*/in-flight check fwd<\1, d=\2, \3x\4, stages=\5>/' || true
  echo "sass: $out.sass"
fi
