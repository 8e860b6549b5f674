// XLA FFI handlers: validate operands, fill the plain params, take scratch, launch on XLA's
// stream. Every failure is an ffi::Error naming the operand; nothing aborts, nothing syncs.
#include "ffi/attention_ffi.h"

#include <cuda_runtime_api.h>

#include <string>

#include "fa3/launch.h"

namespace ffi = xla::ffi;

namespace fa3 {
namespace {

std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + ")";
}

ffi::Error invalid(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_fa3: " + msg);
}

// Element type of q; k, v (and the others passed) must match it.
ffi::Error element_dtype(ffi::AnyBuffer q, DType* out) {
  switch (q.element_type()) {
    case ffi::DataType::BF16: *out = DType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = DType::kFP16; return ffi::Error::Success();
    case ffi::DataType::F8E4M3FN: *out = DType::kE4M3; return ffi::Error::Success();
    default: return invalid("q must be bfloat16, float16 or float8_e4m3fn for the Hopper kernel");
  }
}

ffi::Error check_same(const char* name, ffi::AnyBuffer x, ffi::AnyBuffer like, const char* like_name) {
  if (x.element_type() != like.element_type())
    return invalid(std::string(name) + " must have the dtype of " + like_name);
  auto a = x.dimensions(), b = like.dimensions();
  if (a.size() != b.size()) return invalid(std::string(name) + " must have the shape of " + like_name);
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i])
      return invalid(std::string(name) + " has shape " + dims_str(a) + ", expected " + dims_str(b) +
                     " like " + like_name);
  return ffi::Error::Success();
}

// Shape of (q, k, v) as the kernels see it, checked. v's head dim may differ from q's and k's.
ffi::Error attention_shape(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, DType* dtype,
                           AttentionShape* s) {
  if (auto e = element_dtype(q, dtype); e.failure()) return e;
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4) return invalid("q must be (batch, seqlen_q, heads, head_dim), got " + dims_str(qd));
  if (kd.size() != 4) return invalid("k must be (batch, seqlen_k, heads_kv, head_dim), got " + dims_str(kd));
  if (vd.size() != 4) return invalid("v must be (batch, seqlen_k, heads_kv, head_dim_v), got " + dims_str(vd));
  if (k.element_type() != q.element_type()) return invalid("k must have the dtype of q");
  if (v.element_type() != q.element_type()) return invalid("v must have the dtype of q");
  s->batch = static_cast<int>(qd[0]);
  s->seqlen_q = static_cast<int>(qd[1]);
  s->heads_q = static_cast<int>(qd[2]);
  s->head_dim = static_cast<int>(qd[3]);
  s->seqlen_k = static_cast<int>(kd[1]);
  s->heads_kv = static_cast<int>(kd[2]);
  s->head_dim_v = static_cast<int>(vd[3]);
  if (kd[0] != qd[0] || kd[3] != qd[3])
    return invalid("k " + dims_str(kd) + " must match q " + dims_str(qd) + " in batch and head_dim");
  if (vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return invalid("v " + dims_str(vd) + " must match k " + dims_str(kd) + " in batch, seqlen_k and heads_kv");
  if (s->heads_kv == 0 || s->heads_q % s->heads_kv != 0)
    return invalid("heads of q (" + std::to_string(s->heads_q) + ") must be a multiple of heads of k (" +
                   std::to_string(s->heads_kv) + ")");
  if (s->seqlen_q < 1 || s->seqlen_k < 1 || s->batch < 1)
    return invalid("batch and seqlens must be positive, got q " + dims_str(qd) + ", k " + dims_str(kd));
  // TMA needs 16-byte rows; the stores write 8-column pieces.
  for (int d : {s->head_dim, s->head_dim_v})
    if (d < 8 || d % 8 != 0 || d > 256)
      return invalid("head dims must be multiples of 8 up to 256, got q " + dims_str(qd) + ", v " + dims_str(vd));
  return ffi::Error::Success();
}

