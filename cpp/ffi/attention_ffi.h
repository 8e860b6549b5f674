// The FFI handler symbols the nanobind module hands to jax.ffi.register_ffi_target.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(fa3_fwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(fa3_fwd_fp8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(fa3_bwd);
