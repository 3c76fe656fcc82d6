"""gelu(tanh approximation)(gate) * up of a packed [gate, up] projection, [..., 2 * I] -> [..., I], in one kernel.
Math in float32, one rounding; tanh(u) = 1 - 2 / (1 + exp(2u)) (plain exp: no libdevice needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_ext.kernels.backend import after_previous_kernel, block_size, runs_triton, tl, triton, uses_pdl

_BLOCK = 1024


def _check(x):
    if x.shape[-1] % 2:
        raise ValueError(f"gelu_tanh_and_mul: last dim {x.shape[-1]}; allowed: even sizes ([gate, up])")
    return x.shape[-1] // 2


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    inner = _check(x)
    gate, up = x.float().split(inner, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(x.dtype)


if triton is not None:

    @triton.jit
    def gelu_tanh(gate):
        """gelu (tanh approximation) of float32 `gate` (also skinny_linear's gated epilogue)."""
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * u))
        return 0.5 * gate * (1.0 + tanh)

    @triton.jit
    def _gelu_tanh_and_mul_kernel(X, OUT, n_inner, BLOCK: tl.constexpr, PDL: tl.constexpr):
        after_previous_kernel(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_inner
        gate = tl.load(X + row * 2 * n_inner + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * 2 * n_inner + n_inner + cols, mask=mask, other=0.0).to(tl.float32)
        out = gelu_tanh(gate) * up
        tl.store(OUT + row * n_inner + cols, out.to(OUT.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul(x: torch.Tensor, *, pdl: bool = True) -> torch.Tensor:
    """gelu_tanh(x[..., :I]) * x[..., I:] as a new [..., I] tensor in x's dtype."""
    if not runs_triton(x):
        return gelu_tanh_and_mul_reference(x)
    inner = _check(x)
    x = x.contiguous()
    rows = x.numel() // (2 * inner)
    out = torch.empty((*x.shape[:-1], inner), dtype=x.dtype, device=x.device)
    block, pdl = min(_BLOCK, block_size(inner)), uses_pdl(x, pdl)
    _gelu_tanh_and_mul_kernel[(rows, triton.cdiv(inner, block))](x, out, inner, BLOCK=block, PDL=pdl, launch_pdl=pdl,
                                                                 num_warps=4)
    return out
