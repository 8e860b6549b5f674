// The nanobind module: FFI capsules for registration, and what this build contains.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "fa3/launch.h"
#include "ffi/attention_ffi.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule ffi_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict build_info() {
  nb::dict info;
  nb::list fwd, bwd, key_blocks;
  for (auto [dtype, name] : {std::pair{fa3::DType::kBF16, "bfloat16"}, std::pair{fa3::DType::kFP16, "float16"},
                             std::pair{fa3::DType::kE4M3, "float8_e4m3fn"}})
    for (int hd : fa3::kKernelHeadDims) {
      if (fa3::fwd_compiled(dtype, hd)) {
        fwd.append(nb::make_tuple(name, hd));
        key_blocks.append(nb::make_tuple(name, hd, fa3::fwd_table_key_block(dtype, hd, false),
                                         fa3::fwd_table_key_block(dtype, hd, true)));
      }
      if (fa3::bwd_compiled(dtype, hd)) bwd.append(nb::make_tuple(name, hd));
    }
  info["fwd"] = fwd;  // [(dtype name, head_dim), ...]
  info["bwd"] = bwd;
  // [(dtype name, head_dim, full tile's kBlockN, banded tile's kBlockN), ...] (fwd_table_key_block)
  info["fwd_key_blocks"] = key_blocks;
  info["cuda_version"] = FA3_CUDA_VERSION;
  info["cutlass_version"] = FA3_CUTLASS_VERSION;
  info["arch"] = "sm_90a";
  return info;
}

}  // namespace

NB_MODULE(_fa3_cuda, m) {
  m.def("registrations", []() {
    nb::dict r;
    r["jax_fa3_fwd"] = ffi_capsule(fa3_fwd);
    r["jax_fa3_fwd_fp8"] = ffi_capsule(fa3_fwd_fp8);
    r["jax_fa3_bwd"] = ffi_capsule(fa3_bwd);
    return r;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  m.def("build_info", &build_info,
        "Compiled (dtype, head_dim) per direction, the forward tables' key blocks, CUDA/CUTLASS versions, arch.");
}