// The (b, sq, hq, head_dim_v) shape of out and dout, and their dtype: q's, or bfloat16 for FP8 q.
ffi::Error check_out_shape(const char* name, ffi::AnyBuffer x, ffi::AnyBuffer q, const AttentionShape& s) {
  auto d = x.dimensions();
  if (q.element_type() == ffi::DataType::F8E4M3FN) {
    if (x.element_type() != ffi::DataType::BF16) return invalid(std::string(name) + " must be bfloat16 for FP8 q");
  } else if (x.element_type() != q.element_type()) {
    return invalid(std::string(name) + " must have the dtype of q");
  }
  if (d.size() != 4 || d[0] != s.batch || d[1] != s.seqlen_q || d[2] != s.heads_q || d[3] != s.head_dim_v)
    return invalid(std::string(name) + " has shape " + dims_str(d) + ", expected (batch, seqlen_q, heads_q, " +
                   "head_dim of v) = (" + std::to_string(s.batch) + ", " + std::to_string(s.seqlen_q) + ", " +
                   std::to_string(s.heads_q) + ", " + std::to_string(s.head_dim_v) + ")");
  return ffi::Error::Success();
}

std::string head_dims_str(const AttentionShape& s) {
  return s.head_dim == s.head_dim_v ? "head_dim " + std::to_string(s.head_dim)
                                    : "head dims " + std::to_string(s.head_dim) + " (q, k) and " +
                                          std::to_string(s.head_dim_v) + " (v)";
}

ffi::Error attention_options(float softmax_scale, float softcap, int32_t window_left,
                             int32_t window_right, AttentionOptions* o) {
  if (!(softcap >= 0.0f)) return invalid("softcap must be >= 0");
  if (window_left < -kUnbounded || window_left > kUnbounded || window_right < -kUnbounded ||
      window_right > kUnbounded)
    return invalid("window bounds must lie in [-2^30, 2^30] (normalised by jax_fa3/_masks.py)");
  o->softmax_scale = softmax_scale;
  o->softcap = softcap;
  o->window_left = window_left;
  o->window_right = window_right;
  return ffi::Error::Success();
}

// One array of the packed documents' bands (fa3/params.h DocBands): (batch, len, width) int32,
// or (batch, 0, width) for none. *data is nullptr for none.
ffi::Error doc_band(const char* name, ffi::Buffer<ffi::S32> x, int batch, int64_t len, int width,
                    const int32_t** data) {
  auto d = x.dimensions();
  if (d.size() != 3 || d[0] != batch || d[2] != width || (d[1] != 0 && d[1] != len))
    return invalid(std::string(name) + " must be int32 (" + std::to_string(batch) + ", " + std::to_string(len) +
                   ", " + std::to_string(width) + ") or (" + std::to_string(batch) + ", 0, " +
                   std::to_string(width) + ") for none, got " + dims_str(d));
  *data = d[1] == 0 ? nullptr : x.typed_data();
  return ffi::Error::Success();
}

int64_t band_groups(int64_t len) { return (len + kBandGroupRows - 1) / kBandGroupRows; }

// One side of the bands, `side` "q" (len seqlen_q) or "k" (len seqlen_k): its rows and groups,
// both present or both none.
ffi::Error side_bands(const char* side, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> groups, int batch,
                      int64_t len, const int32_t** rows_data, const int32_t** groups_data) {
  const std::string r = std::string(side) + "_rows", g = std::string(side) + "_groups";
  if (auto e = doc_band(r.c_str(), rows, batch, len, 2, rows_data); e.failure()) return e;
  if (auto e = doc_band(g.c_str(), groups, batch, band_groups(len), 4, groups_data); e.failure()) return e;
  if ((*rows_data == nullptr) != (*groups_data == nullptr)) return invalid(r + " and " + g + " come together");
  return ffi::Error::Success();
}

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_fa3: ") + what + ": " + cudaGetErrorString(err));
}

ffi::Error device_sms(int* num_sms) {
  int device = 0;
  if (auto err = cudaGetDevice(&device); err != cudaSuccess) return cuda_error("cudaGetDevice", err);
  if (auto err = cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device); err != cudaSuccess)
    return cuda_error("cudaDeviceGetAttribute", err);
  return ffi::Error::Success();
}

