"""Which Pi0.5 layouts the fast kernels cover: each check returns None, or why not (the exact path runs)."""

from __future__ import annotations

import torch

GELU_TANH = ("gelu_pytorch_tanh",)  # the activations torch's tanh GELU (and cuBLASLt's epilogue) computes


def expert(core):
    return core.paligemma_with_expert.gemma_expert.model


def adaptive_norms(expert_model) -> list:
    """Every adaRMS norm in the order the time table stores them: per layer input, post; final."""
    norms = [norm for layer in expert_model.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    return norms + [expert_model.norm]


def prefix_language_model(core):
    paligemma = core.paligemma_with_expert.paligemma
    return None if paligemma is None else paligemma.model.language_model


def vision_encoder(core):
    paligemma = core.paligemma_with_expert.paligemma
    tower = None if paligemma is None else paligemma.model.vision_tower
    return None if paligemma is None else getattr(tower, "vision_model", tower).encoder


def visible_first(pad_masks):
    """[B, P] row order with each batch row's visible positions first (in order), hidden last."""
    return torch.argsort((~pad_masks).to(torch.int8), dim=1, stable=True)


def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def quantized(module) -> bool:
    """A quantized GEMM (0.5.23's ModelOpt FP8 projections: float8 weights, a quant method)."""
    method, weight = getattr(module, "quant_method", None), getattr(module, "weight", None)
    return (method is not None and type(method).__name__ != "UnquantizedLinearMethod") or (
        weight is not None and weight.element_size() == 1)


def plain_weight(module, dtype, *, bias_ok=False):
    """(weight, bias) when `module` is a plain unquantized GEMM in `dtype` (a bias only with bias_ok), else None."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if quantized(module) or weight is None or weight.dtype != dtype or weight.dim() != 2 or not weight.is_contiguous():
        return None
    if bias is not None and (not bias_ok or bias.dtype != dtype or not bias.is_contiguous()):
        return None
    return weight, bias


def _stack_unsupported(model, what: str):
    """What keeps a Gemma layer stack off the fast kernels, or None."""
    if getattr(model, "layerwise_cpu_offload_enabled", False):
        return f"layerwise CPU offload of the {what}"
    if not model.layers:
        return f"{what} without layers"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "qkv_proj", None) is None or getattr(mlp, "gate_up_proj", None) is None:
            return "unpacked q/k/v or gate/up projections (patch pi05_merged_linear is off)"
        if attn.tensor_parallel or mlp.tensor_parallel:
            return f"tensor-parallel {what}"  # the layers take the model's setting
        if any(quantized(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return f"FP8-quantized {what} projections (a ModelOpt checkpoint)"
    return None


def denoise_unsupported(core):
    if getattr(core, "action_in_proj", None) is None or core.paligemma_with_expert.gemma_expert is None:
        return "no action expert on this rank"
    model = expert(core)
    if reason := _stack_unsupported(model, "action expert"):
        return reason
    if any(getattr(layer.self_attn, "sp_attn", None) is not None for layer in model.layers):
        return "Ulysses sequence-parallel action attention"
    if any(norm.dense is None for norm in adaptive_norms(model)):
        return "action expert without adaRMS conditioning"
    if quantized(core.action_in_proj) or quantized(core.action_out_proj):
        return "FP8-quantized action heads (a ModelOpt checkpoint)"
    return None


def prefix_unsupported(core):
    model = prefix_language_model(core)
    if model is None:
        return "no prefix model on this rank"
    if reason := _stack_unsupported(model, "prefix"):
        return reason
    if any(layer.input_layernorm.dense is not None or layer.post_attention_layernorm.dense is not None
           for layer in model.layers):
        return "adaRMS-conditioned prefix layers"
    return None


def vision_unsupported(core):
    encoder = vision_encoder(core)
    if encoder is None:
        return "no vision tower on this rank"
    if getattr(core.config, "offload_prefix_image_encoder_after_embed", False):
        return "the vision tower is offloaded after each use"
    if not getattr(encoder, "layers", None):
        return "vision tower without layers"
    for layer in encoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(attn, "q_proj", None) is None:  # 0.5.18+: srt's SigLIP (VisionAttention, packed q/k/v)
            return "vision attention without separate q/k/v projections (srt's SigLIP tower)"
        modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, mlp.fc1, mlp.fc2)
        if any(plain_weight(m, attn.q_proj.weight.dtype, bias_ok=True) is None or m.bias is None for m in modules):
            return "vision projections that are not plain biased GEMMs of one dtype"
        width = attn.num_heads * attn.head_dim  # the packed q/k/v splits into three of these
        if any(p.weight.shape != (width, width) for p in (attn.q_proj, attn.k_proj, attn.v_proj)):
            return "vision q/k/v projections that are not square over the attention width"
        if getattr(attn, "attn", None) is None:
            return "vision attention that is not the native multi-head one (patch_siglip_vision_attention_to_native)"
        activation = getattr(getattr(mlp, "config", None), "hidden_act", None)
        if activation not in GELU_TANH:
            return f"vision activation {activation!r}; allowed: {GELU_TANH}"
        for norm in (layer.layer_norm1, layer.layer_norm2):
            if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is None or norm.bias is None:
                return "vision norms that are not affine LayerNorms"
    return None
