"""PiGemma (adaptive) RMSNorm and gated residual in fewer CUDA kernels, the same float32 math.

Patch: pi05_fused_norms
Targets: sglang.multimodal_gen.runtime.models.vlas.pi05_core:PiGemmaRMSNorm,
sglang.multimodal_gen.runtime.models.vlas.pi05_core:gated_residual
Upstream PR: none (sglang-ext only)
Retire when: upstream PiGemmaRMSNorm uses a fused rms_norm and gated_residual is a single op

Why: 0.5.17's adaRMS forward is about 13 elementwise kernels, each gated residual two; eager Pi0.5 is launch-bound.
How: PiGemmaRMSNorm.forward replaced (F.rms_norm, addcmul); gated_residual (one addcmul) rebound in pi05_core's
globals, where its callers look it up.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = x.dtype
    if cond is None or self.dense is None:  # unmodulated (an adaptive norm without its condition: unweighted too)
        weight = None if self.dense is not None else 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), weight=weight, eps=self.eps).type_as(x), None

    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
    modulation = self.dense(cond.to(dtype=self.dense.weight.dtype))
    if x.ndim == 3:
        modulation = modulation.unsqueeze(1)
    scale, shift, gate = modulation.chunk(3, dim=-1)
    # normed * (1 + scale) + shift in float32; scale/shift are promoted in-kernel
    modulated = torch.addcmul(normed, normed, scale)
    if torch.is_grad_enabled():  # out= does not support autograd
        return (modulated + shift).to(dtype), gate.to(dtype)
    # computed in float32, stored as dtype
    return torch.add(modulated, shift, out=torch.empty_like(modulated, dtype=dtype)), gate.to(dtype)


def _single_op(original):
    @functools.wraps(original)
    def gated_residual(x, y, gate):
        if x is None or y is None or gate is None:
            return original(x, y, gate)
        return torch.addcmul(x, y, gate)  # x + y * gate, rounded once

    return gated_residual


def patch_pi05_core(ctx, module) -> None:
    ctx.setattr(module.PiGemmaRMSNorm, "forward", forward)
    ctx.setattr(module, "gated_residual", _single_op(module.gated_residual))
