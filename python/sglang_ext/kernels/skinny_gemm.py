"""x @ weight.T for a few rows (M <= 128): the weight-read-bound GEMMs of a small-batch step.

Every program reads one [BLOCK_N, K / parts] slice of the weight once, with all rows of x in one
tile, so the launch streams the weight exactly once (cuBLAS stays well below HBM bandwidth here).

parts > 1 splits K: the result is `Partials` (float32 [parts, ..., N], summed in a fixed order by
its consumer: ada_rms_norm's `add`, rope_qkv's `qkv`): no reduce kernel, no atomics. parts == 1
returns [..., N], rounded once, after an optional epilogue:
    gated:  weight is a packed [gate; up] [2I, K]; returns gelu_tanh(gate) * up [..., I]
            (the float32 products, not rounded before the activation)
    bias:   [N] added in float32
    add_to: float32 [..., N] updated in place, add_to += alpha * result (returned)
float32 x and weight multiply as three TF32 products (tf32x3: float32-level accuracy on tensor
cores): the Pi0.5 action in/out projections, which sglang keeps in float32.
FP8 weights (opt-in, `quantize_rows_fp8`): a float8_e4m3fn weight with a float32 scale per row is
read as is (half the bytes), widened to x's dtype for the products (exact), and each product column
multiplied by its row's scale before any epilogue (split-K parts too: the scale is linear).

Norms folded into the GEMMs around them (an experiment, `probe_pi05_kernels.py --layer-only`: no
adaRMS kernel between two GEMMs): `skinny_linear_residual` adds its gated product to the residual
stream, summed by each output tile's last program (a counter per tile, parts in fixed order, as
ada_rms_norm sums them), which also leaves the tile's per-row sums of squares; a `NormedRows` x
makes skinny_linear / linear_rope_qkv normalise the rows as they load them (the norm's float32 math
and rounding; only the sum of squares adds up in another order).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from sglang_ext.kernels.activation import gelu_tanh
from sglang_ext.kernels.backend import (DOT_UPCAST, after_previous_kernel, block_size, runs_triton, tl, triton,
                                        uses_pdl)

MAX_ROWS = 128
# Pipeline stages of the GEMM loops. Rows normalised on load (NORM) keep their float32 tiles in shared
# memory per stage: 4 stages of them needed 311 KB under the H200's triton (227 KB allowed), 2 fit.
STAGES, NORM_STAGES = 4, 2
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_rows_fp8(weight):
    """(float8_e4m3fn weight, float32 scale per row) with weight ~ q * scale[:, None]: each row's
    largest magnitude maps to FP8_MAX (an all-zero row gets scale 1)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).to(FP8).contiguous(), scale.contiguous()


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