// What every forward checks and fills, whatever its element type: shapes, options, out, lse, a
// compiled kernel, the device.
ffi::Error fwd_common(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
                      ffi::Buffer<ffi::F32> lse, float softmax_scale, float softcap, int32_t window_left,
                      int32_t window_right, FwdParams* p) {
  if (auto e = attention_shape(q, k, v, &p->dtype, &p->shape); e.failure()) return e;
  if (auto e = attention_options(softmax_scale, softcap, window_left, window_right, &p->opts); e.failure())
    return e;
  if (auto e = check_out_shape("out", out, q, p->shape); e.failure()) return e;
  auto ld = lse.dimensions();
  if (ld.size() != 3 || ld[0] != p->shape.batch || ld[1] != p->shape.heads_q || ld[2] != p->shape.seqlen_q)
    return invalid("lse must be float32 (batch, heads, seqlen_q), got " + dims_str(ld));
  if (fwd_kernel_head_dim(p->dtype, p->shape.head_dim, p->shape.head_dim_v) == 0)
    return invalid("no forward kernel compiled for " + head_dims_str(p->shape) +
                   " and this dtype (see jax_fa3.build_info())");
  if (auto e = device_sms(&p->num_sms); e.failure()) return e;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->out = out.untyped_data();
  p->lse = lse.typed_data();
  return ffi::Error::Success();
}

// The workspace result (the dynamic schedule's tile counter), then the launch.
ffi::Error fwd_launch(FwdParams& p, ffi::Buffer<ffi::S32> workspace, cudaStream_t stream) {
  if (size_t bytes = fwd_workspace_bytes(p); bytes > 0) {
    if (workspace.size_bytes() < bytes)
      return invalid("workspace must hold " + std::to_string(bytes) + " bytes, got " +
                     std::to_string(workspace.size_bytes()));
    p.workspace = workspace.untyped_data();
  }
  if (auto err = run_fwd(p, stream); err != cudaSuccess) return cuda_error("forward launch", err);
  return ffi::Error::Success();
}

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> q_rows, ffi::Buffer<ffi::S32> q_groups,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   ffi::Result<ffi::Buffer<ffi::S32>> workspace, float softmax_scale, float softcap,
                   int32_t window_left, int32_t window_right) {
  FwdParams p;
  if (q.element_type() == ffi::DataType::F8E4M3FN)
    return invalid("float8_e4m3fn q goes to the FP8 forward target (jax_fa3_fwd_fp8), with its descales");
  if (auto e = fwd_common(q, k, v, *out, *lse, softmax_scale, softcap, window_left, window_right, &p); e.failure())
    return e;
  auto sd = sinks.dimensions();
  if (sd.size() != 1 || (sd[0] != 0 && sd[0] != p.shape.heads_q))
    return invalid("sinks must be float32 (heads_q,) = (" + std::to_string(p.shape.heads_q) + ",) or empty, got " +
                   dims_str(sd));
  p.sinks = sd[0] == 0 ? nullptr : sinks.typed_data();
  if (auto e = side_bands("q", q_rows, q_groups, p.shape.batch, p.shape.seqlen_q, &p.docs.q_rows, &p.docs.q_groups);
      e.failure())
    return e;
  return fwd_launch(p, *workspace, stream);
}

// One FP8 descale operand: float32 (batch, heads).
ffi::Error descale(const char* name, ffi::Buffer<ffi::F32> x, int batch, int heads, const float** data) {
  auto d = x.dimensions();
  if (d.size() != 2 || d[0] != batch || d[1] != heads)
    return invalid(std::string(name) + " must be float32 (batch, heads) = (" + std::to_string(batch) + ", " +
                   std::to_string(heads) + "), got " + dims_str(d));
  *data = x.typed_data();
  return ffi::Error::Success();
}

