"""Pi0.5 (VLA) CUDA graphs on sglang 0.5.17: prefix and action-denoise graphs with
bounded caches, denoise layout hoisted out of the step loop, capturable masked
prefixes, K/V refresh keyed by context generation.

Target symbol(s):
    sglang.multimodal_gen.runtime.vla.denoise_cuda_graph (module; aliased to the new
        sglang.multimodal_gen.runtime.vla.cuda_graph, sglang_ext/upstream/...)
    sglang.multimodal_gen.runtime.models.vlas.pi05_core: create_sinusoidal_pos_embedding,
        Pi05CoreModel.{embed_prefix, embed_suffix, encode_prefix, denoise_step,
        prepare_denoise_layout (new)}
    sglang.multimodal_gen.runtime.models.vlas.pi05_policy: Pi05ActionExpert.forward,
        Pi05PolicyModel.{__init__, build_prefix_cache_key, encode_prefix, denoise_step,
        sample_actions, _prefix_cuda_graph_enabled / _prompt_token_bucketing_enabled /
        _prefix_tensor_parallel_enabled (new)}
    sglang.multimodal_gen.runtime.pipelines_core.stages.vla: _grouped_fingerprint,
        VLAPrefixEncodingStage.{forward, run_grouped_requests, get_cached_context}
sglang versions: 0.5.17 (fingerprint-gated).
Upstream PR: the Pi0.5 bounded-graph-cache PR of sglang 0.5.19 (supersedes #34588), on
    top of 0.5.18's prefix graph (vla/cuda_graph.py).
Why: 0.5.17 has an unbounded action graph only, never graphs masked prefixes (a
    device-to-host .item() per step, pageable H2D in embed_prefix), rebuilds the denoise
    mask/positions/time scaling in every step, captures no prefix graph. Upstream's port
    keys the K/V refresh on id(), which CPython reuses for the next request's K/V.
How: methods ported as module-level defs and transplanted into sglang's modules; the
    graph runners live in the installed upstream module, built on
    sglang_ext.graphs.cache. Settings: pipeline config fields (pi05_config patch), each
    overridable by --ext-pi05-* knobs read at construction time. Beyond upstream:
    generation-keyed refresh, no host sync after a prefix replay, owned prefix contexts
    when several requests run stage by stage, fused denoise loop (opt-in knob
    pi05_fused_denoise), the fused-kernel loop of knob pi05_fast (pi05_fast.py: graph
    with signature kernels="fast", or eager with graphs off; action SP and layouts it
    does not cover take the exact path) and its prefix layers (encode_prefix; prefix
    graph signatures get a "fast" layout entry), --ext-debug-addresses checks every static
    tensor (inputs, K/V, outputs) of each graph before its replays.
Retire when: the minimum supported sglang has vla/cuda_graph.py with bounded caches
    (>= 0.5.19) AND keys the K/V refresh on something other than id() (open in 0.5.23).
"""

from __future__ import annotations

import functools
import importlib
import weakref

from sglang_ext import knobs
from sglang_ext.pi05 import graph_settings as _ext_pi05_settings
from sglang_ext.pi05 import fast as _ext_pi05_fast
from sglang_ext.patching import install_module
from sglang_ext.pi05.prompt_bucketing import effective_token_length

_GRAPH_MODULE = "sglang_ext.pi05.vla_cuda_graph"
_UPSTREAM_NAME = "sglang.multimodal_gen.runtime.vla.cuda_graph"
_LEGACY_NAME = "sglang.multimodal_gen.runtime.vla.denoise_cuda_graph"


def _graph_module():
    return importlib.import_module(_GRAPH_MODULE)


# ==========================================================================
# Settings: sglang_ext.pi05.graph_settings (config fields, knobs override; works while
# the pi05_config patch is off)
# ==========================================================================


def _ext_prompt_token_buckets(config) -> tuple:
    return tuple(_ext_pi05_settings.setting(config, "prompt_token_buckets") or ())


# ==========================================================================
# pi05_core
# ==========================================================================


