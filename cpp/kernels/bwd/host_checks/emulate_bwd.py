"""Numpy emulation of the backward kernel's algorithm (no GPU), block by block as the kernel
runs it, against the float64 oracle of tests/helpers.py.

Mirrors: the preprocess (D, LSE -> log2 with +inf for fully masked and padding rows), the
main kernel's iteration (one CTA per 128-key block and kv head, loop over the group's query
heads and the query blocks of query_block_range, zero-filled Q/dO/K/V past the sequence ends as
TMA gives them), P^T = exp2(S^T * scale_log2 - lse_log2) with the element mask only on
non-interior blocks, dS^T = P^T o (dP^T - D) o tanh', dV/dK accumulated per CTA, dQ
accumulated over CTAs, dK scaled at the end, dQ scaled in the postprocess. Arithmetic is float64
(this checks the algorithm and the index logic, not the rounding).

    python cpp/kernels/bwd/host_checks/emulate_bwd.py
"""

from __future__ import annotations

import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests"))
import helpers  # noqa: E402

UNB = 1 << 30
# Query rows per step: 64 (default tiles) or 128 (FA3_BWD_HD64_BLOCK_M=128): BWD_BLOCK_M=128.
# Keys per CTA: 128 (default tiles) or 64 (the split-D hd256 variant, FA3_BWD_HD256_SPLIT_D=1):
# BWD_BLOCK_N=64.
BM, BN = int(os.environ.get("BWD_BLOCK_M", "64")), int(os.environ.get("BWD_BLOCK_N", "128"))
# Query columns per S^T/dP^T sub-step (kBlockMSdP): 64 for every tile (hd64 at 128 rows runs two
# sub-steps per step, each with its own mask decision; dS of both meets in one dQ GEMM).
SM = int(os.environ.get("BWD_SDP_M", "64"))
assert BM % SM == 0
# FA3_BWD_HD128_BLOCK_M_FULL=80: problems without a band and without softcap run 80-row steps
# (one 80-column S^T/dP^T pass, dQ^T = K^T dS^T), the others BM/SM: BWD_BLOCK_M_FULL=80.
FULL = int(os.environ.get("BWD_BLOCK_M_FULL", "0"))
BM_DEFAULT, SM_DEFAULT = BM, SM


def uses_full_tile(sq, sk, wl, wr, softcap):
    """bwd_launch.cuh's with_bwd_traits (the 80-row choice): no band (band_limits_work false), no softcap."""
    reach = sq + sk
    return FULL != 0 and not softcap and wl >= reach and wr >= reach
LOG2E = 1.4426950408889634