class NormedRows(NamedTuple):
    """Rows of x [..., K] as the adaRMS norm hands them on: x / sqrt(mean(x^2) + eps) * (1 + scale) + shift,
    rounded to x's dtype, with mean(x^2) from `sumsq` (float32 [tiles, rows]: per-tile sums of squares,
    added in tile order; what `skinny_linear_residual` returns). scale / shift: C * K elements, row c
    for rows c*G .. c*G+G-1 (as ada_rms_norm's)."""

    x: torch.Tensor
    sumsq: torch.Tensor
    scale: torch.Tensor
    shift: Optional[torch.Tensor]
    eps: float

    def check(self, what):
        """(tiles, group) after the checks a kernel needs (`what`: the caller)."""
        k = self.x.shape[-1]
        rows = self.x.numel() // k
        conds = self.scale.numel() // k
        if self.scale.numel() != conds * k or conds == 0 or rows % conds:
            raise ValueError(f"{what}: NormedRows scale of shape {tuple(self.scale.shape)}; allowed: one row of "
                             f"{k} per group of the {rows} rows")
        if self.shift is not None and self.shift.numel() != conds * k:
            raise ValueError(f"{what}: NormedRows shift has {self.shift.numel()} elements; allowed: {conds * k}")
        if self.sumsq.dim() != 2 or self.sumsq.shape[1] != rows or self.sumsq.dtype != torch.float32:
            raise ValueError(f"{what}: NormedRows sumsq {tuple(self.sumsq.shape)} {self.sumsq.dtype}; allowed: "
                             f"float32 [tiles, {rows}]")
        return self.sumsq.shape[0], rows // conds

    def normed(self) -> torch.Tensor:
        """The normalised rows (torch: the references' input)."""
        _, group = self.check("NormedRows")
        k = self.x.shape[-1]
        total = self.sumsq[0].clone()
        for tile in self.sumsq[1:]:
            total += tile
        denominator = torch.sqrt(total / k + self.eps)[:, None]

        def per_row(t):
            return t.reshape(-1, k).float().repeat_interleave(group, dim=0)

        value = self.x.reshape(-1, k).float() / denominator * (1.0 + per_row(self.scale))
        if self.shift is not None:
            value = value + per_row(self.shift)
        return value.to(self.x.dtype).reshape(self.x.shape)

    def kernel_args(self, what):
        """(sumsq, scale, shift, tiles, group, eps, HAS_SHIFT): a kernel's NORM arguments."""
        tiles, group = self.check(what)
        scale = self.scale.contiguous()
        shift = scale if self.shift is None else self.shift.contiguous()
        return self.sumsq.contiguous(), scale, shift, tiles, group, float(self.eps), self.shift is not None


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
                            out_dtype=None, add_to=None, alpha=1.0, weight_scale=None):
    """torch version of `skinny_linear` (float32 accumulation per part, same epilogue)."""
    if isinstance(x, NormedRows):
        x = x.normed()
    rows, n, k = check_rows_and_blocks(x, weight, parts, block_n, block_k, _epilogue(gated, bias, add_to))
    xs = x.reshape(rows, k).float().chunk(parts, dim=1)
    ws = weight.float().chunk(parts, dim=1)
    products = torch.stack([a @ w.t() for a, w in zip(xs, ws)]).reshape(parts, *x.shape[:-1], n)
    if weight_scale is not None:
        products = products * weight_scale.float()
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
    def norm_denominators(SUMSQ, rm, rows, tiles, k_dim, eps, BLOCK_M: tl.constexpr):
        """sqrt(mean(x^2) + eps) of rows rm from their per-tile sums of squares (added in tile order)."""
        total = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for tile in range(0, tiles):
            total += tl.load(SUMSQ + tile * rows + rm, mask=rm < rows, other=0.0)
        return tl.sqrt(total / k_dim + eps)

    @triton.jit
    def slice_products(
        X, W, rm, rn, rows, n_cols, k_dim, k_start, k_len, second_offset, denominator, SCALE, SHIFT, group,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SECOND: tl.constexpr,
        F32: tl.constexpr, UPCAST: tl.constexpr, NORM: tl.constexpr, HAS_SHIFT: tl.constexpr,
    ):
        """float32 x[rm, k_start:k_start + k_len] @ W[rn, same].T ([BLOCK_M, BLOCK_N]) and, with
        SECOND, the same product for weight rows rn + second_offset (else zeros). NORM: x's rows
        normalised as loaded (NormedRows; `denominator` from norm_denominators)."""
        rk = k_start + tl.arange(0, BLOCK_K)
        x_ptrs = X + rm[:, None] * k_dim + rk[None, :]
        w_ptrs = W + rn[None, :] * k_dim + rk[:, None]  # [BLOCK_K, BLOCK_N] view of weight rows
        row_mask = rm[:, None] < rows
        col_mask = rn[None, :] < n_cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k_len, BLOCK_K):
            a = tl.load(x_ptrs, mask=row_mask, other=0.0)
            if NORM:  # ada_rms_norm's float32 math and rounding
                cond = (rm // group)[:, None] * k_dim + rk[None, :]
                value = a.to(tl.float32) / denominator[:, None]
                value = value * (1.0 + tl.load(SCALE + cond, mask=row_mask, other=0.0).to(tl.float32))
                if HAS_SHIFT:
                    value = value + tl.load(SHIFT + cond, mask=row_mask, other=0.0).to(tl.float32)
                a = value.to(X.dtype.element_ty)
                rk += BLOCK_K
            b = tl.load(w_ptrs, mask=col_mask, other=0.0).to(X.dtype.element_ty)  # FP8 weights: widened
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
        X, W, OUT, BIAS, W_SCALE, SUMSQ, SCALE, SHIFT, RESID, GATE, COUNTERS,
        rows, n_cols, k_dim, k_per_part, gate_offset, alpha, tiles, group, eps,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
        GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_TO: tl.constexpr, F32: tl.constexpr,
        UPCAST: tl.constexpr, SCALED: tl.constexpr, NORM: tl.constexpr, HAS_SHIFT: tl.constexpr,
        REDUCE: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr,
    ):
        after_previous_kernel(PDL)
        part = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        denominator = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if NORM:
            denominator = norm_denominators(SUMSQ, rm, rows, tiles, k_dim, eps, BLOCK_M)
        acc, up = slice_products(  # with GATED the up rows sit gate_offset rows below the gate rows
            X, W, rm, rn, rows, n_cols, k_dim, part * k_per_part, k_per_part, gate_offset, denominator, SCALE, SHIFT,
            group, BLOCK_M, BLOCK_N, BLOCK_K, GATED, F32, UPCAST, NORM, HAS_SHIFT,
        )
        if SCALED:  # FP8 weights: each column times its weight row's scale
            acc *= tl.load(W_SCALE + rn, mask=rn < n_cols, other=0.0)[None, :]
            if GATED:
                up *= tl.load(W_SCALE + gate_offset + rn, mask=rn < n_cols, other=0.0)[None, :]
        row_mask = rm[:, None] < rows
        col_mask = rn[None, :] < n_cols
        mask = row_mask & col_mask
        out_ptrs = OUT + part * rows * n_cols + rm[:, None] * n_cols + rn[None, :]
        if PARTIAL:
            tl.store(out_ptrs, acc, mask=mask)
            if REDUCE:  # the tile's last program: residual += gate * sum(parts); the tile's sums of squares
                tl.debug_barrier()  # every thread's partial stored before the (one-thread) release
                if tl.atomic_add(COUNTERS + tl.program_id(0), 1, sem="acq_rel") == tl.num_programs(1) - 1:
                    tile = rm[:, None] * n_cols + rn[None, :]
                    branch = tl.load(OUT + tile, mask=mask, other=0.0, cache_modifier=".cg")
                    for other in range(1, tl.num_programs(1)):
                        branch += tl.load(OUT + other * rows * n_cols + tile, mask=mask, other=0.0,
                                          cache_modifier=".cg")
                    if HAS_GATE:
                        gate = tl.load(GATE + (rm // group)[:, None] * n_cols + rn[None, :], mask=mask, other=0.0)
                        branch = branch * gate.to(tl.float32)
                    residual = tl.load(RESID + tile, mask=mask, other=0.0).to(tl.float32)
                    stored = (residual + branch).to(RESID.dtype.element_ty)
                    tl.store(RESID + tile, stored, mask=mask)
                    wide = stored.to(tl.float32)
                    tl.store(SUMSQ + tl.program_id(0) * rows + rm, tl.sum(wide * wide, axis=1), mask=rm < rows)
                    tl.atomic_xchg(COUNTERS + tl.program_id(0), 0)  # ready for the next launch
        else:
            if GATED:
                acc = gelu_tanh(acc) * up
            if HAS_BIAS:
                acc += tl.load(BIAS + rn, mask=rn < n_cols, other=0.0).to(tl.float32)[None, :]
            if ADD_TO:
                acc = tl.load(out_ptrs, mask=mask, other=0.0) + alpha * acc
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)


def _check_weight(x, weight, weight_scale, n, what="skinny_linear"):
    """True for FP8 weights (after checking their scales), else False (after checking x's dtype)."""
    scaled = FP8 is not None and weight.dtype == FP8
    if scaled:
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{what}: x {x.dtype} with float8_e4m3fn weights; allowed: bfloat16, float16")
        if (weight_scale is None or weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,)
                or not weight_scale.is_contiguous() or weight_scale.device != x.device):
            got = None if weight_scale is None else tuple(weight_scale.shape)
            raise ValueError(f"{what}: weight_scale {got}; allowed: contiguous float32 [{n}] on x's device "
                             "with float8_e4m3fn weights")
    elif weight_scale is not None:
        raise ValueError(f"{what}: weight_scale with {weight.dtype} weights; allowed: float8_e4m3fn weights")
    elif x.dtype != weight.dtype:
        raise ValueError(f"{what}: x {x.dtype}, weight {weight.dtype}; allowed: one dtype")
    return scaled


