"""Neox-style rotary embedding of q and k straight out of a packed qkv projection.

One kernel: reads qkv [B, S, (H + 2 * KV) * D], rotates every q and k head with a
float32 cos/sin table, writes q to `q_out` [B, S, H, D] and k / v (v unrotated)
into rows `kv_start .. kv_start + S` of `k_out` / `v_out` [B, T, KV, D] (a K/V
buffer whose first rows hold a cached prefix). Rotation (neox: halves, not pairs):

    out[:D/2] = x[:D/2] * cos - x[D/2:] * sin
    out[D/2:] = x[D/2:] * cos + x[:D/2] * sin

cos_sin: [B * S, D] float32, cos in the first D/2 columns and sin in the last D/2
(the layout of an sglang RotaryEmbedding cos_sin_cache row). Math in float32.
qkv may be a skinny_linear `Partials` of that shape (summed here in float32).
"""

from __future__ import annotations

import torch

from sglang_ext.kernels.backend import after_previous_kernel, block_size, runs_triton, tl, triton, uses_pdl
from sglang_ext.kernels.skinny_gemm import Partials


def _check(qkv, cos_sin, q_out, k_out, v_out, num_heads, num_kv_heads, head_dim, kv_start):
    batch, seq = qkv.shape[0], qkv.shape[1]
    expected = (num_heads + 2 * num_kv_heads) * head_dim
    if len(qkv.shape) != 3 or qkv.shape[2] != expected:
        raise ValueError(f"rope_qkv: qkv of shape {tuple(qkv.shape)}; allowed: [B, S, {expected}]")
    if head_dim % 2:
        raise ValueError(f"rope_qkv: head_dim={head_dim}; allowed: even sizes")
    if tuple(cos_sin.shape) != (batch * seq, head_dim):
        raise ValueError(f"rope_qkv: cos_sin of shape {tuple(cos_sin.shape)}; allowed: {(batch * seq, head_dim)}")
    if tuple(q_out.shape) != (batch, seq, num_heads, head_dim):
        raise ValueError(f"rope_qkv: q_out of shape {tuple(q_out.shape)}; allowed: {(batch, seq, num_heads, head_dim)}")
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        if t.dim() != 4 or t.shape[0] != batch or tuple(t.shape[2:]) != (num_kv_heads, head_dim):
            raise ValueError(f"rope_qkv: {name} of shape {tuple(t.shape)}; allowed: [{batch}, T, {num_kv_heads}, {head_dim}]")
        if not 0 <= kv_start <= t.shape[1] - seq:
            raise ValueError(f"rope_qkv: kv_start={kv_start}; allowed: 0..{t.shape[1] - seq} for {name} {tuple(t.shape)}")
    return batch, seq


def rope_qkv_reference(qkv, cos_sin, q_out, k_out, v_out, *, num_heads, num_kv_heads, head_dim, kv_start):
    """torch version of `rope_qkv` (same float32 math)."""
    batch, seq = _check(qkv, cos_sin, q_out, k_out, v_out, num_heads, num_kv_heads, head_dim, kv_start)
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


if triton is not None:

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
        rotate = head < NUM_HEADS + NUM_KV  # v heads pass through: cos 1, sin 0 (exact)
        cos = tl.where(rotate, cos, 1.0)
        sin = tl.where(rotate, sin, 0.0)
        out_first = first * cos - second * sin
        out_second = second * cos + first * sin
        kv_row = (token // seq_len) * kv_len + kv_start + token % seq_len
        if head < NUM_HEADS:
            dst = Q_OUT + (token * NUM_HEADS + head) * HEAD_DIM
        elif head < NUM_HEADS + NUM_KV:
            dst = K_OUT + (kv_row * NUM_KV + head - NUM_HEADS) * HEAD_DIM
        else:
            dst = V_OUT + (kv_row * NUM_KV + head - NUM_HEADS - NUM_KV) * HEAD_DIM
        tl.store(dst + cols, out_first.to(Q_OUT.dtype.element_ty), mask=mask)
        tl.store(dst + half + cols, out_second.to(Q_OUT.dtype.element_ty), mask=mask)


def rope_qkv(qkv, cos_sin, q_out, k_out, v_out, *, num_heads, num_kv_heads, head_dim, kv_start):
    """Rotate q and k of `qkv`; q -> q_out, k / v -> rows kv_start.. of k_out / v_out."""
    if not runs_triton(q_out):
        return rope_qkv_reference(
            qkv, cos_sin, q_out, k_out, v_out,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, kv_start=kv_start,
        )
    batch, seq = _check(qkv, cos_sin, q_out, k_out, v_out, num_heads, num_kv_heads, head_dim, kv_start)
    parts = 1
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
        qkv, cos_sin, q_out, k_out, v_out,
        seq, k_out.shape[1], int(kv_start), qkv[0].numel(),
        PARTS=parts, NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, BLOCK=block_size(head_dim // 2),
        PDL=uses_pdl(q_out), launch_pdl=uses_pdl(q_out), num_warps=1 if head_dim <= 256 else 2,
    )
