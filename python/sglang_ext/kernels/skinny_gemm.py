"""x @ weight.T for a few rows (M <= 128): the weight-read-bound GEMMs of a small-batch step.

Every program reads one [BLOCK_N, K / parts] weight slice once with all rows of x in one tile, so the launch
streams the weight exactly once (cuBLAS stays well below HBM bandwidth here). parts > 1 splits K into float32
`Partials` that their consumer sums in a fixed order: no reduce kernel, no atomics. parts == 1 rounds once,
after the epilogue: gated (packed [gate; up]) takes gelu_tanh(gate) * up of the unrounded float32 products;
bias and add_to (+= alpha * result) are float32. float32 x and weight multiply as three TF32 products
(tf32x3: float32-level accuracy on tensor cores; sglang keeps Pi0.5's action projections in float32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from sglang_ext.kernels.activation import gelu_tanh
from sglang_ext.kernels.backend import (DOT_UPCAST, after_previous_kernel, block_size, runs_triton, tl, triton,
                                        uses_pdl)

MAX_ROWS = 128
STAGES = 4  # pipeline stages of the GEMM loops (skinny_linear, linear_rope_qkv)


class Partials(NamedTuple):
    """Split-K partial products of one GEMM, float32 [parts, ..., N]; their sum is the product."""

    parts: torch.Tensor

    @property
    def shape(self):
        return self.parts.shape[1:]

    def total(self) -> torch.Tensor:
        """The product in float32 (summed in part order, as the kernels sum it)."""
        return sum(self.parts[1:], start=self.parts[0])


def check_rows_and_blocks(x, weight, parts, block_n, block_k, epilogue=(), what="skinny_linear"):
    """(rows, N, K) of x @ weight.T after the checks every skinny GEMM kernel needs (`what`: the caller)."""
    rows = x.numel() // x.shape[-1]
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x width {x.shape[-1]}; allowed: the weight's K={k}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{what}: {rows} rows; allowed: 1..{MAX_ROWS}")
    if parts < 1 or k % (parts * block_k):
        raise ValueError(f"{what}: parts={parts}, block_k={block_k}; allowed: parts * block_k dividing K={k}")
    if block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"{what}: block_n={block_n}, block_k={block_k}; allowed: powers of two")
    if parts > 1 and epilogue:
        raise ValueError(f"{what}: parts={parts} with {', '.join(epilogue)}; allowed: parts=1 with an epilogue")
    return rows, n, k


def _epilogue(gated, bias, add_to):
    return [name for name, on in (("gated", gated), ("bias", bias is not None), ("add_to", add_to is not None)) if on]


def skinny_linear_reference(x, weight, *, parts=1, block_n=64, block_k=128, gated=False, bias=None,
                            out_dtype=None, add_to=None, alpha=1.0):
    rows, n, k = check_rows_and_blocks(x, weight, parts, block_n, block_k, _epilogue(gated, bias, add_to))
    xs = x.reshape(rows, k).float().chunk(parts, dim=1)
    ws = weight.float().chunk(parts, dim=1)
    products = torch.stack([a @ w.t() for a, w in zip(xs, ws)]).reshape(parts, *x.shape[:-1], n)
    if parts > 1:
        return Partials(products)
    out = products[0]
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.gelu(gate, approximate="tanh") * up
    if bias is not None:
        out = out + bias.float()
    if add_to is not None:
        return add_to.add_(out, alpha=alpha)
    return out.to(out_dtype or x.dtype)


if triton is not None:

    @triton.jit
    def slice_products(
        X, W, rm, rn, rows, n_cols, k_dim, k_start, k_len, second_offset,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SECOND: tl.constexpr,
        F32: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """float32 x[rm, k_start:k_start + k_len] @ W[rn, same].T ([BLOCK_M, BLOCK_N]) and, with
        SECOND, the same product for weight rows rn + second_offset (else zeros)."""
        rk = k_start + tl.arange(0, BLOCK_K)
        x_ptrs = X + rm[:, None] * k_dim + rk[None, :]
        w_ptrs = W + rn[None, :] * k_dim + rk[:, None]  # [BLOCK_K, BLOCK_N] view of weight rows
        row_mask = rm[:, None] < rows
        col_mask = rn[None, :] < n_cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_len, BLOCK_K):
            a = tl.load(x_ptrs, mask=row_mask, other=0.0)
            b = tl.load(w_ptrs, mask=col_mask, other=0.0).to(X.dtype.element_ty)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            if F32:
                acc += tl.dot(a, b, input_precision="tf32x3")
            else:
                acc += tl.dot(a, b)
            if SECOND:
                b2 = tl.load(w_ptrs + second_offset * k_dim, mask=col_mask, other=0.0).to(X.dtype.element_ty)
                if UPCAST:
                    b2 = b2.to(tl.float32)
                acc2 += tl.dot(a, b2)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        return acc, acc2

    @triton.jit
    def _skinny_gemm_kernel(
        X, W, OUT, BIAS, rows, n_cols, k_dim, k_per_part, gate_offset, alpha,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
        GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_TO: tl.constexpr, F32: tl.constexpr,
        UPCAST: tl.constexpr, PDL: tl.constexpr,
    ):
        after_previous_kernel(PDL)
        part = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc, up = slice_products(  # with GATED the up rows sit gate_offset rows below the gate rows
            X, W, rm, rn, rows, n_cols, k_dim, part * k_per_part, k_per_part, gate_offset,
            BLOCK_M, BLOCK_N, BLOCK_K, GATED, F32, UPCAST,
        )
        row_mask = rm[:, None] < rows
        col_mask = rn[None, :] < n_cols
        mask = row_mask & col_mask
        out_ptrs = OUT + part * rows * n_cols + rm[:, None] * n_cols + rn[None, :]
        if PARTIAL:
            tl.store(out_ptrs, acc, mask=mask)
        else:
            if GATED:
                acc = gelu_tanh(acc) * up
            if HAS_BIAS:
                acc += tl.load(BIAS + rn, mask=rn < n_cols, other=0.0).to(tl.float32)[None, :]
            if ADD_TO:
                acc = tl.load(out_ptrs, mask=mask, other=0.0) + alpha * acc
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


def skinny_linear(x, weight, *, parts=1, block_n=64, block_k=128, gated=False, bias=None, out_dtype=None,
                  add_to=None, alpha=1.0, pdl=True):
    """x [..., K] @ weight [N, K].T for at most MAX_ROWS rows: [..., N] (gated: N / 2) in out_dtype
    (default x's), or add_to updated; parts > 1: Partials."""
    if not runs_triton(x):
        return skinny_linear_reference(x, weight, parts=parts, block_n=block_n, block_k=block_k, gated=gated,
                                       bias=bias, out_dtype=out_dtype, add_to=add_to, alpha=alpha)
    rows, n, k = check_rows_and_blocks(x, weight, parts, block_n, block_k, _epilogue(gated, bias, add_to))
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("skinny_linear: x and weight must be contiguous")
    if x.dtype != weight.dtype:
        raise ValueError(f"skinny_linear: x {x.dtype}, weight {weight.dtype}; allowed: one dtype")
    width = n // 2 if gated else n
    if gated and n % 2:
        raise ValueError(f"skinny_linear: gated with N={n}; allowed: even N ([gate; up])")
    if add_to is not None:
        if tuple(add_to.shape) != (*x.shape[:-1], width) or add_to.dtype != torch.float32 or not add_to.is_contiguous():
            raise ValueError(f"skinny_linear: add_to {tuple(add_to.shape)} {add_to.dtype}; "
                             f"allowed: contiguous float32 {(*x.shape[:-1], width)}")
        out = add_to
    elif parts == 1:
        out = torch.empty((*x.shape[:-1], width), dtype=out_dtype or x.dtype, device=x.device)
    else:
        out = torch.empty((parts, *x.shape[:-1], n), dtype=torch.float32, device=x.device)
    pdl = uses_pdl(x, pdl)
    _skinny_gemm_kernel[(triton.cdiv(width, block_n), parts)](
        x, weight, out, bias if bias is not None else weight, rows, width, k,
        k // parts, width, float(alpha), BLOCK_M=max(16, block_size(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        PARTIAL=parts > 1, GATED=gated, HAS_BIAS=bias is not None, ADD_TO=add_to is not None,
        F32=x.dtype == torch.float32, UPCAST=DOT_UPCAST, PDL=pdl, launch_pdl=pdl, num_warps=4,
        num_stages=STAGES)
    return out if parts == 1 else Partials(out)