def skinny_linear(x, weight, *, parts=1, block_n=64, block_k=128, gated=False, bias=None, out_dtype=None,
                  add_to=None, alpha=1.0, weight_scale=None):
    """x [..., K] @ weight [N, K].T for at most MAX_ROWS rows: [..., N] (gated: N / 2) in out_dtype
    (default x's), or add_to updated; parts > 1: Partials. A float8_e4m3fn weight comes with
    weight_scale (float32 [N]) and a bfloat16 or float16 x. x may be NormedRows (normalised on load)."""
    if not runs_triton(x.x if isinstance(x, NormedRows) else x):
        return skinny_linear_reference(x, weight, parts=parts, block_n=block_n, block_k=block_k, gated=gated,
                                       bias=bias, out_dtype=out_dtype, add_to=add_to, alpha=alpha,
                                       weight_scale=weight_scale)
    norm = x.kernel_args("skinny_linear") if isinstance(x, NormedRows) else None
    x = x.x if norm else x
    rows, n, k = check_rows_and_blocks(x, weight, parts, block_n, block_k, _epilogue(gated, bias, add_to))
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("skinny_linear: x and weight must be contiguous")
    scaled = _check_weight(x, weight, weight_scale, n)
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
    sumsq, scale, shift, tiles, group, eps, has_shift = norm or (out, out, out, 0, 1, 0.0, False)
    pdl = uses_pdl(x)
    _skinny_gemm_kernel[(triton.cdiv(width, block_n), parts)](
        x, weight, out, bias if bias is not None else weight, weight_scale if scaled else weight, sumsq, scale, shift,
        out, out, out, rows, width, k, k // parts, width, float(alpha), tiles, group, eps,
        BLOCK_M=max(16, block_size(rows)), BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=parts > 1, GATED=gated,
        HAS_BIAS=bias is not None, ADD_TO=add_to is not None, F32=x.dtype == torch.float32, UPCAST=DOT_UPCAST,
        SCALED=scaled, NORM=norm is not None, HAS_SHIFT=has_shift, REDUCE=False,
        HAS_GATE=False, PDL=pdl, launch_pdl=pdl, num_warps=4, num_stages=NORM_STAGES if norm else STAGES)
    return out if parts == 1 else Partials(out)


