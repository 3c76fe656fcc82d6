"""Modulated RMS norm, optionally after a gated residual add, in one kernel: x <- x + add * gate (with `add`,
written back in x's dtype), then out = rms(x) * (1 + scale) + shift.

rms(x) = x / sqrt(mean(x^2) + eps) from x as stored (after the residual add's rounding). `add` may be a
skinny_linear `Partials` (summed here in float32). Row c of a [C, N] scale / shift / gate applies to rows
c*G .. c*G+G-1 of x (adaRMS: C = batch, G = tokens). Math in float32, one rounding per output.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_ext.kernels.backend import after_previous_kernel, block_size, runs_triton, tl, triton, uses_pdl
from sglang_ext.kernels.skinny_gemm import Partials


def _check(x, scale, shift, add, gate):
    n = x.shape[-1]
    rows = x.numel() // n
    conds = scale.numel() // n
    if scale.numel() != conds * n or conds == 0 or rows % conds:
        raise ValueError(f"ada_rms_norm: scale of shape {tuple(scale.shape)} does not give one row per group of "
                         f"the {rows} rows of x (width {n})")
    for name, t in (("shift", shift), ("gate", gate)):
        if t is not None and t.numel() != conds * n:
            raise ValueError(f"ada_rms_norm: {name} has {t.numel()} elements; allowed: {conds * n} (like scale)")
    if add is not None and tuple(add.shape) != tuple(x.shape):
        raise ValueError(f"ada_rms_norm: add of shape {tuple(add.shape)}; allowed: x's {tuple(x.shape)}")
    if gate is not None and add is None:
        raise ValueError("ada_rms_norm: gate without add; allowed: gate only with add")
    return n, rows, rows // conds


def ada_rms_norm_reference(x: torch.Tensor, scale: torch.Tensor, shift: Optional[torch.Tensor] = None, *, eps: float,
                           add: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
                           out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    n, _, group = _check(x, scale, shift, add, gate)

    def per_row(t):
        return t.reshape(-1, n).float().repeat_interleave(group, dim=0)

    rows = x.reshape(-1, n)
    if add is not None:
        branch = (add.total() if isinstance(add, Partials) else add).reshape(-1, n).float()
        if gate is not None:
            branch = branch * per_row(gate)
        rows.copy_((rows.float() + branch).to(x.dtype))
    value = rows.float()
    normed = value * torch.rsqrt(value.square().mean(dim=-1, keepdim=True) + eps)
    normed = normed * (1.0 + per_row(scale))
    if shift is not None:
        normed = normed + per_row(shift)
    return normed.to(out_dtype or x.dtype).reshape(x.shape)


if triton is not None:

    @triton.jit
    def _ada_rms_norm_kernel(
        X, ADD, GATE, SCALE, SHIFT, OUT,
        n_cols, group, eps, part_stride,
        HAS_ADD: tl.constexpr, ADD_PARTS: tl.constexpr, HAS_GATE: tl.constexpr, HAS_SHIFT: tl.constexpr,
        BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        after_previous_kernel(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        cond = (row // group) * n_cols
        x_ptrs = X + row * n_cols + cols
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_ADD:
            branch = tl.load(ADD + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            for part in tl.static_range(1, ADD_PARTS):
                branch += tl.load(ADD + part * part_stride + row * n_cols + cols, mask=mask, other=0.0)
            if HAS_GATE:
                branch = branch * tl.load(GATE + cond + cols, mask=mask, other=0.0).to(tl.float32)
            stored = (x + branch).to(X.dtype.element_ty)
            tl.store(x_ptrs, stored, mask=mask)
            x = stored.to(tl.float32)
        mean_square = tl.sum(x * x, axis=0) / n_cols
        normed = x / tl.sqrt(mean_square + eps)
        scale = tl.load(SCALE + cond + cols, mask=mask, other=0.0).to(tl.float32)
        normed = normed * (1.0 + scale)
        if HAS_SHIFT:
            normed = normed + tl.load(SHIFT + cond + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * n_cols + cols, normed.to(OUT.dtype.element_ty), mask=mask)


def ada_rms_norm(x: torch.Tensor, scale: torch.Tensor, shift: Optional[torch.Tensor] = None, *, eps: float,
                 add: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
                 out_dtype: Optional[torch.dtype] = None, pdl: bool = True) -> torch.Tensor:
    """The norm as a new tensor in `out_dtype` (default x.dtype); with `add`, x is updated in place first."""
    if not runs_triton(x):
        return ada_rms_norm_reference(x, scale, shift, eps=eps, add=add, gate=gate, out_dtype=out_dtype)
    n, rows, group = _check(x, scale, shift, add, gate)
    if not x.is_contiguous():
        raise ValueError("ada_rms_norm: x must be contiguous (it may be updated in place)")
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    block = block_size(n)
    scale = scale.contiguous()
    parts, pdl = 1, uses_pdl(x, pdl)
    if isinstance(add, Partials):
        add, parts = add.parts, add.parts.shape[0]
    _ada_rms_norm_kernel[(rows,)](
        x, add.contiguous() if add is not None else x, gate.contiguous() if gate is not None else scale, scale,
        shift.contiguous() if shift is not None else scale, out, n, group, float(eps), rows * n,
        HAS_ADD=add is not None, ADD_PARTS=parts, HAS_GATE=gate is not None, HAS_SHIFT=shift is not None,
        BLOCK=block, PDL=pdl, launch_pdl=pdl, num_warps=4 if block <= 2048 else 8)
    return out
