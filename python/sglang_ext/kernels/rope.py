"""Neox-style rotary embedding of q and k straight out of a packed qkv projection.

qkv [B, S, (H + 2 * KV) * D] (or skinny_linear `Partials`) -> q_out [B, S, H, D], k / v (v unrotated) into rows
kv_start .. kv_start + S of k_out / v_out [B, T, KV, D] (after a cached prefix). Neox rotates halves, not pairs.
cos_sin: [B * S, D] float32 [cos | sin] (sglang's cos_sin_cache rows); math in float32. `linear_rope_qkv` also
computes the projection of a few rows in the same kernel, rotating it unrounded (it never goes to memory).
"""

from __future__ import annotations

import torch

from sglang_ext.kernels.backend import (DOT_UPCAST, after_previous_kernel, block_size, runs_triton, tl, triton,
                                        uses_pdl)
from sglang_ext.kernels.skinny_gemm import STAGES, Partials, check_rows_and_blocks, slice_products


def _check(shape, cos_sin, q_out, k_out, v_out, num_heads, num_kv_heads, head_dim, kv_start):
    """(B, S) of a qkv projection of `shape`, after checking the outputs against it."""
    batch, seq = shape[0], shape[1]
    expected = (num_heads + 2 * num_kv_heads) * head_dim
    if len(shape) != 3 or shape[2] != expected:
        raise ValueError(f"rope_qkv: qkv of shape {tuple(shape)}; allowed: [B, S, {expected}]")
    if head_dim % 2:
        raise ValueError(f"rope_qkv: head_dim={head_dim}; allowed: even sizes")
    if tuple(cos_sin.shape) != (batch * seq, head_dim):
        raise ValueError(f"rope_qkv: cos_sin of shape {tuple(cos_sin.shape)}; allowed: {(batch * seq, head_dim)}")
    if tuple(q_out.shape) != (batch, seq, num_heads, head_dim):
        raise ValueError(f"rope_qkv: q_out of shape {tuple(q_out.shape)}; allowed: {(batch, seq, num_heads, head_dim)}")
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        if t.dim() != 4 or t.shape[0] != batch or tuple(t.shape[2:]) != (num_kv_heads, head_dim):
            raise ValueError(f"rope_qkv: {name} of shape {tuple(t.shape)}; allowed: [{batch}, T, {num_kv_heads}, "
                             f"{head_dim}]")
        if not 0 <= kv_start <= t.shape[1] - seq:
            raise ValueError(f"rope_qkv: kv_start={kv_start}; allowed: 0..{t.shape[1] - seq} for {name} "
                             f"{tuple(t.shape)}")
    return batch, seq


