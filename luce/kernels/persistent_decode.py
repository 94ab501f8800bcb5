"""A small model's whole one-token decode step in one persistent kernel (a "megakernel").

Why: a draft model's step is a chain of ~170 launches whose every op reads 0.5-3.5 MB and
is bound by latency (synthetic Qwen3-0.6B on an H100: graph 1,087 us a step against 906
us of ops, each 3-9 us; docs/benchmarks.md, thirty-fifth session), and speculative
decoding runs ~8 of those steps for every target forward. Here one launch of one block an
SM runs every layer, the phases separated by a grid barrier instead of a kernel boundary:

  (A) each block norms the residual stream itself (1-4 KB), warps take q/k/v rows; v goes
      straight into the paged pool;
  (B) attention items (kv head x group of 64-key pages): q's and the new k's head norm and
      rotation in the item, the new k stored by the item holding its row, online softmax
      over the item's keys, each head's partials merged by its last block (split_merge);
  (C) o rows, added into the residual stream;
  (D) the norm again in each block, gate and up rows with SwiGLU;
  (E) down rows, added into the residual stream;
and after the last layer the output norm and the head's rows into logits (the backend's
argmax / top-k launches take them from there).

Status (H100, e08e888): correct on the GPU against the CPU backend, and 2.9x slower than
the backend's graph-replayed step at the Qwen3-0.6B shape (3,435 against 1,172 us): the
row products here load bytes, one warp a row; the launch chain's kernels load 16 bytes at
a time with rows in flight together. Not used by the backend until it is faster.

Every block must be resident at once (the barrier waits for all of them): the grid is one
block an SM. The simulator runs blocks one after another, so there the grid is one block,
and every phase is a loop over its items strided by the grid that one block covers whole.

Scope: Llama/Qwen-style dense layers (RMSNorm, optional per-head q/k norm, RoPE of either
style, GQA, SwiGLU), Q4_K, Q6_K and Q8_0 weights, an f16 paged pool, no sliding window,
no biases. `applies(cfg, weights, kv)` says why a model is out of scope.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ._reduce import WARP_RED_SLOTS, block_sum, warp_sum
from .device import SIM, device
from .split_merge import arrive
from .vector_load import f16_bits_to_f32

__all__ = ["PersistentDecode", "applies", "QTYPE_CODES"]

PAGE = 64  # the pool's rows a block (luce.kv.paged.BLOCK)
KINDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
NORMS = ("attn_norm", "ffn_norm", "q_norm", "k_norm")
THREADS = 256  # a block (one an SM): 8 warps
_Q4K, _Q6K, _Q8_0 = 0, 1, 2


def _qtype_codes():
    import gguf
    Q = gguf.GGMLQuantizationType
    return {Q.Q4_K: _Q4K, Q.Q6_K: _Q6K, Q.Q8_0: _Q8_0}


QTYPE_CODES = _qtype_codes()
_BLOCK = {_Q4K: (256, 144), _Q6K: (256, 210), _Q8_0: (32, 34)}  # (weights, bytes) a block


# ----------------------------------------------------------------------------- device side
if SIM:
    def _ld_acquire(a, i):
        return a[i]

    def _ldcg(a, i):
        return a[i]
else:
    from llvmlite import ir
    from numba.cuda import types as _types
    from numba.cuda.extending import intrinsic

    from .mma import _asm, _generic_addr

    @intrinsic
    def _ld_acquire(typingctx, a, i):
        """a[i] (int32) loaded with acquire semantics at GPU scope: the barrier's spin."""
        sig = _types.int32(a, i)

        def codegen(context, builder, sig, args):
            addr = _generic_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return _asm(builder, "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", ir.IntType(32), [ir.IntType(64)],
                        [addr], side_effect=True)
        return sig, codegen

    @intrinsic
    def _ldcg(typingctx, a, i):
        """a[i] (float32) from L2, past this SM's L1: the scratch that other blocks wrote
        since this one last read it (the stream, q/k/v, partials) is reused every layer."""
        sig = _types.float32(a, i)

        def codegen(context, builder, sig, args):
            addr = _generic_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return _asm(builder, "ld.global.cg.f32 $0, [$1];", "=f,l", ir.FloatType(), [ir.IntType(64)], [addr],
                        side_effect=True)
        return sig, codegen


