"""Non-TP PiGemma attention and MLP on one packed weight each: Q/K/V and gate/up as one GEMM.

Patch: pi05_merged_linear
Targets: sglang.multimodal_gen.runtime.models.vlas.pi05_core:PiGemmaAttention,
sglang.multimodal_gen.runtime.models.vlas.pi05_core:PiGemmaMLP
Upstream PR: sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)
Retire when: the minimum supported sglang has MergedReplicatedLinear (>= 0.5.19)

Why: 0.5.17's non-TP branch runs q/k/v as three GEMMs and gate/up as two plus a torch.cat.
How: after 0.5.17's __init__ one MergedReplicatedLinear replaces them (loaded via its `_FUSED_WEIGHT_MAPPINGS`).
"""

from __future__ import annotations

import functools

from sglang.multimodal_gen.runtime.models.vlas.pi05_core import linear_forward
from sglang_ext.pi05.merged_linear import MergedReplicatedLinear


def _pack(module, packed: str, separate: tuple, input_size: int, output_sizes: list, bias: bool) -> None:
    """`module.<packed>` = one MergedReplicatedLinear for the `separate` projections, which become None."""
    for name in separate:
        delattr(module, name)
        setattr(module, name, None)
    setattr(module, packed, MergedReplicatedLinear(input_size, output_sizes, bias=bias))


def _packed_attention(original):
    @functools.wraps(original)
    def __init__(self, config, layer_idx, *, tensor_parallel=False):
        original(self, config, layer_idx, tensor_parallel=tensor_parallel)
        if not tensor_parallel:
            _pack(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"), config.hidden_size,
                  [self.q_size, self.kv_size, self.kv_size], config.attention_bias)

    return __init__


def _packed_mlp(original):
    @functools.wraps(original)
    def __init__(self, config, *, tensor_parallel=False):
        original(self, config, tensor_parallel=tensor_parallel)
        if not tensor_parallel:
            _pack(self, "gate_up_proj", ("gate_proj", "up_proj"), self.hidden_size, [self.intermediate_size] * 2, False)

    return __init__


def project_qkv(self, hidden_states):
    """(q, k, v) as [batch, heads, tokens, head_dim], split from one GEMM."""
    qkv = linear_forward(self.qkv_proj, hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
    heads = (self.num_heads, self.num_key_value_heads, self.num_key_value_heads)
    return tuple(part.view(*part.shape[:-1], count, self.head_dim).transpose(1, 2) for part, count in zip(qkv, heads))


def mlp_forward(self, x):
    return linear_forward(self.down_proj, self.act_fn(linear_forward(self.gate_up_proj, x)))


def patch_pi05_core(ctx, module) -> None:
    attention, mlp = module.PiGemmaAttention, module.PiGemmaMLP
    ctx.setattr(attention, "__init__", _packed_attention(attention.__dict__["__init__"]))
    ctx.setattr(attention, "project_qkv", project_qkv)
    ctx.setattr(attention, "projection_dtype", property(lambda self: self.qkv_proj.weight.dtype))
    ctx.setattr(mlp, "__init__", _packed_mlp(mlp.__dict__["__init__"]))
    ctx.setattr(mlp, "forward", mlp_forward)
    ctx.setattr(mlp, "projection_dtype", property(lambda self: self.gate_up_proj.weight.dtype))
