#!/usr/bin/env bash
# SASS digest of the default kernel instantiations, on a machine with nvcc and no GPU: did a
# refactor change the code the GPU runs? Compiles each (direction, head dim) translation unit as
# the build does (cpp/instantiations/*.cu.in), dumps each kernel's SASS without addresses and
# writes OUT/digest.txt: one line per kernel (SASS md5, registers, spill bytes, mangled name),
# and OUT/inflight.txt: the WGMMA register-hazard check of every listing (scripts/sass/).
#   scripts/sass_digest.sh OUT [TREE] ; diff base/digest.txt cand/digest.txt
# TREE (default: this checkout) is the source tree to compile; DIGEST_DIRECTIONS ("fwd bwd"),
# DIGEST_HEAD_DIMS ("64 96 128 192 256"), DIGEST_ELEMENT (cutlass::bfloat16_t) and DIGEST_JOBS (2)
# narrow it; CUTLASS_INC and CUOBJDUMP locate the tools (defaults: the nvidia-cutlass wheel of
# the python3 on PATH, cuobjdump on PATH or the PyPI one in /tmp/cuobj).
set -euo pipefail
out=$(mkdir -p "${1:?usage: scripts/sass_digest.sh OUT [TREE]}" && cd "$1" && pwd)
tree=$(cd "${2:-$(dirname "$0")/..}" && pwd)
inc=${CUTLASS_INC:-$(python3 -c "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(s.submodule_search_locations[0], 'source', 'include'))")}
cuobj=${CUOBJDUMP:-$(command -v cuobjdump || echo /tmp/cuobj/nvidia/cu13/bin/cuobjdump)}
[ -x "$cuobj" ] || { echo "sass_digest: no cuobjdump (pip install --target /tmp/cuobj nvidia-cuda-cuobjdump)" >&2; exit 2; }
element=${DIGEST_ELEMENT:-cutlass::bfloat16_t}

compile_one() {  # compile_one DIR HD: OUT/DIR_hdHD.{cu,cubin,ptxas,sass}
  local dir=$1 hd=$2 stem="$out/$1_hd$2"
  sed -e "s/@ELEMENT@/$element/" -e "s/@HEAD_DIM@/$hd/" "$tree/cpp/instantiations/$dir.cu.in" >"$stem.cu"
  nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr --use_fast_math \
    -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -cubin \
    -I"$tree/cpp" -I"$tree/cpp/include" -I"$tree/cpp/kernels" -isystem "$inc" \
    "$stem.cu" -o "$stem.cubin" >"$stem.ptxas" 2>&1 || { tail -20 "$stem.ptxas" >&2; return 1; }
  "$cuobj" -sass "$stem.cubin" >"$stem.sass"
}
export -f compile_one
export out tree inc cuobj element
for dir in ${DIGEST_DIRECTIONS:-fwd bwd}; do
  for hd in ${DIGEST_HEAD_DIMS:-64 96 128 192 256}; do echo "$dir $hd"; done
done | xargs -P "${DIGEST_JOBS:-2}" -n 2 bash -c 'compile_one "$0" "$1"'

# Per kernel: the SASS with addresses and encodings stripped, hashed; ptxas's registers and spills.
python3 - "$out" <<'EOF'
import glob, hashlib, os, re, sys
out = sys.argv[1]
rows = []
for sass in sorted(glob.glob(os.path.join(out, "*.sass"))):
    ptxas = open(sass[:-5] + ".ptxas").read()
    usage = {}
    for m in re.finditer(r"Compiling entry function '(\w+)'.*?Used (\d+) registers.*?(?=Compiling entry|\Z)", ptxas, re.S):
        usage[m.group(1)] = m.group(2)
    spills = dict(re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", ptxas, re.S))
    for m in re.finditer(r"Function : (\w+)\n(.*?)(?=\n\s*\.{4,}|\Z)", open(sass).read(), re.S):
        name, body = m.group(1), m.group(2)
        code = "\n".join(re.sub(r"/\*[0-9a-f]+\*/", "", l.split(";")[0]).strip()
                         for l in body.splitlines() if ";" in l)
        digest = hashlib.md5(code.encode()).hexdigest()[:12]
        rows.append(f"{digest} regs={usage.get(name, '?')} spill={spills.get(name, '?')} {name}")
open(os.path.join(out, "digest.txt"), "w").write("\n".join(sorted(rows, key=lambda r: r.split()[-1])) + "\n")
print(f"{len(rows)} kernels -> {os.path.join(out, 'digest.txt')}")
EOF

# WGMMA in-flight register hazards along every control-flow path (exit 1 when one is found).
status=0
for sass in "$out"/*.sass; do
  echo "== $(basename "$sass")"
  python3 "$(dirname "$0")/sass/wgmma_inflight_check.py" "$sass" 2>&1 | tail -n 5 || status=1
done >"$out/inflight.txt"
[ $status = 0 ] && echo "WGMMA in-flight check: clean ($out/inflight.txt)" || { echo "WGMMA in-flight check: hazards, see $out/inflight.txt" >&2; exit 1; }
