"""sglang 0.5.17's PiGemmaRMSNorm.forward and gated_residual, copied as the reference that
the pi05_fused_norms tests compare with (test_pi05_fused_norms.py pins these copies to the
installed, unpatched 0.5.17 code). Import it into a test module to use it."""

from __future__ import annotations

import torch


def reference_forward(norm, x, cond=None):
    """0.5.17's PiGemmaRMSNorm.forward, with the module passed as `norm`."""
    dtype = x.dtype
    variance = torch.mean(torch.square(x.float()), dim=-1, keepdim=True)
    normed = x * torch.rsqrt(variance + norm.eps)
    if cond is None:
        if norm.dense is not None:
            return normed.type_as(x), None
        normed = normed * (1.0 + norm.weight.float())
        return normed.type_as(x), None
    if norm.dense is None:
        normed = normed * (1.0 + norm.weight.float())
        return normed.type_as(x), None
    modulation = norm.dense(cond.to(dtype=norm.dense.weight.dtype))
    if x.ndim == 3:
        modulation = modulation.unsqueeze(1)
    scale, shift, gate = modulation.chunk(3, dim=-1)
    normed = normed * (1.0 + scale.float()) + shift.float()
    return normed.to(dtype), gate.to(dtype)


def reference_gated_residual(x, y, gate):
    """0.5.17's gated_residual."""
    if x is None and y is None:
        return None
    if x is None or y is None:
        return x if x is not None else y
    if gate is None:
        return x + y
    return x + y * gate
