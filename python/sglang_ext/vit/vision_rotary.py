"""Vision rotary with ViT graphs on: one Triton kernel, or sglang's compiled kernel in eager calls.

Patch: vit_cuda_graph
Targets: sglang.srt.layers.attention.vision:VisionAttention.forward
Upstream PR: sgl-project/sglang#37043
Retire when: upstream bounds the ViT graph count, frees retired workspaces and returns owned outputs

Why: with ViT graphs on, VisionAttention applies rotary through its unfused eager function (compiling inside a
capture is illegal): a dozen memory-bound kernels per layer where graphs-off runs one compiled kernel.
How: the name VisionAttention calls is wrapped: with knob vit_triton_rotary, CUDA calls run our one-kernel rotary
(rounded as the original) in captures and eager calls alike; else eager calls inside `compiled_rotary()` use
sglang's compiled `apply_rotary_pos_emb`; else the original. Releases: 0.5.17, 0.5.23.
"""

import contextlib

import torch

from sglang_ext import knobs
from sglang_ext.kernels.backend import runs_triton
from sglang_ext.kernels.rotate_half import rotate_half_qk, rotate_half_qk_supports

_eager_depth = [0]  # nesting depth of compiled_rotary()


@contextlib.contextmanager
def compiled_rotary():
    """ViT attention inside this block (the bucket runner's eager calls) may use the compiled rotary."""
    _eager_depth[0] += 1
    try:
        yield
    finally:
        _eager_depth[0] -= 1


def compiled_allowed(q) -> bool:
    """The compiled kernel runs on CUDA tensors outside a capture (sglang compiles it at first use)."""
    return q.is_cuda and not torch.cuda.is_current_stream_capturing()


def patch_vision(ctx, module) -> None:
    capture_safe = module.apply_rotary_pos_emb_native_eager
    one_kernel = knobs.current("vit_triton_rotary")

    def apply_rotary_pos_emb_native_eager(q, k, cos, sin, unsqueeze_dim=1):
        if one_kernel and runs_triton(q) and unsqueeze_dim == 1 and not rotate_half_qk_supports(q, k, cos, sin):
            return rotate_half_qk(q, k, cos, sin, checked=True)
        if _eager_depth[0] and compiled_allowed(q):
            return module.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        return capture_safe(q, k, cos, sin, unsqueeze_dim)

    ctx.setattr(module, "apply_rotary_pos_emb_native_eager", apply_rotary_pos_emb_native_eager)