def query_block_range(sq, sk, wl, wr, n):
    if wl + wr < 0:
        return 0, 0
    n0, n_last = n * BN, min(n * BN + BN, sk) - 1
    lo = max(n0 - (sk - sq) - wr, 0)
    hi = min(n_last - (sk - sq) + wl, sq - 1)
    return (0, 0) if hi < lo else (lo // BM, hi // BM + 1)


def block_is_interior(sq, sk, wl, wr, row_lo, row_hi, n0):
    off = sk - sq
    return n0 >= row_hi + off - wl and n0 + BN - 1 <= row_lo + off + wr and n0 + BN <= sk


def emulate(q, k, v, out, lse, dout, wl, wr, softcap, scale):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    mb = -(-sq // BM)
    sq_pad = mb * BM
    nb = -(-sk // BN)
    pad = lambda x, n: np.concatenate([x, np.zeros((x.shape[0], n - x.shape[1]) + x.shape[2:])], 1)  # noqa: E731
    qp, dop = pad(q, sq_pad), pad(dout, sq_pad)
    kp, vp = pad(k, nb * BN), pad(v, nb * BN)
    # preprocess
    dpsum = np.zeros((b, hq, sq_pad))
    dpsum[:, :, :sq] = np.einsum("bqhd,bqhd->bhq", dout, out)
    lse2 = np.full((b, hq, sq_pad), np.inf)
    lse2[:, :, :sq] = np.where(np.isneginf(lse), np.inf, lse * LOG2E)
    if softcap:
        scale_log2, pre_tanh = softcap * LOG2E, scale / softcap
    else:
        scale_log2, pre_tanh = scale * LOG2E, 1.0
    dq_acc = np.zeros((b, hq, sq_pad, d))
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    sub_step = sub_step_fn(sq, sk, wl, wr, softcap, scale_log2, pre_tanh)
    for bi, hk, n in itertools.product(range(b), range(hkv), range(nb)):
        m_begin, m_end = query_block_range(sq, sk, wl, wr, n)
        n0 = n * BN
        K, V = kp[bi, n0:n0 + BN, hk], vp[bi, n0:n0 + BN, hk]
        dK, dV = np.zeros((BN, d)), np.zeros((BN, d))
        for h in range(hk * g, hk * g + g):
            for m in range(m_begin, m_end):
                m0 = m * BM
                dSt_step = np.zeros((BN, BM))  # the step's dS^T tile (shared memory in the kernel)
                for q0 in range(m0, m0 + BM, SM):  # sub-steps
                    dSt_step[:, q0 - m0:q0 - m0 + SM] = sub_step(
                        qp[bi, q0:q0 + SM, h], dop[bi, q0:q0 + SM, h], lse2[bi, h, q0:q0 + SM],
                        dpsum[bi, h, q0:q0 + SM], K, V, q0, n0, dK, dV)
                if BM % 64:  # swapped dQ GEMM: dQ^T = K^T dS^T (head dim on the M side)
                    dq_acc[bi, h, m0:m0 + BM] += (K.T @ dSt_step).T
                else:
                    dq_acc[bi, h, m0:m0 + BM] += dSt_step.T @ K
        keys = slice(n0, min(n0 + BN, sk))
        dk[bi, keys, hk] = (dK * scale)[: keys.stop - n0]
        dv[bi, keys, hk] = dV[: keys.stop - n0]
    dq = (dq_acc[:, :, :sq] * scale).transpose(0, 2, 1, 3)
    return dq, dk, dv


def sub_step_fn(sq, sk, wl, wr, softcap, scale_log2, pre_tanh):
    """The kernel's S^T/dP^T sub-step for one problem: SM query columns from row q0 against the
    CTA's keys; accumulates dK, dV and returns dS^T (keys, SM) for the step's dQ."""

    def sub_step(Q, dO, L, D, K, V, q0, n0, dK, dV):
        St, dPt = K @ Q.T, V @ dO.T  # (keys, queries)
        if softcap:
            t = np.tanh(St * pre_tanh)
            dtanh = 1 - t * t
            with np.errstate(invalid="ignore"):
                Pt = np.exp2(t * scale_log2 - L[None, :])
        else:
            dtanh = 1.0
            with np.errstate(invalid="ignore"):
                Pt = np.exp2(St * scale_log2 - L[None, :])
        interior = block_is_interior(sq, sk, wl, wr, q0, min(q0 + SM, sq) - 1, n0)
        if not interior:
            j = n0 + np.arange(BN)[:, None]
            i = q0 + np.arange(SM)[None, :]
            rel = (j - sk) - (i - sq)
            Pt = np.where((j >= sk) | (rel < -wl) | (rel > wr), 0.0, Pt)
        assert np.isfinite(Pt).all(), "P must be finite"
        dSt = Pt * dtanh * (dPt - D[None, :])
        dV += Pt @ dO
        dK += dSt @ Q
        return dSt

    return sub_step


def check_turn_order(rng, trials=3000):
    """Deterministic mode: the dQ writer of key block n waits until the query block's counter
    equals n - nb, nb = max(m * BM + (sk - sq) - left, 0) // BN (bwd_main.cuh). That can finish
    (and in key-block order) only if the key blocks that visit query block m are exactly
    nb, nb + 1, ..., each visiting it once: checked against query_block_range on random bands."""
    for _ in range(trials):
        sq, sk = int(rng.integers(1, 1200)), int(rng.integers(1, 1200))
        wl = int(rng.choice([UNB, rng.integers(-300, 600)]))
        wr = int(rng.choice([UNB, 0, rng.integers(-300, 600)]))
        visitors = {}
        for n in range((sk + BN - 1) // BN):
            mb, me = query_block_range(sq, sk, wl, wr, n)
            for m in range(mb, me):
                visitors.setdefault(m, []).append(n)
        for m, ns in visitors.items():
            nb = max(m * BM + (sk - sq) - wl, 0) // BN
            assert ns == list(range(nb, nb + len(ns))), (sq, sk, wl, wr, m, nb, ns)
    print(f"turn order: {trials} random bands, every visited query block's key blocks are "
          f"nb, nb + 1, ... (no deadlock, fixed order)")


def set_tile(bm, sm):
    global BM, SM
    BM, SM = bm, sm


def main():
    rng = np.random.default_rng(0)
    check_turn_order(rng)
    if FULL:
        set_tile(FULL, FULL)
        check_turn_order(rng)
        set_tile(BM_DEFAULT, SM_DEFAULT)
    cases = [
        (2, 129, 129, 2, 2, 64, UNB, UNB, 0.0), (1, 129, 129, 2, 1, 32, UNB, 0, 0.0),
        (1, 1, 1, 2, 2, 16, UNB, UNB, 0.0), (1, 17, 300, 4, 2, 16, UNB, 0, 0.0),
        (1, 300, 100, 2, 2, 16, UNB, 0, 0.0), (1, 300, 290, 2, 1, 16, 32, 16, 0.0),
        (1, 260, 300, 8, 1, 16, 200, -50, 0.0), (1, 260, 300, 2, 2, 16, -40, 100, 0.0),
        (1, 200, 200, 2, 2, 16, 3, -5, 0.0), (2, 150, 170, 4, 2, 32, UNB, UNB, 20.0),
        (1, 257, 200, 2, 2, 32, UNB, 0, 5.0), (1, 130, 257, 2, 2, 16, 64, 0, 0.0),
        # unbanded, seqlen_q not a multiple of 80 / exactly 80 k, keys ragged: the 80-row tile
        (1, 81, 300, 2, 2, 16, UNB, UNB, 0.0), (1, 240, 129, 4, 2, 16, UNB, UNB, 0.0),
        (2, 161, 257, 2, 1, 16, UNB, UNB, 0.0), (1, 79, 80, 2, 2, 16, UNB, UNB, 0.0),
    ]
    full_cases = 0
    worst = 0.0
    for b, sq, sk, hq, hkv, d, wl, wr, cap in cases:
        q = rng.standard_normal((b, sq, hq, d)) * 2
        k = rng.standard_normal((b, sk, hkv, d))
        v = rng.standard_normal((b, sk, hkv, d))
        dout = rng.standard_normal((b, sq, hq, d))
        scale = 1 / np.sqrt(d)
        opts = dict(left=wl, right=wr, softcap=cap, softmax_scale=scale)
        out, lse = helpers.reference_f64(q, k, v, **opts)
        ref = helpers.reference_grads_f64(q, k, v, dout, **opts)
        full = uses_full_tile(sq, sk, wl, wr, cap)
        full_cases += full
        set_tile(FULL, FULL) if full else set_tile(BM_DEFAULT, SM_DEFAULT)
        got = emulate(q, k, v, out, lse, dout, wl, wr, cap, scale)
        set_tile(BM_DEFAULT, SM_DEFAULT)
        for name, a, r in zip(("dq", "dk", "dv"), got, ref):
            err = float(np.abs(a - r).max()) / max(float(np.abs(r).max()), 1.0)
            worst = max(worst, err)
            assert np.isfinite(a).all() and err < 1e-9, (name, b, sq, sk, hq, hkv, d, wl, wr, cap, err)
    if FULL:
        print(f"{full_cases} of {len(cases)} cases ran the {FULL}-row tile (no band, no softcap)")
    print(f"BM={BM}, SM={SM}: {len(cases)} cases: emulated kernel algorithm matches the float64 gradients "
          f"(max err relative to max(|ref|, 1): {worst:.1e})")


if __name__ == "__main__":
    main()
