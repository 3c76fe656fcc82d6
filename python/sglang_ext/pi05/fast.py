"""Pi0.5 denoise loop, prefix layers and SigLIP encoder layers on fused kernels (knob pi05_fast; no
sglang symbol replaced).

Called by the pi05_graphs adapters (sample_actions: the loop; encode_prefix: the prefix layers, and
the vision tower's encoder layers through `fused_vision`, which swaps that encoder instance's forward
while the prefix is built: one request at a time per process, as the graph runners assume). Layouts
it does not cover (`unsupported_reason`, `prefix_unsupported_reason`, `vision_unsupported_reason`) and
a first use that raises take the exact path (docs/how-it-works.md, "Pi0.5").
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# (steps, batch, device, dtype) entries kept per core model; a server uses one.
TIME_TABLE_ENTRIES = 4
# Switch read by each fast prefix (its graphs are keyed by it): the SigLIP encoder layers on one packed
# q/k/v GEMM, residual adds fused into the LayerNorms and gelu in fc1's GEMM epilogue (7 kernels per layer
# instead of 13; the H200: 13.8 against 14.1 ms per request in one bench_pi05 run, docs/gpu-notes.md).
# Off: bench_pi05's graph-fast-exact-vision mode.
FUSED_VISION = True
_TABLE_ATTR = "_ext_pi05_time_conditioning"
_REASON_ATTR = "_ext_pi05_fast_unsupported"
_VERIFIED_ATTR = "_ext_pi05_fast_verified"
_PREFIX_REASON_ATTR = "_ext_pi05_fast_prefix_unsupported"
_PREFIX_VERIFIED_ATTR = "_ext_pi05_fast_prefix_verified"
_VISION_REASON_ATTR = "_ext_pi05_fast_vision_unsupported"
_VISION_VERIFIED_ATTR = "_ext_pi05_fast_vision_verified"


def _expert(core):
    return core.paligemma_with_expert.gemma_expert.model


def _adaptive_norms(expert) -> list:
    """Every adaRMS norm in the order the table stores them: per layer input, post; final."""
    norms = []
    for layer in expert.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    return norms + [expert.norm]


def _cached_reason(core, attr, find, what):
    """None when `find(core)` finds nothing against the fast kernels, else why not (cached per model)."""
    cached = core.__dict__.get(attr)
    if cached is not None:
        return cached or None
    reason = find(core)
    core.__dict__[attr] = reason or ""
    if reason:
        logger.info("Pi05 fast %s not used (%s): the exact path runs", what, reason)
    return reason


def unsupported_reason(core):
    """None when the fast step can run this core model, else why not (cached per model)."""
    return _cached_reason(core, _REASON_ATTR, _find_unsupported, "denoise path")


# path -> (verified attribute, unsupported-reason attribute, name in the logs)
_PATHS = {"denoise": (_VERIFIED_ATTR, _REASON_ATTR, "fast loop"),
          "prefix": (_PREFIX_VERIFIED_ATTR, _PREFIX_REASON_ATTR, "fast prefix"),
          "vision": (_VISION_VERIFIED_ATTR, _VISION_REASON_ATTR, "fused vision layers")}


def verified(core, path: str = "denoise") -> bool:
    """True once the fast `path` ran on this model (its kernels build and run here)."""
    return bool(core.__dict__.get(_PATHS[path][0]))


def first_use(core, path: str, run):
    """`run()` on this model's first use of the fast `path`; a raise disables the path for the model
    (logged, None returned: the exact path runs)."""
    verified_attr, reason_attr, what = _PATHS[path]
    try:
        result = run()
    except Exception as exc:  # noqa: BLE001 - logged, then the exact path runs
        first_line = (str(exc).splitlines() or [""])[0]
        core.__dict__[reason_attr] = reason = f"{what} failed on first use: {type(exc).__name__}: {first_line}"
        logger.warning("Pi05 %s disabled (%s): the exact path runs", what, reason, exc_info=exc)
        return None
    core.__dict__[verified_attr] = True
    return result


def _stack_unsupported(model, what: str, tp_what: str = ""):
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
            return f"tensor-parallel {tp_what or what}"
    return None


def _find_unsupported(core):
    if getattr(core, "action_in_proj", None) is None or core.paligemma_with_expert.gemma_expert is None:
        return "no action expert on this rank"
    expert = _expert(core)
    reason = _stack_unsupported(expert, "action expert")
    if reason:
        return reason
    if any(getattr(layer.self_attn, "sp_attn", None) is not None for layer in expert.layers):
        return "Ulysses sequence-parallel action attention"
    if any(norm.dense is None for norm in _adaptive_norms(expert)):
        return "action expert without adaRMS conditioning"
    return None


# --- 1. Time conditioning table ---


def time_conditioning(core, num_steps: int, batch_size: int, device) -> torch.Tensor:
    """[steps, norms, 3 (scale, shift, gate), batch, width] float32, cached on `core`, built with
    the model's own layers (gate rounded to the activation dtype first, as the exact path does)."""
    expert = _expert(core)
    dtype = expert.layers[0].self_attn.projection_dtype
    key = (int(num_steps), int(batch_size), str(torch.device(device)), str(dtype))
    tables = core.__dict__.setdefault(_TABLE_ATTR, OrderedDict())
    table = tables.get(key)
    if table is not None:
        tables.move_to_end(key)
        return table
    table = _build_time_conditioning(core, expert, num_steps, batch_size, torch.device(device), dtype)
    tables[key] = table
    while len(tables) > TIME_TABLE_ENTRIES:
        tables.popitem(last=False)
    return table