@device
def _grid_sync(cnt, target, tid):
    """Every block of the grid has reached its target-th barrier; their writes before it are
    visible after it (each thread's release fence, one acquire spin a block, then every
    thread's fence: cooperative groups' grid sync)."""
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        cuda.atomic.add(cnt, 0, 1)
        while _ld_acquire(cnt, 0) < target:
            pass
    cuda.syncthreads()
    cuda.threadfence()


@device
def _f16(w, o):
    return f16_bits_to_f32(np.uint32(w[o]) | (np.uint32(w[o + 1]) << 8))


@device
def _i8(b):
    v = np.int32(b)
    return v - 256 if v >= 128 else v


@device
def _k4_scale_min(w, b, sub):
    """Q4_K's 6-bit scale and min of sub-block sub (get_scale_min_k4 over the block's
    scales at byte b + 4)."""
    if sub < 4:
        return np.int32(w[b + 4 + sub]) & 63, np.int32(w[b + 8 + sub]) & 63
    hi = np.int32(w[b + 8 + sub])
    return (hi & 15) | ((np.int32(w[b + sub]) >> 6) << 4), (hi >> 4) | ((np.int32(w[b + 4 + sub]) >> 6) << 4)


@device
def _chunk(w, base, qt, c, xs, xo):
    """Columns 8c..8c+7 of the row at byte base (a lane's share of a block), dotted with
    xs[xo + 8c:]."""
    x0 = xo + 8 * c
    if qt == _Q4K:
        b = base + 144 * (c >> 5)
        cc = c & 31
        sub = cc >> 2
        sc, mn = _k4_scale_min(w, b, sub)
        qo = b + 16 + 32 * (sub >> 1) + 8 * (cc & 3)
        sh = 4 * (sub & 1)
        sq = np.float32(0.0)
        sx = np.float32(0.0)
        for i in range(8):
            xv = xs[x0 + i]
            sq += np.float32((np.int32(w[qo + i]) >> sh) & 15) * xv
            sx += xv
        return _f16(w, b) * np.float32(sc) * sq - _f16(w, b + 2) * np.float32(mn) * sx
    if qt == _Q6K:
        b = base + 210 * (c >> 5)
        cc = c & 31
        n = cc >> 4
        q = (cc & 15) >> 2
        l0 = 8 * (cc & 3)
        lo = b + 64 * n + l0 + 32 * (q & 1)
        ho = b + 128 + 32 * n + l0
        sh = 4 * (q >> 1)
        s = np.float32(0.0)
        for i in range(8):
            v = ((np.int32(w[lo + i]) >> sh) & 15) | (((np.int32(w[ho + i]) >> (2 * q)) & 3) << 4)
            s += np.float32(v - 32) * xs[x0 + i]
        return _f16(w, b + 208) * np.float32(_i8(w[b + 192 + 8 * n + (l0 >> 4) + 2 * q])) * s
    b = base + 34 * (c >> 2)
    qo = b + 2 + 8 * (c & 3)
    s = np.float32(0.0)
    for i in range(8):
        s += np.float32(_i8(w[qo + i])) * xs[x0 + i]
    return _f16(w, b) * s


