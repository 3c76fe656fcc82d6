"""PiGemma (adaptive) RMSNorm and gated residual in fewer CUDA kernels.

Target symbols:
    sglang.multimodal_gen.runtime.models.vlas.pi05_core.PiGemmaRMSNorm.forward
        (relies on __init__'s `eps`, `weight` / `dense` attributes)
    sglang.multimodal_gen.runtime.models.vlas.pi05_core.gated_residual
        (module function; PiGemmaDecoderLayer.forward and compute_layer_complete
        look it up in the module globals at call time, so rebinding it is enough)
sglang versions: 0.5.17 (fingerprint-gated). 0.5.19 has the same code for both
    targets (still unfused upstream).
Upstream PR: none (sglang-ext only).

Why: Pi0.5 eager decoding is launch-bound. 0.5.17's adaRMS forward spells the
norm and the modulation as ~13 elementwise ops (float, square, mean, +eps,
rsqrt, mul, GEMM, float, 1+, mul, float, add, to); it runs twice per action-expert
layer per denoise step (18 layers x 10 steps), plus the final norm, and every
`gated_residual` is two more (mul, add).

How: the same float32 math with fused ops. `F.rms_norm` on `x.float()`
(torch >= 2.8 dispatches `aten::_fused_rms_norm`: one kernel) gives
`x * rsqrt(mean(x^2) + eps)`; the non-conditional weight `1 + w` goes in as the
rms_norm weight. The adaptive path computes `normed * (1 + scale) + shift` as
`addcmul(normed, normed, scale)` then `+ shift`: scale and shift stay in the
GEMM's dtype and are promoted to float32 inside those kernels (no `.float()`
copies, no `1 + scale` tensor). With autograd off (sglang runs Pi0.5 under
`no_grad` / `inference_mode`) the `+ shift` writes straight into an `x.dtype`
output, so the final `.to(dtype)` is not a separate kernel either; with autograd
on (out= does not support it) it is computed out of place. Gate is returned
as before (`gate.to(dtype)`, free when the GEMM already runs in `dtype`).
`gated_residual` becomes `torch.addcmul(x, y, gate)`: one kernel, with the
same broadcasting and type promotion as `x + y * gate`; in bf16 it rounds once
instead of twice (the product is kept in float), so results may differ from
0.5.17 by one bf16 ulp, towards the exact value.

Retire when: upstream PiGemmaRMSNorm uses a fused rms_norm (or a fused
adaRMS kernel) and gated_residual is a single op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def forward(
    self,
    x: torch.Tensor,
    cond: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = x.dtype
    if cond is None or self.dense is None:
        if self.dense is not None:  # adaptive norm called without its condition: plain rms
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
            return normed.type_as(x), None
        normed = F.rms_norm(
            x.float(), (x.shape[-1],), weight=1.0 + self.weight.float(), eps=self.eps
        )
        return normed.type_as(x), None

    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
    modulation = self.dense(cond.to(dtype=self.dense.weight.dtype))
    if x.ndim == 3:
        modulation = modulation.unsqueeze(1)
    scale, shift, gate = modulation.chunk(3, dim=-1)
    # normed * (1 + scale) + shift in float32; scale/shift are promoted in-kernel
    modulated = torch.addcmul(normed, normed, scale)
    if torch.is_grad_enabled():  # out= does not support autograd
        return (modulated + shift).to(dtype), gate.to(dtype)
    out = torch.empty_like(modulated, dtype=dtype)
    torch.add(modulated, shift, out=out)  # computed in float32, stored as dtype
    return out, gate.to(dtype)


def gated_residual(
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    gate: torch.Tensor | None,
) -> torch.Tensor | None:
    if x is None and y is None:
        return None
    if x is None or y is None:
        return x if x is not None else y
    if gate is None:
        return x + y
    return torch.addcmul(x, y, gate)


def patch_pi05_core(ctx, module) -> None:
    """Part for `...models.vlas.pi05_core`: fused PiGemmaRMSNorm.forward and gated_residual."""
    ctx.transplant_method(module.PiGemmaRMSNorm, forward)
    ctx.transplant_function(module, gated_residual)