// The FP8 (e4m3) forward: q, k, v float8_e4m3fn, out bfloat16, no sinks or documents.
ffi::Error FwdFp8Impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::F32> q_descale, ffi::Buffer<ffi::F32> k_descale,
                      ffi::Buffer<ffi::F32> v_descale, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse, ffi::Result<ffi::Buffer<ffi::S32>> workspace,
                      float softmax_scale, float softcap, int32_t window_left, int32_t window_right) {
  FwdParams p;
  if (q.element_type() != ffi::DataType::F8E4M3FN) return invalid("q must be float8_e4m3fn for the FP8 forward");
  if (auto e = fwd_common(q, k, v, *out, *lse, softmax_scale, softcap, window_left, window_right, &p); e.failure())
    return e;
  const AttentionShape& s = p.shape;
  if (s.head_dim % 16 != 0 || s.head_dim_v % 16 != 0)  // TMA: 16-byte rows of one-byte elements
    return invalid("FP8 head dims must be multiples of 16, got " + head_dims_str(s));
  if (auto e = descale("q_descale", q_descale, s.batch, s.heads_q, &p.q_descale); e.failure()) return e;
  if (auto e = descale("k_descale", k_descale, s.batch, s.heads_kv, &p.k_descale); e.failure()) return e;
  if (auto e = descale("v_descale", v_descale, s.batch, s.heads_kv, &p.v_descale); e.failure()) return e;
  return fwd_launch(p, *workspace, stream);
}

