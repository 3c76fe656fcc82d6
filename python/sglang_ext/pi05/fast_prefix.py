"""The Pi0.5 prefix on fused kernels: the language model's layers and SigLIP's encoder layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_ext.pi05.fast_support import prefix_language_model, sm_count, visible_first


def prefix_layers(core, inputs_embeds, attention_mask, position_ids, pad_masks, *, pdl=True):
    """The prefix K/V (VLADensePrefixCache) from the language model's layers. Attention reads just the visible keys,
    without a mask (padded rows then differ from the exact path's; nothing reads them)."""
    from sglang.multimodal_gen.runtime.models.vlas.pi05_core import linear_forward
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum
    from sglang.multimodal_gen.runtime.vla.prefix_cache import VLADensePrefixCache

    from sglang_ext.kernels import ada_rms_norm, first_rows_attention, gelu_tanh_and_mul, rope_qkv
    from sglang_ext.kernels.attention import key_splits

    model = prefix_language_model(core)
    layers = model.layers
    attn0 = layers[0].self_attn
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_key_value_heads, attn0.head_dim
    dtype = attn0.projection_dtype
    hidden = inputs_embeds.to(dtype, memory_format=torch.contiguous_format, copy=True)  # updated in place
    batch, seq = hidden.shape[:2]
    with torch.no_grad():
        model.rotary_emb._ensure_cache(hidden)
        cos_sin = model.rotary_emb.rope.cos_sin_cache.index_select(0, position_ids.reshape(-1))
        visible = None  # masked: (used, key_rows, splits), the visible rows first
        if attention_mask is not None:
            if pad_masks is None:
                raise ValueError("encode_prefix_layers: attention_mask without pad_masks; allowed: both or neither")
            visible = (pad_masks.sum(dim=-1).clamp_min(1).to(torch.int32), visible_first(pad_masks).to(torch.int32),
                       key_splits(batch, seq, heads, kv_heads, seq, sm_count(hidden.device)))
        sdpa_full = kv_heads == 1 and getattr(attn0.attn, "backend", None) == AttentionBackendEnum.TORCH_SDPA
        q = torch.empty(batch, seq, heads, head_dim, dtype=dtype, device=hidden.device)
        cache = []
        normed = ada_rms_norm(hidden, layers[0].input_layernorm.weight, eps=layers[0].input_layernorm.eps, pdl=pdl)
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            keys = torch.empty(batch, seq, kv_heads, head_dim, dtype=dtype, device=hidden.device)
            values = torch.empty_like(keys)
            rope_qkv(linear_forward(attn.qkv_proj, normed), cos_sin, q, keys, values, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, kv_start=0, pdl=pdl)
            cache.append((keys.transpose(1, 2), values.transpose(1, 2), None))
            if index == len(layers) - 1:
                break  # the prefix returns K/V only: the last layer's output and the final norm feed nothing
            if visible is not None:
                used, key_rows, splits = visible
                out = first_rows_attention(q, keys, values, used, scale=attn.scaling, splits=splits, key_rows=key_rows,
                                           pdl=pdl)
            elif sdpa_full:  # one K/V head: one-head SDPA of S * H queries runs flash (GQA takes the math path)
                out = F.scaled_dot_product_attention(q.view(batch, 1, -1, head_dim), keys.view(batch, 1, -1, head_dim),
                                                     values.view(batch, 1, -1, head_dim), scale=attn.scaling)
            else:
                out = attn.attn(q, keys, values)
            out = linear_forward(attn.o_proj, out.reshape(batch, seq, heads * head_dim))
            post = layer.post_attention_layernorm
            normed = ada_rms_norm(hidden, post.weight, eps=post.eps, add=out, pdl=pdl)
            mlp = layer.mlp
            out = linear_forward(mlp.down_proj, gelu_tanh_and_mul(linear_forward(mlp.gate_up_proj, normed), pdl=pdl))
            following = layers[index + 1].input_layernorm
            normed = ada_rms_norm(hidden, following.weight, eps=following.eps, add=out, pdl=pdl)
    return VLADensePrefixCache(tuple(cache))


def packed_qkv(packing, attn):
    """(weight, bias) of q, k and v packed into one projection, or None in a capture before packing. The
    projections' parameters become views of it (loaders keep it current); one replaced since is packed again."""
    packed = current_packing(packing, attn)
    if packed is not None or (attn.q_proj.weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return packed  # None in a capture: the packed copy would live in the graph
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    with torch.inference_mode(False), torch.no_grad():  # parameters stay normal tensors (loaders write them)
        packed = tuple(torch.cat([getattr(p, name).data for p in projections]) for name in ("weight", "bias"))
        rows = [p.weight.shape[0] for p in projections]
        for projection, weight, bias in zip(projections, packed[0].split(rows), packed[1].split(rows)):
            projection.weight.data, projection.bias.data = weight, bias
    packing[attn] = packed
    return packed


def current_packing(packing, attn):
    """The layer's packed (weight, bias) while q, k and v are still views of it, else None."""
    packed = packing.get(attn)
    if packed is None:
        return None
    start = 0  # rows; addresses by arithmetic (a slice per check would cost host time every request)
    for projection in (attn.q_proj, attn.k_proj, attn.v_proj):
        for name, whole in zip(("weight", "bias"), packed):
            offset = start * whole.stride(0) * whole.element_size()
            if getattr(projection, name).data_ptr() != whole.data_ptr() + offset:
                return None
        start += projection.weight.shape[0]
    return packed


def _linear_gelu_tanh(x, linear):
    """gelu_tanh(x @ W.T + b): on CUDA one cuBLASLt GEMM with the GELU epilogue (tanh form, torch's
    fallback too); elsewhere two ops (the CPU's fused addmm+gelu uses the erf form)."""
    if x.is_cuda:
        return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, linear.weight, linear.bias), approximate="tanh")


def vision_layers(encoder, inputs_embeds, packing, *, pdl=True):
    """The encoder's output (BaseModelOutput) from its layers on fused kernels (one packed q/k/v GEMM per layer)."""
    from transformers.modeling_outputs import BaseModelOutput

    from sglang_ext.kernels import add_layer_norm

    layers = encoder.layers
    hidden = inputs_embeds.clone(memory_format=torch.contiguous_format)  # updated in place
    batch, seq, width = hidden.shape
    norm = layers[0].layer_norm1
    with torch.no_grad():
        normed = add_layer_norm(hidden, norm.weight, norm.bias, eps=norm.eps, pdl=pdl)
        for index, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            packed = packed_qkv(packing, attn)
            if packed is None:
                q, k, v = (F.linear(normed, p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            else:
                q, k, v = F.linear(normed, *packed).unflatten(-1, (3, width)).unbind(-2)
            heads = (batch, seq, attn.num_heads, attn.head_dim)
            out = attn.attn(q.reshape(heads), k.reshape(heads), v.reshape(heads))
            out = F.linear(out.reshape(batch, seq, width), attn.out_proj.weight, attn.out_proj.bias)
            norm = layer.layer_norm2
            normed = add_layer_norm(hidden, norm.weight, norm.bias, eps=norm.eps, add=out, pdl=pdl)
            out = _linear_gelu_tanh(normed.view(-1, width), mlp.fc1)
            out = F.linear(out, mlp.fc2.weight, mlp.fc2.bias).view(batch, seq, width)
            if index + 1 == len(layers):
                hidden.add_(out)
                break
            norm = layers[index + 1].layer_norm1
            normed = add_layer_norm(hidden, norm.weight, norm.bias, eps=norm.eps, add=out, pdl=pdl)
    return BaseModelOutput(last_hidden_state=hidden)
