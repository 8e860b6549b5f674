"""Host check (numpy, float32 arithmetic) of exp2_fma in common/softmax.cuh: relative error
against 2^x for x >= -125, never negative or NaN, exactly 0 for -inf and 1 for 0.
Usage: python3 exp2_fma_check.py   (exit status 1 on failure)"""
import sys

import numpy as np

f32 = np.float32


def exp2_fma(x):
    x = np.maximum(x.astype(f32), f32(-127))
    c = f32(12582912.0)
    t = (x + c).astype(f32)
    r = (x - (t - c).astype(f32)).astype(f32)
    p = (f32(0.05459282547) * r + f32(0.24221783876)).astype(f32)
    p = (p * r + f32(0.69336861372)).astype(f32)
    p = (p * r + f32(1.0)).astype(f32)
    bits = (p.view(np.uint32).astype(np.uint64) + (t.view(np.uint32).astype(np.uint64) << 23)) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(f32)


def main():
    x = np.concatenate([np.linspace(-130, 0.3, 2_000_001).astype(f32),
                        np.array([-np.inf, 0, -0.0, -127, -126.5, -126, -125.99, 1e-7], f32)])
    y = exp2_fma(x)
    ok = x >= -125
    err = float(np.max(np.abs(y[ok] / np.exp2(x[ok].astype(np.float64)) - 1)))
    special = exp2_fma(np.array([-np.inf, 0.0], f32))
    good = err < 1.2e-4 and bool(np.all(y >= 0)) and special[0] == 0 and special[1] == 1
    print(f"max rel err {err:.3g}; -inf -> {special[0]}, 0 -> {special[1]}: {'ok' if good else 'FAIL'}")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