@device
def _value(w, base, qt, j):
    """Weight j of the row at byte base (the embedding's row)."""
    if qt == _Q4K:
        b = base + 144 * (j >> 8)
        jj = j & 255
        sub = jj >> 5
        sc, mn = _k4_scale_min(w, b, sub)
        q = (np.int32(w[b + 16 + 32 * (sub >> 1) + (jj & 31)]) >> (4 * (sub & 1))) & 15
        return _f16(w, b) * np.float32(sc) * np.float32(q) - _f16(w, b + 2) * np.float32(mn)
    if qt == _Q6K:
        b = base + 210 * (j >> 8)
        jj = j & 255
        n = jj >> 7
        q = (jj & 127) >> 5
        l = jj & 31
        v = ((np.int32(w[b + 64 * n + l + 32 * (q & 1)]) >> (4 * (q >> 1))) & 15) | \
            (((np.int32(w[b + 128 + 32 * n + l]) >> (2 * q)) & 3) << 4)
        return _f16(w, b + 208) * np.float32(_i8(w[b + 192 + 8 * n + (l >> 4) + 2 * q])) * np.float32(v - 32)
    b = base + 34 * (j >> 5)
    return _f16(w, b) * np.float32(_i8(w[b + 2 + (j & 31)]))


@device
def _row_dot(w, base, qt, n_chunks, xs, xo, red, wid, lane):
    """The row's dot with xs[xo:], in lane 0 (every lane of the warp takes part)."""
    s = np.float32(0.0)
    for c in range(lane, n_chunks, 32):
        s += _chunk(w, base, qt, c, xs, xo)
    return warp_sum(s, red, wid, lane)


@device
def _silu(y):
    return y / (np.float32(1.0) + np.float32(math.exp(-y)))


