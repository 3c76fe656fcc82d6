"""Pi0.5 core on sglang 0.5.19's graph-ready API: capturable prefix, hoisted denoise layout, cached time scaling.

Patch: pi05_graphs
Targets: sglang.multimodal_gen.runtime.models.vlas.pi05_core:create_sinusoidal_pos_embedding,
sglang.multimodal_gen.runtime.models.vlas.pi05_core:Pi05CoreModel.embed_prefix,
sglang.multimodal_gen.runtime.models.vlas.pi05_core:Pi05CoreModel.embed_suffix,
sglang.multimodal_gen.runtime.models.vlas.pi05_core:Pi05CoreModel.encode_prefix,
sglang.multimodal_gen.runtime.models.vlas.pi05_core:Pi05CoreModel.denoise_step
Upstream PR: sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)
Retire when: upstream keys the action-graph K/V refresh on something id()-free and the minimum supported sglang has
vla/cuda_graph.py (>= 0.5.19)

Why: a missing first camera's tokens get position -1 (an out-of-bounds rotary gather; also 0.5.23); 0.5.17's
prefix is not capturable (host-list marks, .item() mask probe) and every denoise step rebuilds its layout.
How: encode_prefix replaced (positions clamped, fast-path prefix layers, no .item() on a hint); 0.5.17 also
gets 0.5.19's embed_prefix, embed_suffix, denoise_step, cached sinusoid scaling and prepare_denoise_layout.
Releases: 0.5.23 (encode_prefix), 0.5.17 (all).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from sglang.multimodal_gen.runtime.models.vlas.pi05_core import (VLADensePrefixCache, make_att_2d_masks,
                                                                 set_forward_context, trim_trailing_padding_tokens)


def _sinusoids(time: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    angles = time.to(torch.float64).outer(scaling)  # the products 0.5.17 forms, bit for bit
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def _with_scaling(original):
    """0.5.19's signature: a precomputed `scaling` skips the per-call frequency computation."""

    @functools.wraps(original)
    def create_sinusoidal_pos_embedding(time, dimension, min_period, max_period, scaling=None):
        if scaling is None or dimension % 2 or time.ndim != 1:
            return original(time, dimension, min_period, max_period)  # and its errors
        return _sinusoids(time, scaling)

    return create_sinusoidal_pos_embedding


def embed_prefix(self, images, image_masks, tokens, token_masks):
    """Image and language embeddings with pad masks; the (all-zero) attention marks are made on the device."""
    towers = self.paligemma_with_expert
    image_embs = towers.embed_images(images)
    language = towers.embed_language_tokens(tokens)
    language = language * math.sqrt(language.shape[-1])  # OpenPI's scale of the language embedding
    pads = [mask[:, None].expand(emb.shape[:2]) for emb, mask in zip(image_embs, image_masks, strict=True)]
    pad_masks = torch.cat([*pads, token_masks], dim=1)
    return torch.cat([*image_embs, language], dim=1), pad_masks, torch.zeros_like(pad_masks)


def embed_suffix(self, noisy_actions, timestep):
    """(action embedding, adaRMS condition); the sinusoid scaling is kept in a non-persistent buffer."""
    width = self.action_in_proj.out_features
    scaling = self._buffers.get("_time_embedding_scaling")
    if scaling is None or scaling.numel() != width // 2 or scaling.device != timestep.device:
        # Each sinusoid's angular frequency, computed exactly as 0.5.17 does in every call.
        low, high = self.config.time_embedding_min_period, self.config.time_embedding_max_period
        period = low * (high / low) ** torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=timestep.device)
        scaling = 1.0 / period * 2 * math.pi
        self.register_buffer("_time_embedding_scaling", scaling, persistent=False)
    time_emb = _sinusoids(timestep, scaling)
    action_emb = self.action_in_proj(noisy_actions.to(dtype=self.action_in_proj.weight.dtype))
    time_emb = self.time_mlp_in(time_emb.to(dtype=self.time_mlp_in.weight.dtype))
    return action_emb, F.silu(self.time_mlp_out(F.silu(time_emb)))