def _ext_sinusoidal_scaling(dimension, min_period, max_period, device):
    fraction = torch.linspace(0.0, 1.0, dimension // 2, dtype=torch.float64, device=device)
    period = min_period * (max_period / min_period) ** fraction
    return 1.0 / period * 2 * math.pi


def create_sinusoidal_pos_embedding(
    time,
    dimension,
    min_period,
    max_period,
    scaling=None,
):
    if dimension % 2 != 0:
        raise ValueError(f"dimension ({dimension}) must be divisible by 2")
    if time.ndim != 1:
        raise ValueError("time must have shape [batch]")
    if scaling is None:
        scaling = _ext_sinusoidal_scaling(dimension, min_period, max_period, time.device)
    sin_input = scaling[None, :] * time[:, None].to(torch.float64)
    return torch.cat([torch.sin(sin_input), torch.cos(sin_input)], dim=1)


def core_embed_prefix(self, images, image_masks, tokens, token_masks):
    embs = []
    pad_masks = []
    image_embs = self.paligemma_with_expert.embed_images(images)
    for image_emb, image_mask in zip(image_embs, image_masks, strict=True):
        batch_size, num_image_embs = image_emb.shape[:2]
        embs.append(image_emb)
        pad_masks.append(image_mask[:, None].expand(batch_size, num_image_embs))

    lang_emb = self.paligemma_with_expert.embed_language_tokens(tokens)
    # Match OpenPI's Pi0.5 prefix embedding semantics.
    lang_emb = lang_emb * math.sqrt(lang_emb.shape[-1])
    embs.append(lang_emb)
    pad_masks.append(token_masks)

    embs = torch.cat(embs, dim=1)
    pad_masks = torch.cat(pad_masks, dim=1)
    # Every prefix position is bidirectional (att mask 0): built on the device,
    # not from a pageable host list, so the prefix stays capturable.
    att_masks = torch.zeros_like(pad_masks, dtype=torch.bool)
    return embs, pad_masks, att_masks


core_embed_prefix.__name__ = "embed_prefix"


def core_embed_suffix(self, noisy_actions, timestep):
    """Action and time embeddings; the sinusoidal scaling is computed once and cached."""
    width = self.action_in_proj.out_features
    scaling = getattr(self, "_time_embedding_scaling", None)
    if scaling is None or scaling.numel() != width // 2 or scaling.device != timestep.device:
        scaling = _ext_sinusoidal_scaling(
            width,
            self.config.time_embedding_min_period,
            self.config.time_embedding_max_period,
            timestep.device,
        )
        if "_time_embedding_scaling" in self._buffers:
            self._time_embedding_scaling = scaling
        else:
            self.register_buffer("_time_embedding_scaling", scaling, persistent=False)
    time_emb = create_sinusoidal_pos_embedding(
        timestep,
        width,
        min_period=self.config.time_embedding_min_period,
        max_period=self.config.time_embedding_max_period,
        scaling=scaling,
    )
    action_emb = self.action_in_proj(noisy_actions.to(dtype=self.action_in_proj.weight.dtype))
    time_emb = time_emb.to(dtype=self.time_mlp_in.weight.dtype)
    time_emb = self.time_mlp_in(time_emb)
    time_emb = F.silu(time_emb)
    time_emb = self.time_mlp_out(time_emb)
    adarms_cond = F.silu(time_emb)
    return action_emb, adarms_cond


core_embed_suffix.__name__ = "embed_suffix"


def core_prepare_denoise_layout(
    self,
    prefix_pad_masks,
    x_t,
    prefix_full_attention=False,
    *,
    action_position_offset=0,
):
    """(attention_mask | None, position_ids) of the action suffix; the same for every
    denoise step of a request, so callers compute it once."""
    batch_size, action_len = x_t.shape[:2]
    suffix_pad_masks = torch.ones(batch_size, action_len, dtype=torch.bool, device=x_t.device)
    if prefix_full_attention:
        attention_mask = None
    else:
        # The first action token opens one bidirectional suffix block.
        suffix_att_masks = torch.zeros(batch_size, action_len, dtype=x_t.dtype, device=x_t.device)
        suffix_att_masks[:, 0] = 1
        prefix_len = prefix_pad_masks.shape[1]
        full_att_2d_masks = torch.cat(
            [
                prefix_pad_masks[:, None, :].expand(batch_size, action_len, prefix_len),
                make_att_2d_masks(suffix_pad_masks, suffix_att_masks),
            ],
            dim=2,
        )
        # A masked prefix is never full attention: no .item() probe (keeps the
        # masked path capturable).
        attention_mask = self.prepare_attention_masks_4d(full_att_2d_masks, full_attention=False)
    prefix_offsets = torch.sum(prefix_pad_masks, dim=-1)[:, None]
    position_ids = (
        prefix_offsets + action_position_offset + torch.cumsum(suffix_pad_masks, dim=1) - 1
    )
    return attention_mask, position_ids


core_prepare_denoise_layout.__name__ = "prepare_denoise_layout"


def core_encode_prefix(
    self,
    images,
    image_masks,
    tokens,
    token_masks,
    prefix_full_attention_hint=None,
    tokens_trimmed=False,
):
    """Prefix K/V. hint True: full attention; False: masked, decided without a
    device sync; None: probe the masks (.item(), not capturable)."""
    with torch.no_grad():
        if not tokens_trimmed:
            tokens, token_masks = trim_trailing_padding_tokens(tokens, token_masks)
        self._prepare_prefix_image_encoder_for_embed()
        prefix_embs, prefix_pad_masks, prefix_att_masks = self.embed_prefix(
            images, image_masks, tokens, token_masks
        )
        self._offload_prefix_image_encoder_after_embed()
        prefix_position_ids = torch.cumsum(prefix_pad_masks, dim=1) - 1
        if prefix_full_attention_hint is True:
            prefix_full_attention = True
            attention_mask = None
        else:
            prefix_att_2d_masks = make_att_2d_masks(prefix_pad_masks, prefix_att_masks)
            if prefix_full_attention_hint is None:
                prefix_full_attention = bool(prefix_att_2d_masks.all().item())
            else:
                prefix_full_attention = False
            attention_mask = self.prepare_attention_masks_4d(
                prefix_att_2d_masks, full_attention=prefix_full_attention
            )
        self._prepare_prefix_language_layers_for_forward()
        with set_forward_context(current_timestep=0, attn_metadata=None):
            past_key_values = None
            if _ext_pi05_fast.prefix_enabled(self):  # knob pi05_fast: the same K/V on fused kernels
                past_key_values = _ext_pi05_fast.encode_prefix_layers(  # core_embed_prefix: pad-only masks
                    self, prefix_embs, attention_mask, prefix_position_ids, prefix_pad_masks
                )
            if past_key_values is None:
                _, past_key_values = self.paligemma_with_expert.forward(
                    attention_mask=attention_mask,
                    position_ids=prefix_position_ids,
                    past_key_values=None,
                    inputs_embeds=[prefix_embs, None],
                    use_cache=True,
                )
        self._offload_prefix_language_layers_after_prefix()
        return past_key_values, prefix_pad_masks, prefix_full_attention


core_encode_prefix.__name__ = "encode_prefix"


def core_denoise_step(
    self,
    prefix_pad_masks,
    past_key_values,
    x_t,
    timestep,
    prefix_full_attention=False,
    *,
    action_position_offset=0,
    denoise_layout=None,
):
    with torch.no_grad():
        suffix_embs, adarms_cond = self.embed_suffix(x_t, timestep)
        if denoise_layout is None:
            denoise_layout = self.prepare_denoise_layout(
                prefix_pad_masks,
                x_t,
                prefix_full_attention,
                action_position_offset=action_position_offset,
            )
        attention_mask, position_ids = denoise_layout
        with set_forward_context(current_timestep=0, attn_metadata=None):
            outputs_embeds, _ = self.paligemma_with_expert.forward(
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=VLADensePrefixCache(past_key_values, read_only=True),
                inputs_embeds=[None, suffix_embs],
                use_cache=False,
                adarms_cond=[None, adarms_cond],
            )
        suffix_out = outputs_embeds[1][:, -x_t.shape[1] :]
        return self.action_out_proj(
            suffix_out.to(dtype=self.action_out_proj.weight.dtype)
        ).to(dtype=torch.float32)


core_denoise_step.__name__ = "denoise_step"


def patch_core(ctx, module) -> None:
    ctx.transplant_function(module, create_sinusoidal_pos_embedding)
    cls = module.Pi05CoreModel
    for fn in (
        core_embed_prefix,
        core_embed_suffix,
        core_prepare_denoise_layout,
        core_encode_prefix,
        core_denoise_step,
    ):
        ctx.transplant_method(cls, fn)


# ==========================================================================
# vla graph module (installed under the upstream name; 0.5.17's name aliased)
# ==========================================================================


def patch_graph_module(ctx, module) -> None:
    graph_module = _graph_module()
    install_module(ctx, _UPSTREAM_NAME, graph_module)
    # 0.5.17 code importing vla.denoise_cuda_graph gets the bounded runners.
    install_module(ctx, _LEGACY_NAME, graph_module)


# ==========================================================================
# pi05_policy
# ==========================================================================


def action_expert_forward(
    self,
    prefix_context,
    x_t,
    timestep,
    *,
    action_position_offset=0,
    denoise_layout=None,
):
    return self.core_model.denoise_step(
        prefix_context.prefix_pad_masks,
        prefix_context.past_key_values,
        x_t,
        timestep,
        bool(prefix_context.layout.get("full_attention", False)),
        action_position_offset=action_position_offset,
        denoise_layout=denoise_layout,
    )


action_expert_forward.__name__ = "forward"


def policy_init(self, config, *, model_path, device, dtype, manifest):
    self._ext_orig___init__(
        config, model_path=model_path, device=device, dtype=dtype, manifest=manifest
    )
    evict_graphs_on_miss = self._prompt_token_bucketing_enabled()
    self.prefix_graph_runner = VLAPrefixGraphRunner(
        enabled=self._prefix_cuda_graph_enabled(),
        max_entries=_ext_pi05_settings.setting(config, "prefix_cuda_graph_max_entries"),
        evict_on_miss=evict_graphs_on_miss,
    )
    self.graph_runner = VLADenoiseGraphRunner(
        enabled=_ext_pi05_settings.action_graph_available(config),
        max_entries=_ext_pi05_settings.setting(config, "action_cuda_graph_max_entries"),
        evict_on_miss=evict_graphs_on_miss,
    )
    # The fast path's time-conditioning tables go with the action graphs.
    self.graph_runner.add_clear_hook(functools.partial(_ext_reset_time_tables, weakref.ref(self)))
    logger.info(
        "Pi05 CUDA graphs: prefix=%s/%d action=%s/%d mode=%s fused_denoise=%s fast=%s",
        self.prefix_graph_runner.enabled,
        self.prefix_graph_runner.max_entries,
        self.graph_runner.enabled,
        self.graph_runner.max_entries,
        "bucket" if evict_graphs_on_miss else "exact",
        bool(knobs.current("pi05_fused_denoise")),
        bool(knobs.current("pi05_fast")),
    )


policy_init.__name__ = "__init__"


def _ext_reset_time_tables(policy_ref) -> None:
    core = getattr(policy_ref(), "core_model", None)
    if core is not None:
        _ext_pi05_fast.reset_time_conditioning(core)


def policy_prefix_tensor_parallel_enabled(self) -> bool:
    language_model = self._prefix_language_model()
    return language_model is not None and bool(language_model.tensor_parallel)


policy_prefix_tensor_parallel_enabled.__name__ = "_prefix_tensor_parallel_enabled"


def policy_prefix_cuda_graph_enabled(self) -> bool:
    return (
        _ext_pi05_settings.prefix_graph_available(self.config)
        and self.device.type == "cuda"
        and self.runtime_role in ("all", "prefix")
        and not self._prefix_tensor_parallel_enabled()
    )


policy_prefix_cuda_graph_enabled.__name__ = "_prefix_cuda_graph_enabled"


def policy_prompt_token_bucketing_enabled(self) -> bool:
    graph_path_available = self._prefix_cuda_graph_enabled() or _ext_pi05_settings.action_graph_available(
        self.config
    )
    if (
        not _ext_prompt_token_buckets(self.config)
        or not graph_path_available
        or self.device.type != "cuda"
        or self.runtime_role not in ("all", "prefix")
        or self._prefix_tensor_parallel_enabled()
    ):
        return False
    # Action SP needs a full-attention prefix; buckets add padding masks.
    return get_vla_split_group() is None


policy_prompt_token_bucketing_enabled.__name__ = "_prompt_token_bucketing_enabled"


def policy_build_prefix_cache_key(self, observation, *, bucket_prompt=False):
    camera_order = tuple(observation.metadata.get("camera_order", ()))
    image_hashes = {
        name: tensor_fingerprint(observation.images[name]) for name in camera_order
    }
    masks = {name: bool(mask.item()) for name, mask in observation.image_masks.items()}
    token_len = effective_token_length(observation.token_masks)
    tokens = observation.tokens[:, :token_len] if token_len > 0 else observation.tokens
    token_masks = (
        observation.token_masks[:, :token_len] if token_len > 0 else observation.token_masks
    )
    bucketing_enabled = bool(bucket_prompt) and self._prompt_token_bucketing_enabled()
    prompt_layout = "exact"
    if bucketing_enabled:
        from sglang.multimodal_gen.runtime.vla.prompt_bucketing import (
            select_prompt_token_bucket,
        )

        bucket = select_prompt_token_bucket(token_len, _ext_prompt_token_buckets(self.config))
        prompt_layout = "bucket-miss-exact" if bucket is None else f"bucket-{bucket}"
    model_revision = os.path.basename(os.path.normpath(self.model_path))
    return VLAPrefixCacheManager.make_key(
        model_revision=model_revision,
        tokenizer_id=f"{self.config.paligemma_variant}:{self.config.max_token_len}",
        camera_order=camera_order,
        image_hashes=image_hashes,
        token_digest=tensor_fingerprint(tokens),
        token_mask_digest=tensor_fingerprint(token_masks),
        masks=masks,
        positions_version=f"{self.config.prefix_cache_layout_version}:{prompt_layout}",
        dtype=str(self.dtype).replace("torch.", ""),
        parallel_layout_version=self.config.parallel_layout_version,
        cache_namespace="pi05",
    )


policy_build_prefix_cache_key.__name__ = "build_prefix_cache_key"


def policy_encode_prefix(self, observation, *, use_cuda_graph=True, bucket_prompt=None):
    camera_order = tuple(observation.metadata.get("camera_order", ()))
    images = [
        observation.images[name].to(self.device, dtype=torch.float32) for name in camera_order
    ]
    image_masks = [observation.image_masks[name].to(self.device) for name in camera_order]
    if bucket_prompt is None:
        bucket_prompt = use_cuda_graph
    use_prompt_bucket = bool(bucket_prompt) and self._prompt_token_bucketing_enabled()
    if use_prompt_bucket:
        from sglang.multimodal_gen.runtime.vla.prompt_bucketing import bucket_prompt_tokens

        tokens_cpu, token_masks_cpu, token_len, prompt_bucket = bucket_prompt_tokens(
            observation.tokens,
            observation.token_masks,
            _ext_prompt_token_buckets(self.config),
        )
    else:
        token_len = effective_token_length(observation.token_masks)
        prompt_bucket = None
        if 0 < token_len < observation.tokens.shape[1]:
            tokens_cpu = observation.tokens[:, :token_len]
            token_masks_cpu = observation.token_masks[:, :token_len]
        else:
            tokens_cpu = observation.tokens
            token_masks_cpu = observation.token_masks
    prompt_bucket_miss = use_prompt_bucket and prompt_bucket is None
    tokens = tokens_cpu.to(self.device)
    token_masks = token_masks_cpu.to(self.device)
    # Decided on the host (observation masks are CPU tensors). Bucketed prompts
    # always take the masked path: one control flow per bucket.
    if prompt_bucket is not None:
        prefix_full_attention_hint = False
    else:
        prefix_full_attention_hint = all(
            bool(observation.image_masks[name].all().item()) for name in camera_order
        ) and bool(token_masks_cpu.all().item())

    image_count = len(images)
    graph_inputs = (*images, *image_masks, tokens, token_masks)

    def encode(current_inputs):
        past_key_values, prefix_pad_masks, full_attention = self.core_model.encode_prefix(
            list(current_inputs[:image_count]),
            list(current_inputs[image_count : 2 * image_count]),
            current_inputs[-2],
            current_inputs[-1],
            prefix_full_attention_hint=prefix_full_attention_hint,
            # Trimming already happened above, on the host; the core must not
            # probe the device masks again (.item() is not capturable).
            tokens_trimmed=True,
        )
        past_key_values = self._materialize_prefix_kv_for_action(past_key_values)
        return PrefixContext(
            past_key_values=past_key_values,
            prefix_pad_masks=prefix_pad_masks,
            prefix_len=prefix_pad_masks.shape[1],
            layout={
                "full_attention": full_attention,
                "prompt_token_bucket": prompt_bucket,
                "cuda_graph_eligible": not prompt_bucket_miss,
            },
        )

    prefix_graph_runner = getattr(self, "prefix_graph_runner", None)
    if (
        not use_cuda_graph
        or prefix_graph_runner is None
        or not prefix_graph_runner.enabled
        or observation.batch_size != 1
        or prompt_bucket_miss
    ):
        prefix_context = encode(graph_inputs)
        prefix_context_generation(prefix_context)
        return prefix_context

    signature = VLAPrefixGraphSignature(
        batch_size=observation.batch_size,
        input_shapes=tuple(tuple(tensor.shape) for tensor in graph_inputs),
        input_dtypes=tuple(str(tensor.dtype).replace("torch.", "") for tensor in graph_inputs),
        static_layout=(image_count, prefix_full_attention_hint, prompt_bucket)
        + (
            ("fast",)
            if knobs.current("pi05_fast") and _ext_pi05_fast.prefix_enabled(self.core_model)
            else ()
        ),
        parallel_layout=self.config.parallel_layout_version,
    )
    return prefix_graph_runner.capture_or_run(signature, encode, graph_inputs)


policy_encode_prefix.__name__ = "encode_prefix"


def _ext_denoise_parallel_layout(self, action_position_offset, action_sp_enabled) -> str:
    parallel_layout = self.config.parallel_layout_version
    if action_sp_enabled:
        parallel_layout = (
            f"{parallel_layout}:action_sp"
            f":rank{get_sp_parallel_rank()}:offset{action_position_offset}"
        )
    return parallel_layout


def policy_denoise_step(
    self,
    prefix_context,
    x_t,
    timestep,
    *,
    use_cuda_graph=True,
    action_position_offset=0,
    action_sp_enabled=False,
    denoise_layout=None,
):
    if not use_cuda_graph or not prefix_context.layout.get("cuda_graph_eligible", True):
        return self.action_expert(
            prefix_context,
            x_t,
            timestep,
            action_position_offset=action_position_offset,
            denoise_layout=denoise_layout,
        )
    signature = VLADenoiseGraphSignature(
        batch_size=x_t.shape[0],
        prefix_len=prefix_context.prefix_len,
        prefix_full_attention=bool(prefix_context.layout.get("full_attention", False)),
        action_horizon=x_t.shape[1],
        action_dim=x_t.shape[2],
        dtype=str(x_t.dtype).replace("torch.", ""),
        parallel_layout=_ext_denoise_parallel_layout(
            self, action_position_offset, action_sp_enabled
        ),
    )

    def step_fn(current_prefix_context, current_x_t, current_timestep):
        # Inside the graph the layout is derived from the static prefix masks,
        # which the runner refreshes before each replay.
        return self.action_expert(
            current_prefix_context,
            current_x_t,
            current_timestep,
            action_position_offset=action_position_offset,
            denoise_layout=denoise_layout,
        )

    return self.graph_runner.capture_or_run(signature, step_fn, prefix_context, x_t, timestep)


policy_denoise_step.__name__ = "denoise_step"


def _ext_fused_denoise(self, prefix_context, x_t, steps, loop_fn, action_position_offset, kernels="exact"):
    """All denoise steps of one request as one graph replay (knob pi05_fused_denoise,
    or pi05_fast with kernels="fast"); `loop_fn(context, x_t, steps)` runs them."""
    signature = VLADenoiseLoopGraphSignature(
        step=VLADenoiseGraphSignature(
            batch_size=x_t.shape[0],
            prefix_len=prefix_context.prefix_len,
            prefix_full_attention=bool(prefix_context.layout.get("full_attention", False)),
            action_horizon=x_t.shape[1],
            action_dim=x_t.shape[2],
            dtype=str(x_t.dtype).replace("torch.", ""),
            parallel_layout=_ext_denoise_parallel_layout(self, action_position_offset, False),
        ),
        num_steps=int(steps.shape[0]),
        kernels=kernels,
    )
    return self.graph_runner.capture_or_run_loop(signature, loop_fn, prefix_context, x_t, steps)


def _ext_exact_denoise_loop(self, full_attention, dt, action_position_offset):
    """The exact loop: the same kernels as the per-step path, the layout computed once
    (inside the graph, from the static prefix masks), so it equals the eager loop."""

    def loop_fn(current_prefix_context, state, steps):
        denoise_layout = self.core_model.prepare_denoise_layout(
            current_prefix_context.prefix_pad_masks,
            state,
            full_attention,
            action_position_offset=action_position_offset,
        )
        for index in range(int(steps.shape[0])):
            velocity = self.action_expert(
                current_prefix_context,
                state,
                steps[index].expand(state.shape[0]),
                action_position_offset=action_position_offset,
                denoise_layout=denoise_layout,
            )
            state.add_(velocity, alpha=dt)
        return state

    return loop_fn


def _ext_fast_denoise(
    self, prefix_context, x_t, num_steps, dt, full_attention, action_position_offset, graph_enabled
):
    """Knob pi05_fast: the fused-kernel loop (sglang_ext.pi05.fast), one graph
    per request when graphs are on, the same code eagerly when they are off. Returns
    the denoised x_t, or None when the loop failed on its first use (exact path then)."""
    core = self.core_model
    table = _ext_pi05_fast.time_conditioning(core, num_steps, x_t.shape[0], x_t.device)

    def loop_fn(current_prefix_context, state, current_table):
        return _ext_pi05_fast.denoise(
            core,
            current_prefix_context,
            state,
            current_table,
            dt=dt,
            full_attention=full_attention,
            action_position_offset=action_position_offset,
        )

    def run(state):
        if not graph_enabled:
            return loop_fn(prefix_context, state, table)
        # The table goes in as the loop's step input: the graph keeps its own copy.
        return _ext_fused_denoise(self, prefix_context, state, table, loop_fn, action_position_offset, "fast")

    if _ext_pi05_fast.verified(core):
        return run(x_t)
    # First use on this model: a kernel that does not build here (e.g. another triton)
    # must cost the exact path, not the request. x_t is only replaced on success.
    try:
        result = run(x_t.clone())
    except Exception as exc:  # noqa: BLE001 - logged, then the exact path runs
        _ext_pi05_fast.mark_failed(core, exc)
        return None
    _ext_pi05_fast.mark_verified(core)
    return x_t.copy_(result)


def policy_sample_actions(
    self,
    observation,
    prefix_context,
    *,
    noise,
    num_steps,
    use_cuda_graph=True,
    generator=None,
):
    offload_action = self._offload_action_expert_between_requests()
    if offload_action:
        self._move_action_modules_to_device(self.device)
        use_cuda_graph = False

    split = get_vla_split_group()
    action_sp_enabled = self._can_use_action_sequence_parallel(
        prefix_context,
        self.config.action_horizon,
    )
    if split is None or split.rank == split.action_root:
        x_t = noise
        if x_t is None:
            x_t = self.sample_noise(observation.batch_size, generator=generator)
        else:
            x_t = x_t.to(device=self.device, dtype=torch.float32).clone()
    else:
        x_t = None
    if action_sp_enabled:
        x_t = self._broadcast_initial_action_state(x_t)
    elif x_t is None:
        raise RuntimeError("Pi05 action fallback must run on the action root")
    action_position_offset = 0
    if action_sp_enabled:
        x_t, action_position_offset = self._shard_action_sequence(x_t)

    full_attention = bool(prefix_context.layout.get("full_attention", False))
    graph_enabled = bool(
        use_cuda_graph
        and self.graph_runner.enabled
        and prefix_context.layout.get("cuda_graph_eligible", True)
    )
    dt = -1.0 / num_steps
    timesteps = torch.linspace(
        1.0,
        1.0 / num_steps,
        num_steps,
        dtype=torch.float32,
        device=self.device,
    )
    fast = (
        knobs.current("pi05_fast")
        and not action_sp_enabled
        and _ext_pi05_fast.unsupported_reason(self.core_model) is None
    )
    denoised = None
    if fast:
        denoised = _ext_fast_denoise(
            self, prefix_context, x_t, num_steps, dt, full_attention, action_position_offset, graph_enabled
        )
    if denoised is not None:
        x_t = denoised
    elif graph_enabled and not action_sp_enabled and knobs.current("pi05_fused_denoise"):
        x_t = _ext_fused_denoise(
            self,
            prefix_context,
            x_t,
            timesteps,
            _ext_exact_denoise_loop(self, full_attention, dt, action_position_offset),
            action_position_offset,
        )
    else:
        # Eager steps share one layout; graph steps derive it inside the graph.
        denoise_layout = None
        if not graph_enabled:
            denoise_layout = self.core_model.prepare_denoise_layout(
                prefix_context.prefix_pad_masks,
                x_t,
                full_attention,
                action_position_offset=action_position_offset,
            )
        for timestep_value in timesteps:
            timestep = timestep_value.expand(observation.batch_size)
            velocity = self.denoise_step(
                prefix_context,
                x_t,
                timestep,
                use_cuda_graph=use_cuda_graph,
                action_position_offset=action_position_offset,
                action_sp_enabled=action_sp_enabled,
                denoise_layout=denoise_layout,
            )
            x_t.add_(velocity, alpha=dt)
    if action_sp_enabled:
        x_t = sequence_model_parallel_all_gather(x_t.contiguous(), dim=1)
    if offload_action:
        self._move_action_modules_to_device(torch.device("cpu"))
        torch.cuda.empty_cache()
    return x_t


policy_sample_actions.__name__ = "sample_actions"


def patch_policy(ctx, module) -> None:
    graph_module = _graph_module()
    # pi05_policy bound 0.5.17's classes by `from ... import` if it was imported
    # before activation: rebind, and add the names the new methods use.
    for name in (
        "VLADenoiseGraphRunner",
        "VLADenoiseGraphSignature",
        "VLADenoiseLoopGraphSignature",
        "VLAPrefixGraphRunner",
        "VLAPrefixGraphSignature",
        "prefix_context_generation",
    ):
        ctx.setattr(module, name, getattr(graph_module, name))
    ctx.transplant_method(module.Pi05ActionExpert, action_expert_forward)
    cls = module.Pi05PolicyModel
    ctx.setattr(cls, "_ext_orig___init__", cls.__dict__["__init__"])
    for fn in (
        policy_init,
        policy_prefix_tensor_parallel_enabled,
        policy_prefix_cuda_graph_enabled,
        policy_prompt_token_bucketing_enabled,
        policy_build_prefix_cache_key,
        policy_encode_prefix,
        policy_denoise_step,
        policy_sample_actions,
    ):
        ctx.transplant_method(cls, fn)


# ==========================================================================
# pipelines_core.stages.vla
# ==========================================================================


def _cuda_graph_enabled(batch) -> bool:
    return bool(vla_options(batch).get("enable_cuda_graph", True))


def _grouped_fingerprint(batch, server_args):
    if (
        batch.is_warmup
        or get_vla_split_group() is not None
        or _effective_prefix_cache_enabled(batch, server_args)
        or batch.generator is not None
    ):
        return ("single", id(batch))

    observation = vla_state(batch).get("observation_batch")
    camera_order = tuple(observation.metadata.get("camera_order", ()))
    image_shapes = tuple(
        (
            name,
            tuple(observation.images[name].shape),
            bool(observation.image_masks[name].item()),
        )
        for name in camera_order
    )
    return (
        "grouped",
        camera_order,
        image_shapes,
        None if observation.state is None else tuple(observation.state.shape),
        None if observation.noise is None else tuple(observation.noise.shape),
        tuple(observation.tokens.shape),
        tuple(observation.token_masks.shape),
        batch.action_horizon,
        batch.action_dim,
        batch.num_inference_steps,
        _cuda_graph_enabled(batch),
    )


def stage_run_grouped_requests(self, batches, server_args):
    """Grouped execution runs this stage for every request before the action stage:
    while more than one request is in flight, prefix-graph outputs (overwritten by
    the next replay) are copied into per-request contexts (see forward)."""
    previous = getattr(self, "_ext_requests_in_flight", 1)
    self._ext_requests_in_flight = len(batches)
    try:
        return self._ext_orig_run_grouped_requests(batches, server_args)
    finally:
        self._ext_requests_in_flight = previous


stage_run_grouped_requests.__name__ = "run_grouped_requests"


def stage_get_cached_context(self, batch, server_args, observation):
    """try querying the cache for PrefixContext with prefix cache key built from observations and other keys"""
    cache_enabled = _effective_prefix_cache_enabled(batch, server_args)
    if cache_enabled:
        cache_key = self.policy_model.build_prefix_cache_key(
            observation,
            bucket_prompt=_cuda_graph_enabled(batch),
        )
        cached_context = self.prefix_cache.get(cache_key)
    else:
        cache_key = None
        cached_context = None
    return cache_key, cached_context


stage_get_cached_context.__name__ = "get_cached_context"


def stage_forward(self, batch, server_args):
    state = vla_state(batch)
    if batch.is_warmup:
        state["prefix_context"] = None
        state["cache"] = {"hit": False, "warmup": True}
        return batch

    split = get_vla_split_group()
    if split is not None and not split.is_prefix_rank:
        return self._recv_prefix_result(batch, split)

    observation = state["observation_batch"]
    cache_start = time.perf_counter()
    cache_enabled = _effective_prefix_cache_enabled(batch, server_args)

    # 1. try querying the per-request LRU prefix kv cache
    cache_key, cached_context = self.get_cached_context(batch, server_args, observation)
    vla_timings(batch)["cache_lookup_ms"] = (time.perf_counter() - cache_start) * 1000

    # 2. prepare VLAState
    if cached_context is not None:
        state["prefix_context"] = cached_context
        state["cache"] = {
            "hit": True,
            "scope": "global",
            "mode": "exact",
            "prefix_len": cached_context.prefix_len,
            "prompt_token_bucket": cached_context.layout.get("prompt_token_bucket"),
        }
        if split is not None:
            self._send_prefix_result(batch, split, cached_context)
        return batch

    prefix_start = time.perf_counter()

    # 3. run encoding. A prefix-graph output is overwritten by the next replay,
    # so it never enters the prefix cache.
    cuda_graph_enabled = _cuda_graph_enabled(batch)
    prefix_context = self.policy_model.encode_prefix(
        observation,
        use_cuda_graph=cuda_graph_enabled and not cache_enabled,
        bucket_prompt=cuda_graph_enabled,
    )
    if getattr(self, "_ext_requests_in_flight", 1) > 1:
        prefix_context = own_prefix_context(prefix_context)
    if cache_key is not None:
        prefix_context.cache_key_digest = cache_key

    vla_timings(batch)["prefix_ms"] = (time.perf_counter() - prefix_start) * 1000
    state["prefix_context"] = prefix_context
    state["cache"] = {
        "hit": False,
        "scope": "global" if cache_enabled else "request",
        "mode": "exact" if cache_enabled else "disabled",
        "prefix_len": prefix_context.prefix_len,
        "prompt_token_bucket": prefix_context.layout.get("prompt_token_bucket"),
    }

    # 4. update prefix kv cache
    if cache_key is not None:
        self.prefix_cache.put(cache_key, prefix_context)
    if split is not None:
        self._send_prefix_result(batch, split, prefix_context)
    if server_args.pipeline_config.empty_cache_after_prefix and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return batch


stage_forward.__name__ = "forward"


def patch_stages(ctx, module) -> None:
    graph_module = _graph_module()
    ctx.setattr(module, "own_prefix_context", graph_module.own_prefix_context)
    ctx.transplant_function(module, _cuda_graph_enabled)
    ctx.transplant_function(module, _grouped_fingerprint)
    cls = module.VLAPrefixEncodingStage
    ctx.setattr(cls, "_ext_orig_run_grouped_requests", cls.__dict__["run_grouped_requests"])
    for fn in (stage_run_grouped_requests, stage_get_cached_context, stage_forward):
        ctx.transplant_method(cls, fn)
