"""x @ weight.T for a few rows (M <= 128): the weight-read-bound GEMMs of a small-batch step.

cuBLAS serves M = 50 rows of Pi0.5's action expert at about a third of HBM bandwidth
(~5-7 us per GEMM for 4-17 MB of weight on the H200, plus a split-K reduce kernel for
some shapes). Here every program reads one [BLOCK_N, K / parts] slice of the weight
once, with all rows of x in one tile, so a launch of N / BLOCK_N * parts programs
streams the weight exactly once.

parts > 1 splits K: the result is `Partials` (float32 [parts, ..., N], summed in a fixed
order by whoever consumes it: ada_rms_norm's `add`, rope_qkv's `qkv`, gelu_tanh_and_mul),
so the split costs no reduce kernel and stays deterministic (no atomics). parts == 1
returns [..., N] in x's dtype, rounded once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_ext.kernels.backend import DOT_UPCAST, block_size, runs_triton, tl, triton

MAX_ROWS = 128


class Partials(NamedTuple):
    """Split-K partial products of one GEMM, float32 [parts, ..., N]; their sum is the product."""

    parts: torch.Tensor

    @property
    def shape(self):
        """The product's shape."""
        return self.parts.shape[1:]

    def total(self) -> torch.Tensor:
        """The product in float32 (summed in part order, as the kernels sum it)."""
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        return total


def _check(x, weight, parts, block_n, block_k):
    rows = x.numel() // x.shape[-1]
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"skinny_linear: x width {x.shape[-1]}; allowed: the weight's K={k}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"skinny_linear: {rows} rows; allowed: 1..{MAX_ROWS}")
    if parts < 1 or k % (parts * block_k):
        raise ValueError(f"skinny_linear: parts={parts}, block_k={block_k}; allowed: parts * block_k dividing K={k}")
    if block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"skinny_linear: block_n={block_n}, block_k={block_k}; allowed: powers of two")
    return rows, n, k


def skinny_linear_reference(x, weight, *, parts=1, block_n=64, block_k=128):
    """torch version of `skinny_linear` (float32 accumulation per part)."""
    rows, n, k = _check(x, weight, parts, block_n, block_k)
    xs = x.reshape(rows, k).float().chunk(parts, dim=1)
    ws = weight.float().chunk(parts, dim=1)
    products = torch.stack([a @ w.t() for a, w in zip(xs, ws)]).reshape(parts, *x.shape[:-1], n)
    if parts == 1:
        return products[0].to(x.dtype)
    return Partials(products)


if triton is not None:

    @triton.jit
    def _skinny_gemm_kernel(
        X, W, OUT, rows, n_cols, k_dim, k_per_part,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr, UPCAST: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        part = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = part * k_per_part + tl.arange(0, BLOCK_K)
        x_ptrs = X + rm[:, None] * k_dim + rk[None, :]
        w_ptrs = W + rn[None, :] * k_dim + rk[:, None]  # [BLOCK_K, BLOCK_N] view of weight rows
        row_mask = rm[:, None] < rows
        col_mask = rn[None, :] < n_cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_per_part, BLOCK_K):
            a = tl.load(x_ptrs, mask=row_mask, other=0.0)
            b = tl.load(w_ptrs, mask=col_mask, other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.dot(a, b)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out_ptrs = OUT + part * rows * n_cols + rm[:, None] * n_cols + rn[None, :]
        if PARTIAL:
            tl.store(out_ptrs, acc, mask=row_mask & col_mask)
        else:
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_mask & col_mask)


def skinny_linear(x, weight, *, parts=1, block_n=64, block_k=128, num_stages=4):
    """x [..., K] @ weight [N, K].T for at most MAX_ROWS rows of x.

    parts == 1: [..., N] in x's dtype; parts > 1: Partials (see the module docstring).
    """
    if not runs_triton(x):
        return skinny_linear_reference(x, weight, parts=parts, block_n=block_n, block_k=block_k)
    rows, n, k = _check(x, weight, parts, block_n, block_k)
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("skinny_linear: x and weight must be contiguous")
    if parts == 1:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((parts, *x.shape[:-1], n), dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n), parts)](
        x, weight, out, rows, n, k, k // parts,
        BLOCK_M=max(16, block_size(rows)), BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=parts > 1, UPCAST=DOT_UPCAST,
        num_warps=4, num_stages=num_stages,
    )
    return out if parts == 1 else Partials(out)
