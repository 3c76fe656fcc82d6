"""LayerNorm, optionally after a residual add (written back to x in x's dtype), in one kernel (Pi0.5's SigLIP).
Statistics in float32 from x as stored (after the add's rounding), as `x = x + add` followed by torch's LayerNorm
computes them; one rounding per output.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sglang_ext.kernels.backend import after_previous_kernel, block_size, runs_triton, tl, triton, uses_pdl


def _check(x, weight, bias, add):
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t.numel() != n:
            raise ValueError(f"add_layer_norm: {name} has {t.numel()} elements; allowed: x's width {n}")
    if add is not None and tuple(add.shape) != tuple(x.shape):
        raise ValueError(f"add_layer_norm: add of shape {tuple(add.shape)}; allowed: x's {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("add_layer_norm: x must be contiguous (it may be updated in place)")
    return n, x.numel() // n


def add_layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, eps: float,
                             add: Optional[torch.Tensor] = None) -> torch.Tensor:
    n, _ = _check(x, weight, bias, add)
    rows = x.view(-1, n)
    if add is not None:
        rows.copy_((rows.float() + add.reshape(-1, n).float()).to(x.dtype))
    return F.layer_norm(rows.float(), (n,), weight.float(), bias.float(), eps).to(x.dtype).reshape(x.shape)


if triton is not None:

    @triton.jit
    def _add_layer_norm_kernel(X, ADD, W, B, OUT, n_cols, eps, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
        after_previous_kernel(PDL)
        start = tl.program_id(0).to(tl.int64) * n_cols
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + start + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_ADD:
            stored = (x + tl.load(ADD + start + cols, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
            tl.store(X + start + cols, stored, mask=mask)
            x = stored.to(tl.float32)
        mean = tl.sum(x, axis=0) / n_cols
        centered = tl.where(mask, x - mean, 0.0)
        variance = tl.sum(centered * centered, axis=0) / n_cols
        normed = centered / tl.sqrt(variance + eps)
        weight = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + start + cols, (normed * weight + bias).to(OUT.dtype.element_ty), mask=mask)


def add_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, eps: float,
                   add: Optional[torch.Tensor] = None, pdl: bool = True) -> torch.Tensor:
    """LayerNorm(x [+ add]) as a new tensor in x's dtype; with `add`, x is updated in place first."""
    if not runs_triton(x):
        return add_layer_norm_reference(x, weight, bias, eps=eps, add=add)
    n, rows = _check(x, weight, bias, add)
    out = torch.empty_like(x)
    block, pdl = block_size(n), uses_pdl(x, pdl)
    _add_layer_norm_kernel[(rows,)](
        x, add.contiguous() if add is not None else x, weight.contiguous(), bias.contiguous(), out, n, float(eps),
        HAS_ADD=add is not None, BLOCK=block, PDL=pdl, launch_pdl=pdl, num_warps=4 if block <= 2048 else 8)
    return out