def _check_linear(x, weight, head_dim, block_n, block_k):
    if x.dim() != 3:
        raise ValueError(f"linear_rope_qkv: x {tuple(x.shape)}; allowed: [B, S, K]")
    check_rows_and_blocks(x, weight, 1, block_n, block_k, what="linear_rope_qkv")
    if (head_dim // 2) % block_n:
        raise ValueError(f"linear_rope_qkv: block_n={block_n}; allowed: dividing head_dim / 2={head_dim // 2}")


def rope_qkv_reference(qkv, cos_sin, q_out, k_out, v_out, *, num_heads, num_kv_heads, head_dim, kv_start):
    batch, seq = _check(qkv.shape, cos_sin, q_out, k_out, v_out, num_heads, num_kv_heads, head_dim, kv_start)
    qkv = qkv.total() if isinstance(qkv, Partials) else qkv
    q, k, v = qkv.float().split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cos, sin = cos_sin.float().view(batch, seq, 1, head_dim).chunk(2, dim=-1)

    def rotate(t, heads):
        first, second = t.view(batch, seq, heads, head_dim).chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    rows = slice(kv_start, kv_start + seq)
    q_out.copy_(rotate(q, num_heads))
    k_out[:, rows].copy_(rotate(k, num_kv_heads))
    v_out[:, rows].copy_(v.view(batch, seq, num_kv_heads, head_dim))


def linear_rope_qkv_reference(x, weight, cos_sin, q_out, k_out, v_out, *, num_heads, num_kv_heads, head_dim,
                              kv_start, block_n=16, block_k=128):
    _check_linear(x, weight, head_dim, block_n, block_k)
    qkv = (x.float() @ weight.float().t()).reshape(*x.shape[:-1], weight.shape[0])
    rope_qkv_reference(qkv, cos_sin, q_out, k_out, v_out, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, kv_start=kv_start)


if triton is not None:

    @triton.jit
    def _rotate_and_store(first, second, cos, sin, head, token, cols, mask, Q_OUT, K_OUT, V_OUT,
                          seq_len, kv_len, kv_start,
                          NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Rotate columns (cols, cols + D/2) of `head` for `token` (v: as is) into q_out or the K/V buffer."""
        rotate = head < NUM_HEADS + NUM_KV  # v heads: cos 1, sin 0 (exact)
        cos = tl.where(rotate, cos, 1.0)
        sin = tl.where(rotate, sin, 0.0)
        out_first = first * cos - second * sin
        out_second = second * cos + first * sin
        kv_row = (token // seq_len) * kv_len + kv_start + token % seq_len
        if head < NUM_HEADS:
            dst = Q_OUT + (token * NUM_HEADS + head) * HEAD_DIM + cols
        elif head < NUM_HEADS + NUM_KV:
            dst = K_OUT + (kv_row * NUM_KV + head - NUM_HEADS) * HEAD_DIM + cols
        else:
            dst = V_OUT + (kv_row * NUM_KV + head - NUM_HEADS - NUM_KV) * HEAD_DIM + cols
        tl.store(dst, out_first.to(Q_OUT.dtype.element_ty), mask=mask)
        tl.store(dst + HEAD_DIM // 2, out_second.to(Q_OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_qkv_kernel(
        QKV, COS_SIN, Q_OUT, K_OUT, V_OUT,
        seq_len, kv_len, kv_start, part_stride,
        PARTS: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        after_previous_kernel(PDL)
        token = tl.program_id(0)
        head = tl.program_id(1)
        half = HEAD_DIM // 2
        cols = tl.arange(0, BLOCK)
        mask = cols < half
        src = QKV + token * ((NUM_HEADS + 2 * NUM_KV) * HEAD_DIM) + head * HEAD_DIM
        first = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(src + half + cols, mask=mask, other=0.0).to(tl.float32)
        for part in tl.static_range(1, PARTS):
            first += tl.load(src + part * part_stride + cols, mask=mask, other=0.0)
            second += tl.load(src + part * part_stride + half + cols, mask=mask, other=0.0)
        cos = tl.load(COS_SIN + token * HEAD_DIM + cols, mask=mask, other=1.0)
        sin = tl.load(COS_SIN + token * HEAD_DIM + half + cols, mask=mask, other=0.0)
        _rotate_and_store(first, second, cos, sin, head, token, cols, mask, Q_OUT, K_OUT, V_OUT,
                          seq_len, kv_len, kv_start, NUM_HEADS, NUM_KV, HEAD_DIM)

    @triton.jit
    def _linear_rope_qkv_kernel(
        X, W, COS_SIN, Q_OUT, K_OUT, V_OUT,
        rows, k_dim, seq_len, kv_len, kv_start,
        NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr, UPCAST: tl.constexpr,
        PDL: tl.constexpr,
    ):
        after_previous_kernel(PDL)
        half: tl.constexpr = HEAD_DIM // 2
        blocks: tl.constexpr = half // BLOCK_N
        head = tl.program_id(0) // blocks
        c = (tl.program_id(0) % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of the first half
        rm = tl.arange(0, BLOCK_M)
        first, second = slice_products(X, W, rm, head * HEAD_DIM + c, rows, (NUM_HEADS + 2 * NUM_KV) * HEAD_DIM, k_dim,
                                       0, k_dim, half, BLOCK_M, BLOCK_N, BLOCK_K, True, F32, UPCAST)
        row_ok = (rm < rows)[:, None]
        table = COS_SIN + rm[:, None] * HEAD_DIM + c[None, :]
        cos = tl.load(table, mask=row_ok, other=1.0)
        sin = tl.load(table + half, mask=row_ok, other=0.0)
        _rotate_and_store(first, second, cos, sin, head, rm[:, None], c[None, :], row_ok, Q_OUT, K_OUT, V_OUT,
                          seq_len, kv_len, kv_start, NUM_HEADS, NUM_KV, HEAD_DIM)


def rope_qkv(qkv, cos_sin, q_out, k_out, v_out, *, num_heads, num_kv_heads, head_dim, kv_start, pdl=True):
    if not runs_triton(q_out):
        return rope_qkv_reference(qkv, cos_sin, q_out, k_out, v_out, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                  head_dim=head_dim, kv_start=kv_start)
    batch, seq = _check(qkv.shape, cos_sin, q_out, k_out, v_out, num_heads, num_kv_heads, head_dim, kv_start)
    parts, pdl = 1, uses_pdl(q_out, pdl)
    if isinstance(qkv, Partials):
        qkv, parts = qkv.parts, qkv.parts.shape[0]
    for name, t in (("qkv", qkv), ("cos_sin", cos_sin), ("q_out", q_out), ("k_out", k_out), ("v_out", v_out)):
        if not t.is_contiguous():
            raise ValueError(f"rope_qkv: {name} must be contiguous")
    if not (q_out.dtype == k_out.dtype == v_out.dtype):
        raise ValueError("rope_qkv: q_out, k_out and v_out must share one dtype")
    if cos_sin.dtype != torch.float32:
        raise ValueError(f"rope_qkv: cos_sin dtype {cos_sin.dtype}; allowed: torch.float32")
    _rope_qkv_kernel[(batch * seq, num_heads + 2 * num_kv_heads)](
        qkv, cos_sin, q_out, k_out, v_out, seq, k_out.shape[1], int(kv_start), qkv[0].numel(), PARTS=parts,
        NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, BLOCK=block_size(head_dim // 2), PDL=pdl,
        launch_pdl=pdl, num_warps=1 if head_dim <= 256 else 2)


def linear_rope_qkv(x, weight, cos_sin, q_out, k_out, v_out, *, num_heads, num_kv_heads, head_dim, kv_start,
                    block_n=16, block_k=128, pdl=True):
    """rope_qkv of x [B, S, K] @ weight [(H + 2 KV) * D, K].T in one kernel (block_n column pairs per program)."""
    if not runs_triton(q_out):
        return linear_rope_qkv_reference(x, weight, cos_sin, q_out, k_out, v_out, num_heads=num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim, kv_start=kv_start,
                                         block_n=block_n, block_k=block_k)
    _check_linear(x, weight, head_dim, block_n, block_k)
    batch, seq = _check((*x.shape[:-1], weight.shape[0]), cos_sin, q_out, k_out, v_out, num_heads, num_kv_heads,
                        head_dim, kv_start)
    for name, t in (("x", x), ("weight", weight), ("cos_sin", cos_sin), ("q_out", q_out), ("k_out", k_out),
                    ("v_out", v_out)):
        if not t.is_contiguous():
            raise ValueError(f"linear_rope_qkv: {name} must be contiguous")
    if x.dtype != weight.dtype or not (q_out.dtype == k_out.dtype == v_out.dtype) or cos_sin.dtype != torch.float32:
        raise ValueError("linear_rope_qkv: x and weight share one dtype, q/k/v_out another, cos_sin is float32")
    pdl = uses_pdl(x, pdl)
    _linear_rope_qkv_kernel[((num_heads + 2 * num_kv_heads) * (head_dim // 2 // block_n),)](
        x, weight, cos_sin, q_out, k_out, v_out, batch * seq, x.shape[-1], seq, k_out.shape[1], int(kv_start),
        NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=max(16, block_size(batch * seq)),
        BLOCK_N=block_n, BLOCK_K=block_k, F32=x.dtype == torch.float32, UPCAST=DOT_UPCAST, PDL=pdl,
        launch_pdl=pdl, num_warps=4, num_stages=STAGES)
