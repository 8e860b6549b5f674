#!/usr/bin/env bash
# Compile-check the backward of one head dim for sm_90a (no GPU) and summarise, per kernel,
# registers, spills, ptxas performance notes (C75xx: serialised WGMMA) and, with cuobjdump, the
# HGMMA / WGMMA-wait (DEPBAR) / local-memory (LDL/STL) counts of the SASS.
#   compile_bwd.sh 256 [out.cubin] [cutlass::half_t]
# CUTLASS_INC (default: the nvidia-cutlass wheel in /work/venv), CUOBJDUMP (optional),
# BWD_DEFINES (e.g. "-DFA3_BWD_HD256_SPLIT_D=1": the FA3_BWD_DEFINES switches as -D flags).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=$(cd "$here/../../../.." && pwd)
hd=${1:?head dim}
out=${2:-/tmp/bwd_check_$$.cubin}
elem=${3:-cutlass::bfloat16_t}
inc=${CUTLASS_INC:-/work/venv/lib/python3.11/site-packages/cutlass_library/source/include}
rm -f "$out" "$out.sass"  # never summarise a stale cubin after a failed build
nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math \
  -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -cubin ${BWD_DEFINES:-} \
  -DBWD_HEAD_DIM="$hd" -DBWD_ELEMENT="$elem" \
  -I"$tree/cpp/include" -I"$tree/cpp/kernels" -I"$inc" \
  "$here/compile_bwd.cu" -o "$out" 2>&1 |
  grep -E "Compiling entry|registers|spill|error|warning|C75" | grep -v "^$" | cut -c1-240 || true
cuobj=${CUOBJDUMP:-$(command -v cuobjdump || echo /tmp/cuobj/nvidia/cu13/bin/cuobjdump)}
if [ -x "$cuobj" ]; then
  "$cuobj" -sass "$out" > "$out.sass"
  # Per kernel: HGMMA, WGMMA waits (WARPGROUP.DEPBAR), local-memory instructions.
  awk '/Function :/{f=$3; n[f]=1} /HGMMA/{h[f]++} /WARPGROUP.DEPBAR/{d[f]++} /[^A-Z](LDL|STL)[. ]/{l[f]++}
       END{for(k in n) printf "%s\n    HGMMA=%d DEPBAR=%d LDL/STL=%d\n", substr(k,1,160), h[k], d[k], l[k]}' "$out.sass"
  # WGMMA register hazards along every control-flow path (host_checks/wgmma_inflight_check.py).
  python3 "$here/../../host_checks/wgmma_inflight_check.py" "$out.sass" 2>&1 | tail -n 40 | cut -c1-200 || true
  echo "sass: $out.sass"
fi