def _build_time_conditioning(core, expert, num_steps, batch_size, device, dtype):
    timesteps = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float32, device=device)
    steps = timesteps.repeat_interleave(batch_size)
    no_actions = torch.zeros(steps.shape[0], 1, core.config.action_dim, dtype=torch.float32, device=device)
    norms = _adaptive_norms(expert)
    width = norms[0].dim
    table = torch.empty(num_steps, len(norms), 3, batch_size, width, dtype=torch.float32, device=device)
    with torch.no_grad():
        _, adarms_cond = core.embed_suffix(no_actions, steps)
        for index, norm in enumerate(norms):
            modulation = norm.dense(adarms_cond.to(dtype=norm.dense.weight.dtype))
            scale, shift, gate = modulation.chunk(3, dim=-1)
            for slot, value in enumerate((scale.float(), shift.float(), gate.to(dtype).float())):
                table[:, index, slot] = value.reshape(num_steps, batch_size, width)
    return table


def reset_time_conditioning(core) -> None:
    """Drop the cached tables (with the action graphs, or after new weights)."""
    core.__dict__.pop(_TABLE_ATTR, None)


# --- 2. + 3. The denoise loop ---


def _request_layout(core, expert, prefix_context, state, full_attention, action_position_offset, dtype):
    """(cos_sin, kv, kv_start, used): cos/sin of the action positions and the K/V buffers. Full
    prefix: rows [prefix | actions], used None. Masked prefix (it hides key rows only): rows
    [actions | visible | hidden], attention reads the first `used[b]` rows, no mask."""
    batch, seq = state.shape[:2]
    prefix_masks = prefix_context.prefix_pad_masks
    prefix_len = prefix_masks.shape[1]
    positions = (prefix_masks.sum(dim=-1, keepdim=True) + action_position_offset
                 + torch.arange(seq, device=state.device)[None, :])
    rotary = expert.rotary_emb
    rotary._ensure_cache(state)
    cos_sin = rotary.rope.cos_sin_cache.index_select(0, positions.reshape(-1))

    attn = expert.layers[0].self_attn
    kv = torch.empty(len(expert.layers), 2, batch, prefix_len + seq, attn.num_key_value_heads, attn.head_dim,
                     dtype=dtype, device=state.device)
    if full_attention:
        kv_start, used, order = prefix_len, None, None
    else:
        kv_start = 0
        used = (prefix_masks.sum(dim=-1) + seq).to(torch.int32)
        order = _visible_first(prefix_masks)
    for index, (keys, values, _) in enumerate(prefix_context.past_key_values):
        if index >= len(expert.layers):
            break
        for slot, prefix in enumerate((keys.transpose(1, 2), values.transpose(1, 2))):  # [B, P, KV, D]
            if order is None:
                kv[index, slot, :, :prefix_len].copy_(prefix)
            else:
                gather = order[:, :, None, None].expand(-1, -1, *prefix.shape[2:])
                kv[index, slot, :, seq:].copy_(torch.gather(prefix, 1, gather))
    return cos_sin, kv, kv_start, used