def prepare_denoise_layout(self, prefix_pad_masks, x_t, prefix_full_attention=False, *, action_position_offset=0):
    """(attention mask or None, position ids) of the action tokens, the same for every step."""
    batch, actions = x_t.shape[:2]
    positions = (prefix_pad_masks.sum(dim=-1, keepdim=True) + action_position_offset
                 + torch.arange(actions, device=x_t.device))
    if prefix_full_attention:
        return None, positions
    visible = torch.cat([prefix_pad_masks[:, None, :].expand(batch, actions, -1),
                         prefix_pad_masks.new_ones(batch, actions, actions)], dim=2)
    # A masked prefix is never full attention: no .item() probe, so the layout stays capturable.
    return self.prepare_attention_masks_4d(visible, full_attention=False), positions


def encode_prefix(self, images, image_masks, tokens, token_masks, prefix_full_attention_hint=None,
                  tokens_trimmed=False, *, fast=None):
    """(K/V, pad masks, full attention) of the prefix. Hint True / False: full / masked, without a
    sync (capturable); None: the masks are probed (.item()). fast: the Pi05FastPath whose layers run, or None."""
    with torch.no_grad():
        if not tokens_trimmed:
            tokens, token_masks = trim_trailing_padding_tokens(tokens, token_masks)
        self._prepare_prefix_image_encoder_for_embed()
        with fast.vision() if fast is not None else contextlib.nullcontext():
            embeds, pad_masks, att_marks = self.embed_prefix(images, image_masks, tokens, token_masks)
        self._offload_prefix_image_encoder_after_embed()
        # Masked tokens before the first visible one (a missing first camera) would get position -1: the
        # rotary table's gather reads out of bounds (a device-side assert). Nothing attends to them; 0 will do.
        positions = (torch.cumsum(pad_masks, dim=1) - 1).clamp_min_(0)
        full_attention, mask = True, None
        if prefix_full_attention_hint is not True:
            masks_2d = make_att_2d_masks(pad_masks, att_marks)
            full_attention = prefix_full_attention_hint is None and bool(masks_2d.all().item())
            mask = self.prepare_attention_masks_4d(masks_2d, full_attention=full_attention)
        self._prepare_prefix_language_layers_for_forward()
        with set_forward_context(current_timestep=0, attn_metadata=None):
            kv = None if fast is None else fast.encode_prefix_layers(embeds, mask, positions, pad_masks)
            if kv is None:  # the exact layers (also when the fused ones failed on their first use)
                _, kv = self.paligemma_with_expert.forward(attention_mask=mask, position_ids=positions,
                                                           past_key_values=None, inputs_embeds=[embeds, None],
                                                           use_cache=True)
        self._offload_prefix_language_layers_after_prefix()
        return kv, pad_masks, full_attention


def denoise_step(self, prefix_pad_masks, past_key_values, x_t, timestep, prefix_full_attention=False, *,
                 action_position_offset=0, denoise_layout=None):
    """Velocity of one step; `denoise_layout` (prepare_denoise_layout's) is computed here if not given."""
    with torch.no_grad():
        suffix, adarms_cond = self.embed_suffix(x_t, timestep)
        if denoise_layout is None:
            denoise_layout = self.prepare_denoise_layout(prefix_pad_masks, x_t, prefix_full_attention,
                                                         action_position_offset=action_position_offset)
        mask, positions = denoise_layout
        prefix = VLADensePrefixCache(past_key_values, read_only=True)
        with set_forward_context(current_timestep=0, attn_metadata=None):
            outputs, _ = self.paligemma_with_expert.forward(attention_mask=mask, position_ids=positions,
                                                            past_key_values=prefix, inputs_embeds=[None, suffix],
                                                            use_cache=False, adarms_cond=[None, adarms_cond])
        actions = outputs[1][:, -x_t.shape[1]:]
        return self.action_out_proj(actions.to(dtype=self.action_out_proj.weight.dtype)).to(dtype=torch.float32)


def patch_core(ctx, module) -> None:
    ctx.setattr(module.Pi05CoreModel, "encode_prefix", encode_prefix)


def backport_core(ctx, module) -> None:
    """0.5.17: 0.5.19's capturable prefix embedding, cached time scaling and hoisted denoise layout."""
    ctx.setattr(module, "create_sinusoidal_pos_embedding", _with_scaling(module.create_sinusoidal_pos_embedding))
    for method in (embed_prefix, embed_suffix, prepare_denoise_layout, denoise_step):
        ctx.setattr(module.Pi05CoreModel, method.__name__, method)
