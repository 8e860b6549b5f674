// The nanobind module: FFI capsules for registration, and what this build contains.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "fa3/launch.h"
#include "ffi/attention_ffi.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule ffi_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

constexpr std::pair<fa3::DType, const char*> kDTypeNames[] = {
    {fa3::DType::kBF16, "bfloat16"}, {fa3::DType::kFP16, "float16"}, {fa3::DType::kE4M3, "float8_e4m3fn"}};

// fa3::fwd_key_block for a problem given by its sizes and band (clamped to the kernels' range, as
// jax_fa3/_masks.py clamp does for the FFI call), no documents.
int fwd_key_block(const std::string& dtype, int head_dim, int head_dim_v, int seqlen_q, int seqlen_k,
                  int64_t window_left, int64_t window_right) {
  auto clamp = [](int64_t w) { return int(std::clamp<int64_t>(w, -fa3::kUnbounded, fa3::kUnbounded)); };
  fa3::FwdParams p;
  bool known = false;
  for (auto [d, name] : kDTypeNames)
    if (dtype == name) p.dtype = d, known = true;
  if (!known) throw nb::value_error(("fwd_key_block: unknown dtype " + dtype).c_str());
  p.shape.batch = p.shape.heads_q = p.shape.heads_kv = 1;
  p.shape.head_dim = head_dim;
  p.shape.head_dim_v = head_dim_v;
  p.shape.seqlen_q = seqlen_q;
  p.shape.seqlen_k = seqlen_k;
  p.opts.window_left = clamp(window_left);
  p.opts.window_right = clamp(window_right);
  return fa3::fwd_key_block(p);
}

nb::dict build_info() {
  nb::dict info;
  nb::list fwd, bwd;
  for (auto [dtype, name] : kDTypeNames)
    for (int hd : fa3::kKernelHeadDims) {
      if (fa3::fwd_compiled(dtype, hd)) fwd.append(nb::make_tuple(name, hd));
      if (fa3::bwd_compiled(dtype, hd)) bwd.append(nb::make_tuple(name, hd));
    }
  info["fwd"] = fwd;  // [(dtype name, head_dim), ...]
  info["bwd"] = bwd;
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
  m.def("build_info", &build_info, "Compiled (dtype, head_dim) per direction, CUDA/CUTLASS versions, arch.");
  m.def("fwd_key_block", &fwd_key_block,
        "Keys per block of the forward tile a problem runs on (dtype name, head_dim, head_dim_v, seqlen_q, "
        "seqlen_k, window_left, window_right); 0 when no compiled kernel runs it.");
}