def _visible_first(pad_masks):
    """[B, P] row order with each batch row's visible positions first (in order), hidden last."""
    return torch.argsort((~pad_masks).to(torch.int8), dim=1, stable=True)


def _one_head_sdpa(q, keys, values, scale):
    """Unmasked attention over one K/V head as SDPA of one head of S * H queries (its flash kernel;
    the GQA form would take the math path)."""
    batch, seq, heads, head_dim = q.shape
    out = F.scaled_dot_product_attention(q.view(batch, 1, seq * heads, head_dim), keys.view(batch, 1, -1, head_dim),
                                         values.view(batch, 1, -1, head_dim), scale=scale)
    return out.view(batch, seq, heads, head_dim)


class _Projections(NamedTuple):
    """One expert layer's plan per GEMM: (weight, parts, block_n, block_k); qkv: (weight, block_n, block_k).
    With FP8 weights (knob pi05_fp8_expert) o, gate_up and down hold float8_e4m3fn weights, their row
    scales in `scales` by name."""

    qkv: tuple
    o: tuple
    gate_up: tuple  # gated: gelu-and-mul in the GEMM's epilogue
    down: tuple
    scales: dict


def _plain_weight(module, dtype, *, bias_ok=False):
    """(weight, bias) when `module` is a plain unquantized GEMM in `dtype` (a bias only with bias_ok), else None."""
    method = getattr(module, "quant_method", None)
    if method is not None and type(method).__name__ != "UnquantizedLinearMethod":
        return None
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is None or weight.dtype != dtype or weight.dim() != 2 or not weight.is_contiguous():
        return None
    if bias is not None and (not bias_ok or bias.dtype != dtype or not bias.is_contiguous()):
        return None
    return weight, bias


_MAX_PARTS = 8  # partial products cost their consumer a read each


