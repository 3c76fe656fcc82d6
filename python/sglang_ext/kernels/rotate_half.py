"""Rotate-half rotary embedding of q and k in one kernel, rounded as the eager torch formula rounds it:
out = x * cos + cat(-x[D/2:], x[:D/2]) * sin, float32 math, then x's dtype.

q [T, H, D], k [T, KV, D] contiguous; cos, sin [T, D] read as float32; one program per token. Built without
multiply-add contraction, so each product and the sum round on their own as torch's eager kernels do: on the
GPU the output is the formula's bit for bit (what a CUDA graph of the eager formula replays).
"""

from __future__ import annotations

import torch

from sglang_ext.kernels.backend import after_previous_kernel, block_size, runs_triton, tl, triton, uses_pdl


def rotate_half_qk_reference(q, k, cos, sin):
    cos, sin = cos.float()[:, None], sin.float()[:, None]

    def rotate(x):
        wide = x.float()
        first, second = wide.chunk(2, dim=-1)
        return (wide * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)

    return rotate(q), rotate(k)


def rotate_half_qk_supports(q, k, cos, sin) -> str:
    """Why `rotate_half_qk` cannot take these tensors ("" when it can)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % 2:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}; allowed: [T, H, D] and [T, KV, D], D even"
    if tuple(cos.shape) != (q.shape[0], q.shape[2]) or cos.shape != sin.shape:
        return f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}; allowed: both [{q.shape[0]}, {q.shape[2]}]"
    if not (q.is_contiguous() and k.is_contiguous()) or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return "q and k contiguous, cos and sin with unit column stride"
    if max(q.numel(), k.numel(), cos.stride(0) * cos.shape[0], sin.stride(0) * sin.shape[0]) >= 2**31:
        return "fewer than 2**31 elements per tensor"
    return ""


if triton is not None:

    @triton.jit
    def _rotate_heads(SRC, DST, token, cos_first, sin_first, cos_second, sin_second,
                      HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        half: tl.constexpr = HEAD_DIM // 2
        head = tl.arange(0, HEADS_BLOCK)[:, None]
        col = tl.arange(0, BLOCK)[None, :]
        mask = (head < HEADS) & (col < half)
        offsets = (token * HEADS + head) * HEAD_DIM + col
        first = tl.load(SRC + offsets, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(SRC + offsets + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(DST + offsets, (first * cos_first + (-second) * sin_first).to(DST.dtype.element_ty), mask=mask)
        tl.store(DST + offsets + half, (second * cos_second + first * sin_second).to(DST.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate_half_qk_kernel(Q, K, COS, SIN, Q_OUT, K_OUT, cos_stride, sin_stride,
                               Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               Q_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        after_previous_kernel(PDL)
        token = tl.program_id(0)
        half: tl.constexpr = HEAD_DIM // 2
        col = tl.arange(0, BLOCK)[None, :]
        mask = col < half
        cos_row, sin_row = COS + token * cos_stride + col, SIN + token * sin_stride + col
        cos_first = tl.load(cos_row, mask=mask, other=0.0).to(tl.float32)
        cos_second = tl.load(cos_row + half, mask=mask, other=0.0).to(tl.float32)
        sin_first = tl.load(sin_row, mask=mask, other=0.0).to(tl.float32)
        sin_second = tl.load(sin_row + half, mask=mask, other=0.0).to(tl.float32)
        _rotate_heads(Q, Q_OUT, token, cos_first, sin_first, cos_second, sin_second, Q_HEADS, HEAD_DIM, Q_BLOCK, BLOCK)
        _rotate_heads(K, K_OUT, token, cos_first, sin_first, cos_second, sin_second, K_HEADS, HEAD_DIM, K_BLOCK, BLOCK)


def rotate_half_qk(q, k, cos, sin, *, checked=False):
    """(q rotated, k rotated), new tensors of q's and k's dtypes. checked=True: the caller has just
    had "" from `rotate_half_qk_supports` for these tensors (the per-layer hot path checks once)."""
    if not runs_triton(q):
        return rotate_half_qk_reference(q, k, cos, sin)
    problem = "" if checked else rotate_half_qk_supports(q, k, cos, sin)
    if problem:
        raise ValueError(f"rotate_half_qk: {problem}")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.shape[0]:
        pdl = uses_pdl(q)
        _rotate_half_qk_kernel[(q.shape[0],)](
            q, k, cos, sin, q_out, k_out, cos.stride(0), sin.stride(0), Q_HEADS=q.shape[1], K_HEADS=k.shape[1],
            HEAD_DIM=q.shape[2], Q_BLOCK=block_size(q.shape[1]), K_BLOCK=block_size(k.shape[1]),
            BLOCK=block_size(q.shape[2] // 2), PDL=pdl, launch_pdl=pdl, enable_fp_fusion=False, num_warps=2)
    return q_out, k_out