ffi::Error BwdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer q,
                   ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out, ffi::AnyBuffer dout,
                   ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::S32> q_rows, ffi::Buffer<ffi::S32> q_groups,
                   ffi::Buffer<ffi::S32> k_rows, ffi::Buffer<ffi::S32> k_groups, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Result<ffi::Buffer<ffi::F32>> dpsum, float softmax_scale,
                   float softcap, int32_t window_left, int32_t window_right, bool deterministic) {
  BwdParams p;
  if (auto e = attention_shape(q, k, v, &p.dtype, &p.shape); e.failure()) return e;
  if (auto e = attention_options(softmax_scale, softcap, window_left, window_right, &p.opts); e.failure())
    return e;
  if (auto e = check_out_shape("out", out, q, p.shape); e.failure()) return e;
  if (auto e = check_out_shape("dout", dout, q, p.shape); e.failure()) return e;
  if (auto e = check_same("dq", *dq, q, "q"); e.failure()) return e;
  if (auto e = check_same("dk", *dk, k, "k"); e.failure()) return e;
  if (auto e = check_same("dv", *dv, v, "v"); e.failure()) return e;
  auto ld = lse.dimensions();
  if (ld.size() != 3 || ld[0] != p.shape.batch || ld[1] != p.shape.heads_q || ld[2] != p.shape.seqlen_q)
    return invalid("lse must be float32 (batch, heads, seqlen_q), got " + dims_str(ld));
  auto pd = dpsum->dimensions();
  const bool want_dpsum = pd.size() == 3;
  if (!(want_dpsum && pd[0] == p.shape.batch && pd[1] == p.shape.heads_q && pd[2] == p.shape.seqlen_q) &&
      !(pd.size() == 2 && pd[1] == 0))
    return invalid("dpsum must be float32 (batch, heads, seqlen_q) or (batch, 0) for none, got " + dims_str(pd));
  if (bwd_kernel_head_dim(p.dtype, p.shape.head_dim, p.shape.head_dim_v) == 0)
    return invalid("no backward kernel compiled for " + head_dims_str(p.shape) +
                   " and this dtype (see jax_fa3.build_info())");
  if (auto e = device_sms(&p.num_sms); e.failure()) return e;
  p.deterministic = deterministic;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.out = out.untyped_data();
  p.dout = dout.untyped_data();
  p.lse = lse.typed_data();
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dpsum = want_dpsum ? dpsum->typed_data() : nullptr;
  if (auto e = side_bands("q", q_rows, q_groups, p.shape.batch, p.shape.seqlen_q, &p.docs.q_rows, &p.docs.q_groups);
      e.failure())
    return e;
  if (auto e = side_bands("k", k_rows, k_groups, p.shape.batch, p.shape.seqlen_k, &p.docs.k_rows, &p.docs.k_groups);
      e.failure())
    return e;
  if ((p.docs.q_rows == nullptr) != (p.docs.k_rows == nullptr))
    return invalid("the backward takes all four document bands or none");
  if (p.docs.present() && deterministic)
    return invalid("the deterministic backward does not take document bands (jax_fa3 runs it on the portable path)");
  if (size_t bytes = bwd_workspace_bytes(p); bytes > 0) {
    // XLA's FFI allocator accepts alignments up to 16 (its allocations are 256-aligned anyway);
    // the backward needs 16 (TMA bulk copies, float4 atomics).
    auto ws = scratch.Allocate(bytes, 16);
    if (!ws.has_value())
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        "jax_fa3: could not allocate " + std::to_string(bytes) + " bytes of backward scratch");
    p.workspace = *ws;
  }
  if (auto err = run_bwd(p, stream); err != cudaSuccess) return cuda_error("backward launch", err);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    fa3_fwd, fa3::FwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this op
        .Arg<ffi::AnyBuffer>()                     // q    (b, sq, hq, d)
        .Arg<ffi::AnyBuffer>()                     // k    (b, sk, hkv, d)
        .Arg<ffi::AnyBuffer>()                     // v    (b, sk, hkv, dv)
        .Arg<ffi::Buffer<ffi::F32>>()              // sinks (hq) or (0): none
        .Arg<ffi::Buffer<ffi::S32>>()              // q_rows (b, sq, 2) or (b, 0, 2): documents
        .Arg<ffi::Buffer<ffi::S32>>()              // q_groups (b, ceil(sq / 64), 4) or (b, 0, 4)
        .Ret<ffi::AnyBuffer>()                     // out  (b, sq, hq, dv)
        .Ret<ffi::Buffer<ffi::F32>>()              // lse  (b, hq, sq)
        .Ret<ffi::Buffer<ffi::S32>>()              // workspace (kFwdWorkspaceBytes): tile counter
        .Attr<float>("softmax_scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    fa3_fwd_fp8, fa3::FwdFp8Impl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this op
        .Arg<ffi::AnyBuffer>()                     // q    (b, sq, hq, d) float8_e4m3fn
        .Arg<ffi::AnyBuffer>()                     // k    (b, sk, hkv, d) float8_e4m3fn
        .Arg<ffi::AnyBuffer>()                     // v    (b, sk, hkv, dv) float8_e4m3fn
        .Arg<ffi::Buffer<ffi::F32>>()              // q_descale (b, hq)
        .Arg<ffi::Buffer<ffi::F32>>()              // k_descale (b, hkv)
        .Arg<ffi::Buffer<ffi::F32>>()              // v_descale (b, hkv)
        .Ret<ffi::AnyBuffer>()                     // out  (b, sq, hq, dv) bfloat16
        .Ret<ffi::Buffer<ffi::F32>>()              // lse  (b, hq, sq)
        .Ret<ffi::Buffer<ffi::S32>>()              // workspace (kFwdWorkspaceBytes)
        .Attr<float>("softmax_scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    fa3_bwd, fa3::BwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this op
        .Ctx<ffi::ScratchAllocator>()              // dQ accumulator and row sums
        .Arg<ffi::AnyBuffer>()                     // q    (b, sq, hq, d)
        .Arg<ffi::AnyBuffer>()                     // k    (b, sk, hkv, d)
        .Arg<ffi::AnyBuffer>()                     // v    (b, sk, hkv, dv)
        .Arg<ffi::AnyBuffer>()                     // out  (b, sq, hq, dv)
        .Arg<ffi::AnyBuffer>()                     // dout (b, sq, hq, dv)
        .Arg<ffi::Buffer<ffi::F32>>()              // lse  (b, hq, sq)
        .Arg<ffi::Buffer<ffi::S32>>()              // q_rows (b, sq, 2) or (b, 0, 2): documents
        .Arg<ffi::Buffer<ffi::S32>>()              // q_groups (b, ceil(sq / 64), 4) or (b, 0, 4)
        .Arg<ffi::Buffer<ffi::S32>>()              // k_rows (b, sk, 2) or (b, 0, 2)
        .Arg<ffi::Buffer<ffi::S32>>()              // k_groups (b, ceil(sk / 64), 4) or (b, 0, 4)
        .Ret<ffi::AnyBuffer>()                     // dq   (b, sq, hq, d)
        .Ret<ffi::AnyBuffer>()                     // dk   (b, sk, hkv, d)
        .Ret<ffi::AnyBuffer>()                     // dv   (b, sk, hkv, dv)
        .Ret<ffi::Buffer<ffi::F32>>()              // dpsum (b, hq, sq): rowsum(dout o out); (b, 0): none
        .Attr<float>("softmax_scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<bool>("deterministic"));