@functools.lru_cache(maxsize=None)
def _kernel(D, HQ, HKV, DH, F, L, ROPE, HALVES, QKN, EPS, NT, MAXP):
    G = HQ // HKV
    W = NT // 32
    QR = HQ * DH
    KR = HKV * DH
    XS = max(D, F, QR)
    RED = max(1, W * WARP_RED_SLOTS)
    HALF = ROPE // 2
    # shared arrays' sizes: compile-time constants only as plain closure values
    QSH, SSN, ACC, MLN, TMPN = G * DH + DH, G * PAGE, G * DH, 3 * G, G + 1
    SCALE = np.float32(1.0 / math.sqrt(DH))
    eps = np.float32(EPS)
    f32 = np.float32

    @device
    def norm_into(xs, src, nw, off, bred, tid):
        """xs = rms_norm(src[:D]) * nw[off:] in this block (every thread calls it)."""
        ss = f32(0.0)
        for i in range(tid, D, NT):
            v = _ldcg(src, i)
            xs[i] = v
            ss += v * v
        tot = block_sum(ss, bred)
        inv = f32(1.0) / math.sqrt(tot / f32(D) + eps)
        for i in range(tid, D, NT):
            xs[i] = xs[i] * inv * nw[off + i]
        cuda.syncthreads()

    @device
    def head_norm_rope(v, base, nw, off, ntot, inv_freq, p, tmp, tid):
        """ntot heads of DH floats at v[base:] in shared memory: each head's RMSNorm times
        nw[off:] (off < 0: none), then RoPE at position p."""
        if off >= 0:
            if tid < ntot:
                ss = f32(0.0)
                for d in range(DH):
                    x = v[base + tid * DH + d]
                    ss += x * x
                tmp[tid] = f32(1.0) / math.sqrt(ss / f32(DH) + eps)
            cuda.syncthreads()
            for i in range(tid, ntot * DH, NT):
                v[base + i] = v[base + i] * tmp[i // DH] * nw[off + i % DH]
            cuda.syncthreads()
        for i in range(tid, ntot * HALF, NT):
            hd = i // HALF
            k = i % HALF
            ang = np.float64(p) * inv_freq[k]
            c = f32(math.cos(ang))
            s = f32(math.sin(ang))
            if HALVES:
                ia = base + hd * DH + k
                ib = ia + HALF
            else:
                ia = base + hd * DH + 2 * k
                ib = ia + 1
            a = v[ia]
            b = v[ib]
            v[ia] = a * c - b * s
            v[ib] = a * s + b * c
        cuda.syncthreads()

    @device
    def into_stream(xs, src, n, w, off, qt, xg, red, tid, wid, lane, gw, nw_all):
        """xg += W src for the D rows of an n-column weight at byte off (o, down): src (other
        blocks' writes) staged in shared memory first."""
        for i in range(tid, n, NT):
            xs[i] = _ldcg(src, i)
        cuda.syncthreads()
        rb = row_bytes_d(qt, n)
        for r in range(gw, D, nw_all):
            y = _row_dot(w, off + np.int64(r) * rb, qt, n // 8, xs, 0, red, wid, lane)
            if lane == 0:
                xg[r] = _ldcg(xg, r) + y

    # ptxas must fit NT threads a block (at 512 without the bound: out of resources)
    @(cuda.jit if SIM else cuda.jit(launch_bounds=NT))
    def kernel(w, wtab, nw, ntab, emb, emb_qt, outw, out_qt, out_norm, inv_freq, tok, pos,
               k_pool, v_pool, table, meta, kv_pos, xg, qkv, att, hg, part_o, part_ml, cnt, logits):
        tid = cuda.threadIdx.x
        lane = tid & 31
        wid = tid >> 5
        bid = cuda.blockIdx.x
        nb = cuda.gridDim.x
        gw = bid * W + wid
        nw_all = nb * W
        xs = cuda.shared.array(XS, np.float32)
        red = cuda.shared.array(RED, np.float32)
        bred = cuda.shared.array(NT, np.float32)
        qsh = cuda.shared.array(QSH, np.float32)  # the group's q heads, then the new k
        ss = cuda.shared.array(SSN, np.float32)
        acc = cuda.shared.array(ACC, np.float32)
        ml = cuda.shared.array(MLN, np.float32)  # m, l, the page's rescale a head
        tmp = cuda.shared.array(TMPN, np.float32)
        ibuf = cuda.shared.array(2, np.int32)
        n_past = meta[0]
        p = pos[0]
        n_keys = n_past + 1
        slot_new = table[n_past // PAGE]
        row_new = n_past % PAGE
        epoch = 0

        # the token's embedding: block 0 writes the residual stream
        t = tok[0]
        ebase = np.int64(t) * np.int64(row_bytes_d(emb_qt, D))
        if bid == 0:
            for i in range(tid, D, NT):
                xg[i] = _value(emb, ebase, emb_qt, i)
            if tid == 0:
                kv_pos[n_past] = p
        epoch += 1
        _grid_sync(cnt, epoch * nb, tid)

        for li in range(L):
            # (A) q, k, v rows of the normed stream; v into the pool
            norm_into(xs, xg, nw, ntab[li, 0], bred, tid)
            for r in range(gw, QR + 2 * KR, nw_all):
                if r < QR:
                    kind = 0
                    rr = r
                elif r < QR + KR:
                    kind = 1
                    rr = r - QR
                else:
                    kind = 2
                    rr = r - QR - KR
                qt = wtab[li, kind, 1]
                y = _row_dot(w, wtab[li, kind, 0] + np.int64(rr) * row_bytes_d(qt, D), qt, D // 8, xs, 0,
                             red, wid, lane)
                if lane == 0:
                    qkv[r] = y
                    if kind == 2:
                        v_pool[slot_new, li, rr // DH, row_new, rr % DH] = np.float16(y)
            epoch += 1
            _grid_sync(cnt, epoch * nb, tid)

            # (B) attention: items of (kv head, group of pages)
            n_pages = (n_keys + PAGE - 1) // PAGE
            ppi = max(1, (n_pages * HKV + nb - 1) // nb)
            n_ch = (n_pages + ppi - 1) // ppi
            for it in range(bid, HKV * n_ch, nb):
                h = it // n_ch
                ch = it % n_ch
                for i in range(tid, G * DH, NT):
                    qsh[i] = _ldcg(qkv, h * G * DH + i)
                    acc[i] = f32(0.0)
                if tid < G:
                    ml[tid] = f32(-math.inf)
                    ml[G + tid] = f32(0.0)
                cuda.syncthreads()
                head_norm_rope(qsh, 0, nw, ntab[li, 2] if QKN else -1, G, inv_freq, p, tmp, tid)
                pg0 = ch * ppi
                pg1 = min(n_pages, pg0 + ppi)
                if pg1 == n_pages:  # this item holds the new row: its k, normed and rotated, into the pool
                    for i in range(tid, DH, NT):
                        qsh[G * DH + i] = _ldcg(qkv, QR + h * DH + i)
                    cuda.syncthreads()
                    head_norm_rope(qsh, G * DH, nw, ntab[li, 3] if QKN else -1, 1, inv_freq, p, tmp, tid)
                    for i in range(tid, DH, NT):
                        k_pool[slot_new, li, h, row_new, i] = np.float16(qsh[G * DH + i])
                    cuda.syncthreads()
                for pg in range(pg0, pg1):
                    slot = table[pg]
                    nk = min(PAGE, n_keys - pg * PAGE)
                    for j in range(wid, nk, W):
                        for g in range(G):
                            s = f32(0.0)
                            for d in range(lane, DH, 32):
                                s += qsh[g * DH + d] * f32(k_pool[slot, li, h, j, d])
                            s = warp_sum(s, red, wid, lane)
                            if lane == 0:
                                ss[g * PAGE + j] = s * SCALE
                    cuda.syncthreads()
                    if tid < G:
                        m_old = ml[tid]
                        mx = m_old
                        for j in range(nk):
                            mx = max(mx, ss[tid * PAGE + j])
                        a = f32(math.exp(m_old - mx)) if m_old > -math.inf else f32(0.0)
                        lsum = f32(0.0)
                        for j in range(nk):
                            e = f32(math.exp(ss[tid * PAGE + j] - mx))
                            ss[tid * PAGE + j] = e
                            lsum += e
                        ml[tid] = mx
                        ml[G + tid] = ml[G + tid] * f32(a) + lsum
                        ml[2 * G + tid] = f32(a)
                    cuda.syncthreads()
                    for i in range(tid, G * DH, NT):
                        g = i // DH
                        d = i % DH
                        o = acc[i] * ml[2 * G + g]
                        for j in range(nk):
                            o += ss[g * PAGE + j] * f32(v_pool[slot, li, h, j, d])
                        acc[i] = o
                    cuda.syncthreads()
                for i in range(tid, G * DH, NT):
                    part_o[((h * G + i // DH) * MAXP + ch) * DH + i % DH] = acc[i]
                if tid < G:
                    part_ml[((h * G + tid) * MAXP + ch) * 2] = ml[tid]
                    part_ml[((h * G + tid) * MAXP + ch) * 2 + 1] = ml[G + tid]
                if arrive(cnt, 2 + h, n_ch, ibuf, tid):
                    for i in range(tid, G * DH, NT):
                        hq = h * G + i // DH
                        d = i % DH
                        m = f32(-math.inf)
                        for c in range(n_ch):
                            m = max(m, _ldcg(part_ml, (hq * MAXP + c) * 2))
                        num = f32(0.0)
                        den = f32(0.0)
                        for c in range(n_ch):
                            e = f32(math.exp(_ldcg(part_ml, (hq * MAXP + c) * 2) - m))
                            num += e * _ldcg(part_o, (hq * MAXP + c) * DH + d)
                            den += e * _ldcg(part_ml, (hq * MAXP + c) * 2 + 1)
                        att[hq * DH + d] = num / den
                cuda.syncthreads()
            epoch += 1
            _grid_sync(cnt, epoch * nb, tid)

            # (C) o rows into the residual stream
            into_stream(xs, att, QR, w, wtab[li, 3, 0], wtab[li, 3, 1], xg, red, tid, wid, lane, gw, nw_all)
            epoch += 1
            _grid_sync(cnt, epoch * nb, tid)

            # (D) gate and up rows of the normed stream, SwiGLU
            norm_into(xs, xg, nw, ntab[li, 1], bred, tid)
            qg = wtab[li, 4, 1]
            qu = wtab[li, 5, 1]
            for r in range(gw, F, nw_all):
                yg = _row_dot(w, wtab[li, 4, 0] + np.int64(r) * row_bytes_d(qg, D), qg, D // 8, xs, 0, red, wid, lane)
                yu = _row_dot(w, wtab[li, 5, 0] + np.int64(r) * row_bytes_d(qu, D), qu, D // 8, xs, 0, red, wid, lane)
                if lane == 0:
                    hg[r] = _silu(yg) * yu
            epoch += 1
            _grid_sync(cnt, epoch * nb, tid)

            # (E) down rows into the residual stream
            into_stream(xs, hg, F, w, wtab[li, 6, 0], wtab[li, 6, 1], xg, red, tid, wid, lane, gw, nw_all)
            epoch += 1
            _grid_sync(cnt, epoch * nb, tid)

        # the head
        norm_into(xs, xg, out_norm, 0, bred, tid)
        rb = row_bytes_d(out_qt, D)
        for r in range(gw, logits.shape[1], nw_all):
            y = _row_dot(outw, np.int64(r) * rb, out_qt, D // 8, xs, 0, red, wid, lane)
            if lane == 0:
                logits[0, r] = y
        # the last block out resets the barrier's counter for the next launch (no block
        # reads it after its own count here)
        if tid == 0:
            if cuda.atomic.add(cnt, 1, 1) == nb - 1:
                cnt[0] = 0
                cnt[1] = 0

    return kernel


@device
def row_bytes_d(qt, cols):
    if qt == _Q4K:
        return np.int64(cols // 256) * 144
    if qt == _Q6K:
        return np.int64(cols // 256) * 210
    return np.int64(cols // 32) * 34


# ----------------------------------------------------------------------------- host side
def applies(cfg, weights, kv) -> str | None:
    """None where the persistent kernel runs this model's decode, else why not."""
    if cfg.qkv_bias or cfg.post_norms or cfg.embed_scale != 1.0 or cfg.attn_scale is not None:
        return "biases, post-norms, embedding or attention scales"
    if cfg.ffn_act != "silu":
        return f"FFN activation {cfg.ffn_act}"
    if any(cfg.layer_window(i) for i in range(cfg.n_layers)) or cfg.rope_freq_scale != 1.0:
        return "sliding windows or scaled RoPE"
    if kv.k_scale is not None or np.dtype(kv.dtype) != np.float16:
        return "a quantized KV pool"
    if cfg.n_heads % cfg.n_kv_heads or cfg.head_dim % 32:
        return "head layout"
    mats = [getattr(lw, k) for lw in weights.layers for k in KINDS] + [weights.tok_embd, weights.output]
    for m in mats:
        if m.qtype not in QTYPE_CODES:
            return f"weight type {getattr(m.qtype, 'name', m.qtype)}"
        qk = _BLOCK[QTYPE_CODES[m.qtype]][0]
        if m.shape[1] % qk:
            return f"a {m.shape[1]}-column weight in {qk}-column blocks"
    return None


class PersistentDecode:
    """A model's one-token forward through the persistent kernel: weights packed once into
    one buffer (a copy on the device: meant for small models, such as drafts), scratch at
    fixed addresses (CUDA graphs capture `forward`)."""

    def __init__(self, cfg, weights, kv, stream=0, blocks: int | None = None):
        why = applies(cfg, weights, kv)
        if why is not None:
            raise ValueError(f"the persistent decode kernel does not take this model: {why}")
        self.cfg, self.kv, self.stream = cfg, kv, stream
        L = cfg.n_layers
        offs, total = [], 0
        for lw in weights.layers:
            for k in KINDS:
                m = getattr(lw, k)
                offs.append((total, m))
                total += -(-m.raw.size // 16) * 16
        self.w = cuda.device_array(max(16, total), np.uint8)
        wtab = np.zeros((L, len(KINDS), 2), np.int64)
        for i, (o, m) in enumerate(offs):
            self.w[o:o + m.raw.size].copy_to_device(m.raw.reshape(m.raw.size), stream=stream)
            wtab[i // len(KINDS), i % len(KINDS)] = (o, QTYPE_CODES[m.qtype])
        d, dh = cfg.n_embd, cfg.head_dim
        norms, ntab, n = [], np.full((L, len(NORMS)), -1, np.int64), 0
        for li, lw in enumerate(weights.layers):
            for j, name in enumerate(NORMS):
                v = getattr(lw, name)
                if v is None or (name in ("q_norm", "k_norm") and not cfg.qk_norm):
                    continue
                host = v.copy_to_host().astype(np.float32)
                norms.append(host)
                ntab[li, j] = n
                n += host.size
        self.wtab, self.ntab = cuda.to_device(wtab, stream=stream), cuda.to_device(ntab, stream=stream)
        self.nw = cuda.to_device(np.concatenate(norms), stream=stream)
        self.emb, self.out = weights.tok_embd, weights.output
        self.out_norm = weights.out_norm
        from .rope import inv_freqs
        self.inv_freq = cuda.to_device(inv_freqs(cfg.rope_dim, cfg.rope_base), stream=stream)
        qr, kr = cfg.n_heads * dh, cfg.n_kv_heads * dh
        self.xg = cuda.device_array(d, np.float32)
        self.qkv = cuda.device_array(qr + 2 * kr, np.float32)
        self.att = cuda.device_array(qr, np.float32)
        self.hg = cuda.device_array(cfg.n_ff, np.float32)
        pages = kv.max_blocks
        self.part_o = cuda.device_array(cfg.n_heads * pages * dh, np.float32)
        self.part_ml = cuda.device_array(cfg.n_heads * pages * 2, np.float32)
        self.cnt = cuda.to_device(np.zeros(2 + cfg.n_kv_heads, np.int32), stream=stream)
        self.logits = cuda.device_array((1, cfg.vocab_size), np.float32)
        self.threads = 32 if SIM else THREADS
        if SIM:
            self.blocks = 1  # blocks run one after another there: a grid barrier would never open
        else:
            self.blocks = blocks or cuda.get_current_device().MULTIPROCESSOR_COUNT
        from ..models.config import ROPE_HALVES
        self.kernel = _kernel(d, cfg.n_heads, cfg.n_kv_heads, dh, cfg.n_ff, L, cfg.rope_dim,
                              cfg.rope_style == ROPE_HALVES, bool(cfg.qk_norm), float(cfg.rms_eps), self.threads, pages)

    def forward(self, tok_d, pos_d):
        """Logits [1, vocab] of the token tok_d[0] at position pos_d[0] (device int32), its
        K/V written at the pool's row meta[0] (the caller has reserved it)."""
        kv = self.kv
        self.kernel[self.blocks, self.threads, self.stream](
            self.w, self.wtab, self.nw, self.ntab, self.emb.raw.reshape(self.emb.raw.size),
            QTYPE_CODES[self.emb.qtype], self.out.raw.reshape(self.out.raw.size), QTYPE_CODES[self.out.qtype],
            self.out_norm, self.inv_freq, tok_d, pos_d, kv.k_pool, kv.v_pool, kv.table_d, kv.meta, kv.pos_d,
            self.xg, self.qkv, self.att, self.hg, self.part_o, self.part_ml, self.cnt, self.logits)
        return self.logits