def _skinny_plan(weight, sms, *, splittable=True, gated=False):
    """(weight, parts, block_n, block_k) for skinny_linear, or None (no power-of-two K block >= 16):
    the most programs that fit one wave (docs/gpu-notes.md), then the fewest parts."""
    n, k = weight.shape
    width = n // 2 if gated else n
    block_k = _block_k(k)
    if block_k < 16:
        return None
    best = None
    for block_n in (32, 64):
        parts = 1
        while (splittable and parts < _MAX_PARTS and k % (parts * 2 * block_k) == 0
               and k // (parts * 2) >= 2 * block_k and -(-width // block_n) * parts * 2 <= sms):
            parts *= 2
        programs = -(-width // block_n) * parts
        score = (programs <= sms, programs if programs <= sms else -programs, -parts)
        if best is None or score > best[0]:
            best = (score, (weight, parts, block_n, block_k))
    return best[1]


def _rope_plan(weight, head_dim, sms):
    """(weight, block_n, block_k) for linear_rope_qkv, or None: the narrowest column-pair block
    (most programs) that fits one wave, else the widest that divides head_dim / 2."""
    block_k = _block_k(weight.shape[1])
    fitting = [b for b in (16, 32, 64) if (head_dim // 2) % b == 0]
    if block_k < 16 or not fitting:
        return None
    one_wave = [b for b in fitting if weight.shape[0] // 2 // b <= sms]
    return weight, (one_wave or fitting[::-1])[0], block_k


def _skinny_serves(state) -> bool:
    """skinny_linear can take the action rows of `state` ([B, S, ...]): Triton here, few rows."""
    from sglang_ext.kernels import runs_triton
    from sglang_ext.kernels.skinny_gemm import MAX_ROWS

    return runs_triton(state) and state.shape[0] * state.shape[1] <= MAX_ROWS


def fp8_rows(weight):
    """`weight` as float8_e4m3fn with a float32 scale per row, quantized once (kept on the parameter)."""
    from sglang_ext.kernels import quantize_rows_fp8

    cached = getattr(weight, "_ext_fp8_rows", None)
    if cached is None:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():  # the copies would live in the graph
            raise RuntimeError("pi05_fp8_expert: weights not quantized before the capture (prepare_fp8)")
        cached = weight._ext_fp8_rows = quantize_rows_fp8(weight)
    return cached


def _fp8_candidates(core):
    for layer in _expert(core).layers:
        for module in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            plain = _plain_weight(module, layer.self_attn.projection_dtype)
            if plain is not None and plain[1] is None:
                yield plain[0]


def prepare_fp8(core) -> None:
    """Quantize the expert's plain o, gate-up and down weights once, outside any capture."""
    if not core.__dict__.get("_ext_fp8_prepared"):
        for weight in _fp8_candidates(core):
            fp8_rows(weight)
        core.__dict__["_ext_fp8_prepared"] = True


def drop_fp8(core) -> None:
    """Drop the FP8 copies (with the action graphs, or after new weights: the next use quantizes again)."""
    if core.__dict__.pop("_ext_fp8_prepared", None):
        for weight in _fp8_candidates(core):
            weight.__dict__.pop("_ext_fp8_rows", None)


def _expert_projections(expert, state, dtype, fp8=False):
    """Per layer _Projections, or None (not plain bias-free GEMMs, too many rows, no Triton). fp8: the
    o, gate-up and down weights in FP8 with row scales (half their bytes per step)."""
    if not _skinny_serves(state):
        return None
    sms = _sm_count(state.device)
    plans = []
    for layer in expert.layers:
        attn, mlp = layer.self_attn, layer.mlp
        modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        plain = [_plain_weight(m, dtype) for m in modules]
        if any(p is None or p[1] is not None for p in plain):
            return None
        qkv, o, gate_up, down = (p[0] for p in plain)
        scales = {}
        if fp8:
            (o, scales["o"]), (gate_up, scales["gate_up"]), (down, scales["down"]) = map(fp8_rows, (o, gate_up, down))
        plan = _Projections(_rope_plan(qkv, attn.head_dim, sms), _skinny_plan(o, sms),
                            _skinny_plan(gate_up, sms, splittable=False, gated=True), _skinny_plan(down, sms), scales)
        if None in plan:
            return None
        plans.append(plan)
    return plans


def _action_projections(core, state):
    """(weight, bias, block_k) of action_in_proj and of action_out_proj when skinny_linear can take
    both (plain float32 GEMMs), else None."""
    if not _skinny_serves(state):
        return None
    pair = []
    for module in (core.action_in_proj, core.action_out_proj):
        plain = _plain_weight(module, torch.float32, bias_ok=True)
        if plain is None or _block_k(plain[0].shape[1]) < 16:
            return None
        pair.append((*plain, _block_k(plain[0].shape[1])))
    return tuple(pair)


def _block_k(k: int) -> int:
    """The widest power-of-two K block (at most 128) that divides K."""
    return min(128, k & -k)


def _sm_count(device) -> int:
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


# --- The prefix language model's layers (Gemma RMSNorm, no conditioning) ---


def _prefix_language_model(core):
    paligemma = core.paligemma_with_expert.paligemma
    return None if paligemma is None else paligemma.model.language_model


def prefix_unsupported_reason(core):
    """None when the prefix layers can run on the fast kernels, else why not (cached)."""
    return _cached_reason(core, _PREFIX_REASON_ATTR, _find_prefix_unsupported, "prefix layers")


def _find_prefix_unsupported(core):
    model = _prefix_language_model(core)
    if model is None:
        return "no prefix model on this rank"
    if model.tensor_parallel:
        return "tensor-parallel prefix"
    reason = _stack_unsupported(model, "prefix", "prefix layers")
    if reason:
        return reason
    if any(layer.input_layernorm.dense is not None or layer.post_attention_layernorm.dense is not None
           for layer in model.layers):
        return "adaRMS-conditioned prefix layers"
    return None


def encode_prefix_layers(core, inputs_embeds, attention_mask, position_ids, pad_masks):
    """The prefix K/V (VLADensePrefixCache), or None (the exact path) after a first use that raised.
    A mask is pad_masks[i] & pad_masks[j], so attention reads just the visible keys, without it
    (padded rows then differ from the exact path's; nothing reads them)."""
    def run():
        return _prefix_layers(core, inputs_embeds, attention_mask, position_ids, pad_masks)

    return run() if verified(core, "prefix") else first_use(core, "prefix", run)


def _prefix_layers(core, inputs_embeds, attention_mask, position_ids, pad_masks):
    from sglang.multimodal_gen.runtime.models.vlas.pi05_core import linear_forward
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum
    from sglang.multimodal_gen.runtime.vla.prefix_cache import VLADensePrefixCache

    from sglang_ext.kernels import ada_rms_norm, first_rows_attention, gelu_tanh_and_mul, rope_qkv
    from sglang_ext.kernels.attention import key_splits

    model = _prefix_language_model(core)
    layers = model.layers
    attn0 = layers[0].self_attn
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_key_value_heads, attn0.head_dim
    dtype = attn0.projection_dtype
    hidden = inputs_embeds.to(dtype)
    hidden = hidden.clone() if hidden is inputs_embeds else hidden.contiguous()  # updated in place
    batch, seq = hidden.shape[:2]
    with torch.no_grad():
        model.rotary_emb._ensure_cache(hidden)
        cos_sin = model.rotary_emb.rope.cos_sin_cache.index_select(0, position_ids.reshape(-1))
        visible = None  # masked: (used, key_rows, splits), the visible rows first
        if attention_mask is not None:
            if pad_masks is None:
                raise ValueError("encode_prefix_layers: attention_mask without pad_masks; allowed: both or neither")
            visible = (pad_masks.sum(dim=-1).clamp_min(1).to(torch.int32), _visible_first(pad_masks).to(torch.int32),
                       key_splits(batch, seq, heads, kv_heads, seq, _sm_count(hidden.device)))
        sdpa_full = kv_heads == 1 and getattr(attn0.attn, "backend", None) == AttentionBackendEnum.TORCH_SDPA
        q = torch.empty(batch, seq, heads, head_dim, dtype=dtype, device=hidden.device)
        cache = []
        normed = ada_rms_norm(hidden, layers[0].input_layernorm.weight, eps=layers[0].input_layernorm.eps)
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            keys = torch.empty(batch, seq, kv_heads, head_dim, dtype=dtype, device=hidden.device)
            values = torch.empty_like(keys)
            rope_qkv(linear_forward(attn.qkv_proj, normed), cos_sin, q, keys, values, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, kv_start=0)
            cache.append((keys.transpose(1, 2), values.transpose(1, 2), None))
            if index == len(layers) - 1:
                break  # the prefix returns K/V only: the last layer's output and the final norm feed nothing
            if visible is not None:
                used, key_rows, splits = visible
                out = first_rows_attention(q, keys, values, used, scale=attn.scaling, splits=splits, key_rows=key_rows)
            elif sdpa_full:
                out = _one_head_sdpa(q, keys, values, attn.scaling)
            else:
                out = attn.attn(q, keys, values)
            out = linear_forward(attn.o_proj, out.reshape(batch, seq, heads * head_dim))
            post = layer.post_attention_layernorm
            normed = ada_rms_norm(hidden, post.weight, eps=post.eps, add=out)
            mlp = layer.mlp
            out = linear_forward(mlp.down_proj, gelu_tanh_and_mul(linear_forward(mlp.gate_up_proj, normed)))
            following = layers[index + 1].input_layernorm
            normed = ada_rms_norm(hidden, following.weight, eps=following.eps, add=out)
    return VLADensePrefixCache(tuple(cache))


# --- The prefix's vision tower (SigLIP encoder layers; FUSED_VISION) ---

_GELU_TANH = ("gelu_pytorch_tanh",)  # the activations torch's tanh GELU (and cuBLASLt's epilogue) computes


def _vision_encoder(core):
    paligemma = core.paligemma_with_expert.paligemma
    if paligemma is None:
        return None
    tower = paligemma.model.vision_tower
    return getattr(tower, "vision_model", tower).encoder


def vision_unsupported_reason(core):
    """None when the SigLIP encoder layers can run fused, else why not (cached)."""
    return _cached_reason(core, _VISION_REASON_ATTR, _find_vision_unsupported, "vision layers")


def _find_vision_unsupported(core):
    encoder = _vision_encoder(core)
    if encoder is None:
        return "no vision tower on this rank"
    if getattr(core.config, "offload_prefix_image_encoder_after_embed", False):
        return "the vision tower is offloaded after each use"
    if not getattr(encoder, "layers", None):
        return "vision tower without layers"
    for layer in encoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        dtype = attn.q_proj.weight.dtype
        modules = (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj, mlp.fc1, mlp.fc2)
        if any(_plain_weight(m, dtype, bias_ok=True) is None or m.bias is None for m in modules):
            return "vision projections that are not plain biased GEMMs of one dtype"
        width = attn.num_heads * attn.head_dim  # the packed q/k/v splits into three of these
        if any(p.weight.shape != (width, width) for p in (attn.q_proj, attn.k_proj, attn.v_proj)):
            return "vision q/k/v projections that are not square over the attention width"
        if getattr(attn, "attn", None) is None:
            return "vision attention that is not the native multi-head one (patch_siglip_vision_attention_to_native)"
        activation = getattr(getattr(mlp, "config", None), "hidden_act", None)
        if activation not in _GELU_TANH:
            return f"vision activation {activation!r}; allowed: {_GELU_TANH}"
        for norm in (layer.layer_norm1, layer.layer_norm2):
            if not isinstance(norm, torch.nn.LayerNorm) or norm.weight is None or norm.bias is None:
                return "vision norms that are not affine LayerNorms"
    return None


def _packed_qkv(attn):
    """(weight, bias) of q, k and v packed into one projection, or None inside a capture before packing.
    Packed once, outside any capture: the three projections' parameters become views of it (no second
    copy of the weights; loaders that copy into them keep it current). Checked per call: a parameter
    replaced since (moved, reloaded by assignment) has it packed again."""
    packed = _current_packing(attn)
    if packed is not None:
        return packed
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    if attn.q_proj.weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    with torch.inference_mode(False), torch.no_grad():  # parameters stay normal tensors (loaders write them)
        packed = tuple(torch.cat([getattr(p, name).data for p in projections]) for name in ("weight", "bias"))
        start = 0
        for projection in projections:
            rows = projection.weight.shape[0]
            projection.weight.data, projection.bias.data = (t[start:start + rows] for t in packed)
            start += rows
    attn.__dict__["_ext_packed_qkv"] = packed
    return packed


def _current_packing(attn):
    """The layer's packed (weight, bias) while q, k and v are still views of it, else None."""
    packed = attn.__dict__.get("_ext_packed_qkv")
    if packed is not None and all(_views(packed, (attn.q_proj, attn.k_proj, attn.v_proj))):
        return packed
    return None


def _views(packed, projections):
    start = 0  # rows; addresses by arithmetic (a slice per check would cost host time every request)
    for projection in projections:
        for name, whole in zip(("weight", "bias"), packed):
            offset = start * whole.stride(0) * whole.element_size()
            yield getattr(projection, name).data_ptr() == whole.data_ptr() + offset
        start += projection.weight.shape[0]


def _linear_gelu_tanh(x, linear):
    """gelu_tanh(x @ W.T + b): on CUDA one cuBLASLt GEMM with the GELU epilogue (tanh form, torch's
    fallback too); elsewhere two ops (the CPU's fused addmm+gelu uses the erf form)."""
    if x.is_cuda:
        return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)
    return F.gelu(F.linear(x, linear.weight, linear.bias), approximate="tanh")


def prepare_vision(core) -> None:
    """Pack every layer's q/k/v before prefix captures, once (again after forget_vision_packing, which a
    reset of the prefix graphs calls); a no-op where the fused layers do not serve. Not per request: the
    check of 27 layers cost 0.4-0.5 ms of host time before each replay on the H200 machine."""
    if core.__dict__.get("_ext_vision_packed") or vision_unsupported_reason(core) is not None:
        return
    for layer in _vision_encoder(core).layers:
        _packed_qkv(layer.self_attn)
    core.__dict__["_ext_vision_packed"] = True


def forget_vision_packing(core) -> None:
    """The next prepare_vision checks (and packs) every layer again (with the prefix graphs, after new
    weights); a packed copy whose projections were replaced since is dropped now (it holds memory)."""
    if not core.__dict__.pop("_ext_vision_packed", None):
        return
    for layer in _vision_encoder(core).layers:
        if _current_packing(layer.self_attn) is None:
            layer.self_attn.__dict__.pop("_ext_packed_qkv", None)


@contextlib.contextmanager
def fused_vision(core, enabled: bool):
    """While open: the SigLIP encoder's forward runs the fused layers (`enabled`, FUSED_VISION and
    supported; a first use that raises restores the exact layers for this model)."""
    encoder = _vision_encoder(core) if enabled and FUSED_VISION else None
    if encoder is None or vision_unsupported_reason(core) is not None:
        yield
        return
    exact = encoder.forward

    def forward(inputs_embeds, attention_mask=None, **kwargs):
        if attention_mask is not None or kwargs:
            return exact(inputs_embeds, attention_mask, **kwargs)

        def run():
            return _vision_layers(encoder, inputs_embeds)

        out = run() if verified(core, "vision") else first_use(core, "vision", run)
        return exact(inputs_embeds) if out is None else out

    previous = encoder.__dict__.get("forward")
    encoder.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del encoder.forward
        else:
            encoder.forward = previous


def _vision_layers(encoder, inputs_embeds):
    """The encoder's output (BaseModelOutput) from its layers on fused kernels: per layer one packed q/k/v
    GEMM, the attention module, out_proj, residual add + LayerNorm, fc1 with gelu in its epilogue, fc2,
    residual add + the next layer's LayerNorm."""
    from transformers.modeling_outputs import BaseModelOutput

    from sglang_ext.kernels import add_layer_norm

    layers = encoder.layers
    hidden = inputs_embeds.clone(memory_format=torch.contiguous_format)  # updated in place
    batch, seq, width = hidden.shape
    norm = layers[0].layer_norm1
    with torch.no_grad():
        normed = add_layer_norm(hidden, norm.weight, norm.bias, eps=norm.eps)
        for index, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            packed = _packed_qkv(attn)
            if packed is None:
                q, k, v = (F.linear(normed, p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            else:
                q, k, v = F.linear(normed, *packed).unflatten(-1, (3, width)).unbind(-2)
            heads = (batch, seq, attn.num_heads, attn.head_dim)
            out = attn.attn(q.reshape(heads), k.reshape(heads), v.reshape(heads))
            out = F.linear(out.reshape(batch, seq, width), attn.out_proj.weight, attn.out_proj.bias)
            norm = layer.layer_norm2
            normed = add_layer_norm(hidden, norm.weight, norm.bias, eps=norm.eps, add=out)
            out = _linear_gelu_tanh(normed.view(-1, width), mlp.fc1)
            out = F.linear(out, mlp.fc2.weight, mlp.fc2.bias).view(batch, seq, width)
            if index + 1 == len(layers):
                hidden.add_(out)
                break
            norm = layers[index + 1].layer_norm1
            normed = add_layer_norm(hidden, norm.weight, norm.bias, eps=norm.eps, add=out)
    return BaseModelOutput(last_hidden_state=hidden)


def denoise(core, prefix_context, state, table, *, dt, full_attention, action_position_offset=0, fp8=False):
    """Every denoise step of one request; `state` (x_t, float32) is updated in place. fp8: the expert's
    o, gate-up and down GEMMs read FP8 weights (knob pi05_fp8_expert)."""
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
    from sglang.multimodal_gen.runtime.models.vlas.pi05_core import linear_forward

    from sglang_ext.kernels import (ada_rms_norm, first_rows_attention, gelu_tanh_and_mul, linear_rope_qkv, rope_qkv,
                                    skinny_linear)
    from sglang_ext.kernels.attention import key_splits

    expert = _expert(core)
    layers = expert.layers
    attn0 = layers[0].self_attn
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_key_value_heads, attn0.head_dim
    dtype = attn0.projection_dtype
    batch, seq = state.shape[:2]
    norms = _adaptive_norms(expert)
    projections = _expert_projections(expert, state, dtype, fp8)
    actions = _action_projections(core, state) if projections is not None else None

    def gemm(index, name, module, x):
        if projections is None:
            out = linear_forward(module, x)
            return gelu_tanh_and_mul(out) if name == "gate_up" else out
        weight, parts, block_n, block_k = getattr(projections[index], name)
        return skinny_linear(x, weight, parts=parts, block_n=block_n, block_k=block_k, gated=name == "gate_up",
                             weight_scale=projections[index].scales.get(name))

    def qkv_rope(index, module, x, keys, values):  # q -> q, k / v -> the K/V buffer's action rows
        shape = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, kv_start=kv_start)
        if projections is None:
            return rope_qkv(linear_forward(module, x), cos_sin, q, keys, values, **shape)
        weight, block_n, block_k = projections[index].qkv
        return linear_rope_qkv(x, weight, cos_sin, q, keys, values, block_n=block_n, block_k=block_k, **shape)

    def action_in(x_t):
        if actions is None:
            return core.action_in_proj(x_t.to(core.action_in_proj.weight.dtype)).to(dtype).contiguous()
        (weight, bias, block_k), _ = actions
        return skinny_linear(x_t, weight, bias=bias, out_dtype=dtype, block_k=block_k)

    def action_out(normed, x_t):  # x_t += dt * velocity
        if actions is None:
            velocity = core.action_out_proj(normed.to(core.action_out_proj.weight.dtype))
            return x_t.add_(velocity.to(torch.float32), alpha=dt)
        _, (weight, bias, block_k) = actions
        return skinny_linear(normed, weight, bias=bias, add_to=x_t, alpha=dt, block_n=16, block_k=block_k)

    with torch.no_grad(), set_forward_context(current_timestep=0, attn_metadata=None):
        cos_sin, kv, kv_start, used = _request_layout(core, expert, prefix_context, state, full_attention,
                                                      action_position_offset, dtype)
        splits = key_splits(batch, seq, heads, kv_heads, kv.shape[3], _sm_count(state.device))
        q = torch.empty(batch, seq, heads, head_dim, dtype=dtype, device=state.device)
        for step in range(table.shape[0]):
            cond = table[step]  # [norms, 3, batch, width]
            hidden = action_in(state)
            normed = ada_rms_norm(hidden, cond[0, 0], cond[0, 1], eps=norms[0].eps)
            for index, layer in enumerate(layers):
                attn = layer.self_attn
                keys, values = kv[index, 0], kv[index, 1]
                qkv_rope(index, attn.qkv_proj, normed, keys, values)
                out = first_rows_attention(q, keys, values, used, scale=attn.scaling, splits=splits)
                out = out.view(batch, seq, heads * head_dim)
                post = 2 * index + 1
                normed = ada_rms_norm(hidden, cond[post, 0], cond[post, 1], eps=norms[post].eps,
                                      add=gemm(index, "o", attn.o_proj, out), gate=cond[post - 1, 2])
                mlp = layer.mlp
                out = gemm(index, "gate_up", mlp.gate_up_proj, normed)
                following = post + 1  # next layer's input norm, or the final norm
                final = following == len(norms) - 1
                # the float32 action_out_proj reads the final norm unrounded
                normed = ada_rms_norm(hidden, cond[following, 0], cond[following, 1], eps=norms[following].eps,
                                      add=gemm(index, "down", mlp.down_proj, out), gate=cond[post, 2],
                                      out_dtype=torch.float32 if final and actions is not None else None)
            action_out(normed, state)
    return state