def _residual_sums(residual, block_n):
    """Per-tile sums of squares of the rows of `residual` [..., N], float32 [tiles, rows]."""
    n = residual.shape[-1]
    tiles = -(-n // block_n)
    wide = F.pad(residual.reshape(-1, n).float(), (0, tiles * block_n - n))
    return wide.square().reshape(-1, tiles, block_n).sum(dim=-1).t().contiguous()


def skinny_linear_residual_reference(x, weight, residual, counters, *, gate=None, parts=1, block_n=64, block_k=128,
                                     weight_scale=None):
    """torch version of `skinny_linear_residual`."""
    n = weight.shape[0]
    if tuple(residual.shape) != (*x.shape[:-1], n):
        raise ValueError(f"skinny_linear_residual: residual {tuple(residual.shape)}; allowed: {(*x.shape[:-1], n)}")
    product = skinny_linear_reference(x, weight, parts=parts, block_n=block_n, block_k=block_k,
                                      weight_scale=weight_scale, out_dtype=torch.float32)  # never rounded first
    branch = (product.total() if isinstance(product, Partials) else product.float()).reshape(-1, n)
    if gate is not None:
        conds = gate.numel() // n
        branch = branch * gate.reshape(conds, n).float().repeat_interleave(branch.shape[0] // conds, dim=0)
    rows = residual.view(-1, n)
    rows.copy_((rows.float() + branch).to(residual.dtype))
    return _residual_sums(residual, block_n)


def skinny_linear_residual(x, weight, residual, counters, *, gate=None, parts=1, block_n=64, block_k=128,
                           weight_scale=None):
    """residual [..., N] += gate * (x @ weight.T) in one launch: split-K parts summed in part order by
    each output tile's last program (as ada_rms_norm sums Partials; with parts=1 too the float32
    product, not rounded first), which writes the tile back and its rows' sums of squares. Returns
    those (float32 [tiles, rows]: NormedRows' sumsq). gate: one row of N per group of rows (as
    ada_rms_norm's). counters: int32 zeros, at least one per tile, left at zero (one buffer serves
    every launch on a stream)."""
    if not runs_triton(x):
        return skinny_linear_residual_reference(x, weight, residual, counters, gate=gate, parts=parts, block_n=block_n,
                                                block_k=block_k, weight_scale=weight_scale)
    rows, n, k = check_rows_and_blocks(x, weight, parts, block_n, block_k, what="skinny_linear_residual")
    tiles = triton.cdiv(n, block_n)
    if tuple(residual.shape) != (*x.shape[:-1], n) or not residual.is_contiguous():
        raise ValueError(f"skinny_linear_residual: residual {tuple(residual.shape)}; allowed: contiguous "
                         f"{(*x.shape[:-1], n)}")
    if (counters.dtype != torch.int32 or counters.numel() < tiles or not counters.is_contiguous()
            or counters.device != x.device):
        raise ValueError(f"skinny_linear_residual: counters {counters.dtype} x {counters.numel()}; allowed: "
                         f"contiguous int32 zeros on x's device, at least {tiles}")
    if gate is not None and (gate.numel() == 0 or gate.numel() % n or rows % (gate.numel() // n)):
        raise ValueError(f"skinny_linear_residual: gate of {gate.numel()} elements; allowed: one row of {n} per "
                         f"group of the {rows} rows")
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("skinny_linear_residual: x and weight must be contiguous")
    scaled = _check_weight(x, weight, weight_scale, n, "skinny_linear_residual")
    partials = torch.empty((parts, rows, n), dtype=torch.float32, device=x.device)
    sumsq = torch.empty((tiles, rows), dtype=torch.float32, device=x.device)
    has_gate = gate is not None
    group = rows // (gate.numel() // n) if has_gate else 1
    gate = gate.contiguous() if has_gate else partials
    pdl = uses_pdl(x)
    _skinny_gemm_kernel[(tiles, parts)](
        x, weight, partials, weight, weight_scale if scaled else weight, sumsq, partials, partials, residual, gate,
        counters, rows, n, k, k // parts, n, 1.0, tiles, group, 0.0,
        BLOCK_M=max(16, block_size(rows)), BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=True, GATED=False,
        HAS_BIAS=False, ADD_TO=False, F32=x.dtype == torch.float32, UPCAST=DOT_UPCAST, SCALED=scaled, NORM=False,
        HAS_SHIFT=False, REDUCE=True, HAS_GATE=has_gate, PDL=pdl, launch_pdl=pdl, num_warps=4,
        num_stages=STAGES)
    return sumsq
