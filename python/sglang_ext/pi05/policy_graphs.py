"""Pi0.5 policy on bounded prefix and action graphs (sglang 0.5.19's API), with prompt buckets and fused denoise loops.

Patch: pi05_graphs
Targets: sglang.multimodal_gen.runtime.models.vlas.pi05_policy:Pi05ActionExpert.forward,
sglang.multimodal_gen.runtime.models.vlas.pi05_policy:Pi05PolicyModel.__init__,
sglang.multimodal_gen.runtime.models.vlas.pi05_policy:Pi05PolicyModel.build_prefix_cache_key,
sglang.multimodal_gen.runtime.models.vlas.pi05_policy:Pi05PolicyModel.encode_prefix,
sglang.multimodal_gen.runtime.models.vlas.pi05_policy:Pi05PolicyModel.denoise_step,
sglang.multimodal_gen.runtime.models.vlas.pi05_policy:Pi05PolicyModel.sample_actions
Upstream PR: sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)
Retire when: upstream keys the action-graph K/V refresh on something id()-free and the minimum supported sglang has
vla/cuda_graph.py (>= 0.5.19)

Why: 0.5.17 graphs only full-attention denoise steps, one unbounded graph per prompt length,
and never the prefix.
How: __init__ wrapped (our runners replace upstream's, knobs read once, graphs captured at load); the
request methods replaced by 0.5.19's behaviour in our code, plus the fused loops. Releases: 0.5.23,
0.5.17 (also Pi05ActionExpert.forward, 0.5.19's, and the runner names the module binds).
"""

from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from sglang.multimodal_gen.runtime.distributed.communication_op import sequence_model_parallel_all_gather
from sglang.multimodal_gen.runtime.distributed.parallel_state import get_sp_parallel_rank
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger
from sglang.multimodal_gen.runtime.vla.observation import tensor_fingerprint
from sglang.multimodal_gen.runtime.vla.parallel import get_vla_split_group
from sglang.multimodal_gen.runtime.vla.prefix_cache import PrefixContext, VLAPrefixCacheManager
from sglang_ext import knobs
from sglang_ext.graphs.host_copy import to_device
from sglang_ext.pi05 import graph_settings, load_capture
from sglang_ext.pi05.fast_path import FastPaths
from sglang_ext.pi05.prompt_bucketing import bucket_prompt_tokens, effective_token_length, select_prompt_token_bucket
from sglang_ext.pi05.vla_cuda_graph import (VLADenoiseGraphRunner, VLADenoiseGraphSignature,
                                            VLADenoiseLoopGraphSignature, VLAPrefixGraphRunner, VLAPrefixGraphSignature,
                                            prefix_context_generation)

logger = init_logger(__name__)


@dataclass(frozen=True)
class Pi05Options:
    """The knobs a policy reads once, when built (the class default: the values at patch time)."""

    fast: bool = False  # pi05_fast: the fused-kernel denoise loop and prefix layers
    fused_denoise: bool = False  # pi05_fused_denoise: every denoise step in one graph
    fused_vision: bool = True  # no knob (tests, bench_pi05's experiments): Pi05FastPath.fused_vision
    pdl: bool = True  # no knob (tests, bench_pi05's graph-fast-nopdl): Pi05FastPath.pdl

    @classmethod
    def read(cls, value=knobs.current) -> "Pi05Options":
        return cls(fast=bool(value("pi05_fast")), fused_denoise=bool(value("pi05_fused_denoise")))


@dataclass
class PolicyState:
    """What pi05_graphs keeps for one policy: the knobs it read when built and the graph plan of its config."""

    options: Pi05Options
    plan: Optional[graph_settings.GraphPlan] = None  # None: resolved from the config at next use


class PolicyGraphs:
    """The pi05_graphs patch's own state for one activation: sglang's constructor, the knobs at patch time,
    the fast paths by core model and each policy's PolicyState (held weakly). The __init__ the patch installs
    carries it (`graphs`), so it goes with the patch's rollback."""

    def __init__(self, ctx, sglang_init):
        self.sglang_init = sglang_init
        self.options = Pi05Options.read(functools.partial(getattr, ctx.settings))
        self.fast_paths = FastPaths(ctx)
        self._policies = weakref.WeakKeyDictionary()

    def state(self, policy) -> PolicyState:
        """`policy`'s state (a policy built without __init__ gets the knobs at patch time)."""
        state = self._policies.get(policy)  # read several times per request: a new state only when missing
        if state is None:
            state = self._policies[policy] = PolicyState(self.options)
        return state


def graphs_of(policy) -> PolicyGraphs:
    return type(policy).__init__.graphs


def state_of(policy) -> PolicyState:
    return graphs_of(policy).state(policy)


def _graph_plan(self) -> graph_settings.GraphPlan:
    state = state_of(self)
    if state.plan is None:
        state.plan = graph_settings.resolve_plan(self.config)
    return state.plan


def action_expert_forward(self, prefix_context, x_t, timestep, *, action_position_offset=0, denoise_layout=None):
    return self.core_model.denoise_step(prefix_context.prefix_pad_masks, prefix_context.past_key_values, x_t, timestep,
                                        bool(prefix_context.layout.get("full_attention", False)),
                                        action_position_offset=action_position_offset, denoise_layout=denoise_layout)


def _build_graphs(self, graphs: PolicyGraphs) -> None:
    """After sglang's constructor: bounded runners sized by the config (and the --ext-pi05-* knobs)."""
    graphs.state(self).options = options = Pi05Options.read()
    plan = _graph_plan(self)
    bucket_mode = self._prompt_token_bucketing_enabled()
    lru = bucket_mode and not plan.at_load  # at load: every bucket resident, nothing to evict
    self.prefix_graph_runner = VLAPrefixGraphRunner(
        enabled=self._prefix_cuda_graph_enabled(), evict_on_miss=lru, max_entries=plan.prefix_entries,
        max_bytes=plan.max_bytes)
    self.graph_runner = VLADenoiseGraphRunner(
        enabled=graph_settings.action_graph_available(self.config), evict_on_miss=lru,
        max_entries=plan.action_entries, max_bytes=plan.max_bytes)
    # The fast path's time tables go with the action graphs, its packed q/k/v checks with the prefix's.
    policy = weakref.ref(self)
    self.graph_runner.add_clear_hook(functools.partial(_reset_fast_path, graphs, policy, "reset_action"))
    self.prefix_graph_runner.add_clear_hook(functools.partial(_reset_fast_path, graphs, policy, "reset_prefix"))
    if options.fast:
        _fast_path(self)
    logger.info("Pi05 CUDA graphs: prefix=%s/%d action=%s/%d mode=%s capture=%s buckets=%s fused_denoise=%s "
                "fast=%s", self.prefix_graph_runner.enabled, self.prefix_graph_runner.max_entries,
                self.graph_runner.enabled, self.graph_runner.max_entries, "bucket" if bucket_mode else "exact",
                "load" if plan.at_load else "lazy", list(plan.prompt_buckets) if bucket_mode else [],
                options.fused_denoise, options.fast)
    if plan.at_load:
        load_capture.capture_at_load(self, plan.prompt_buckets)


def _fast_path(self):
    """The fast path of this policy's core model in the mode its options name (Pi05FastPath)."""
    graphs = graphs_of(self)
    options = graphs.state(self).options
    return graphs.fast_paths.path(self.core_model, fused_vision=options.fused_vision, pdl=options.pdl)


def _reset_fast_path(graphs, policy_ref, reset: str) -> None:
    core = getattr(policy_ref(), "core_model", None)
    return None if core is None else graphs.fast_paths.reset(core, reset)


def _prefix_tensor_parallel_enabled(self) -> bool:
    language_model = self._prefix_language_model()
    return language_model is not None and bool(language_model.tensor_parallel)


def _single_rank_cuda_prefix(self) -> bool:
    return (VLAPrefixGraphRunner.device_captures(self.device) and self.runtime_role in ("all", "prefix")
            and not self._prefix_tensor_parallel_enabled())


def _prefix_cuda_graph_enabled(self) -> bool:
    return graph_settings.prefix_graph_available(self.config) and _single_rank_cuda_prefix(self)


def _prompt_token_bucketing_enabled(self) -> bool:
    """Buckets configured and a graph to share them, on a single-rank CUDA prefix."""
    return bool(_graph_plan(self).prompt_buckets and _single_rank_cuda_prefix(self) and get_vla_split_group() is None
                and (graph_settings.prefix_graph_available(self.config)
                     or graph_settings.action_graph_available(self.config)))


def build_prefix_cache_key(self, observation, *, bucket_prompt=False):
    """0.5.17's key over the prompt up to its last visible token, the prompt layout in the positions version."""
    token_len = effective_token_length(observation.token_masks)
    prompt_layout = "exact"
    if bucket_prompt and self._prompt_token_bucketing_enabled():
        bucket = select_prompt_token_bucket(token_len, _graph_plan(self).prompt_buckets)
        prompt_layout = "bucket-miss-exact" if bucket is None else f"bucket-{bucket}"
    prompt = slice(None, token_len or None)
    config, camera_order = self.config, tuple(observation.metadata.get("camera_order", ()))
    return VLAPrefixCacheManager.make_key(
        model_revision=os.path.basename(os.path.normpath(self.model_path)),
        tokenizer_id=f"{config.paligemma_variant}:{config.max_token_len}", camera_order=camera_order,
        image_hashes={name: tensor_fingerprint(observation.images[name]) for name in camera_order},
        token_digest=tensor_fingerprint(observation.tokens[:, prompt]),
        token_mask_digest=tensor_fingerprint(observation.token_masks[:, prompt]),
        masks={name: bool(mask.item()) for name, mask in observation.image_masks.items()},
        positions_version=f"{config.prefix_cache_layout_version}:{prompt_layout}",
        dtype=str(self.dtype).replace("torch.", ""), parallel_layout_version=config.parallel_layout_version,
        cache_namespace="pi05")


def encode_prefix(self, observation, *, use_cuda_graph=True, bucket_prompt=None):
    """The prefix context, on the prefix graph for batch 1 (a bucket miss runs eager and marks the
    context ineligible for action graphs)."""
    use_bucket = bool(use_cuda_graph if bucket_prompt is None else bucket_prompt) and \
        self._prompt_token_bucketing_enabled()
    camera_order = requested = tuple(observation.metadata.get("camera_order", ()))
    images = [to_device(observation.images[name], self.device, torch.float32) for name in camera_order]
    image_masks = [observation.image_masks[name].to(self.device) for name in camera_order]
    if use_bucket and _graph_plan(self).at_load:
        camera_order, images, image_masks = _as_all_checkpoint_cameras(self, camera_order, images, image_masks)
    # Without buckets: cut after the last visible token.
    tokens, token_masks, _, bucket = bucket_prompt_tokens(observation.tokens, observation.token_masks,
                                                          _graph_plan(self).prompt_buckets if use_bucket else ())
    bucket_miss = use_bucket and bucket is None
    # Decided on the host; a bucketed prompt, or a camera added masked, always takes the masked path.
    full_hint = bucket is None and camera_order == requested and bool(token_masks.all()) and all(
        bool(observation.image_masks[name].all()) for name in camera_order)
    fast = _fast_prefix(self)
    fused_vision = fast is not None and fast.serves("vision")
    if fused_vision:
        fast.prepare_vision()  # q/k/v packed before any capture (once)
    inputs = (*images, *image_masks, tokens.to(self.device), token_masks.to(self.device))
    count = len(images)

    def encode(current):
        # tokens_trimmed: trimmed (or bucketed) above, on the host; the core must not probe them (.item()).
        kv, pad_masks, full_attention = self.core_model.encode_prefix(
            list(current[:count]), list(current[count:2 * count]), current[-2], current[-1],
            prefix_full_attention_hint=full_hint, tokens_trimmed=True, fast=fast)
        layout = {"full_attention": full_attention, "prompt_token_bucket": bucket,
                  "cuda_graph_eligible": not bucket_miss}
        return PrefixContext(past_key_values=self._materialize_prefix_kv_for_action(kv), prefix_pad_masks=pad_masks,
                             prefix_len=pad_masks.shape[1], layout=layout)

    runner = getattr(self, "prefix_graph_runner", None)
    # A bucket miss runs eager; graphs captured at load count it (their sealed cache holds no such signature).
    if (not use_cuda_graph or runner is None or not runner.enabled or observation.batch_size != 1
            or (bucket_miss and not _graph_plan(self).at_load)):
        context = encode(inputs)
        prefix_context_generation(context)
        return context
    kernels = (("fast",) if fast is not None else ()) + (("fused-vision",) if fused_vision else ())
    signature = VLAPrefixGraphSignature(
        batch_size=observation.batch_size, input_shapes=tuple(tuple(t.shape) for t in inputs),
        input_dtypes=tuple(str(t.dtype).replace("torch.", "") for t in inputs),
        static_layout=(count, full_hint, bucket) + kernels,
        parallel_layout=self.config.parallel_layout_version)
    return runner.capture_or_run(signature, encode, inputs)


def _as_all_checkpoint_cameras(self, camera_order, images, image_masks):
    """A request that names some of the checkpoint's cameras, in its order, as all of them with the missing
    ones masked (the preprocessor's placeholder): the layout the graphs were captured for at load. Masked
    image tokens are neither attended nor counted in positions, so the answer is the same up to rounding."""
    keys = tuple(self.config.image_keys)
    if camera_order in (keys, ()) or [k for k in keys if k in camera_order] != list(camera_order):
        return camera_order, images, image_masks
    given = dict(zip(camera_order, zip(images, image_masks)))
    placeholder = torch.full_like(images[0], -1.0)
    absent = torch.zeros_like(image_masks[0])
    return keys, [given.get(k, (placeholder, None))[0] for k in keys], [given.get(k, (None, absent))[1] for k in keys]


def _fast_prefix(self):
    """The fast path when knob pi05_fast (as this policy read it) is on and covers the prefix layers, else None."""
    fast = _fast_path(self) if state_of(self).options.fast else None
    return fast if fast is not None and fast.serves("prefix") else None


def _step_signature(self, prefix_context, x_t, action_position_offset, action_sp_enabled):
    layout = self.config.parallel_layout_version
    if action_sp_enabled:  # each rank's shard of the action sequence is its own graph
        layout += f":action_sp:rank{get_sp_parallel_rank()}:offset{action_position_offset}"
    batch, horizon, width = x_t.shape
    full = bool(prefix_context.layout.get("full_attention", False))
    return VLADenoiseGraphSignature(batch_size=batch, prefix_len=prefix_context.prefix_len, prefix_full_attention=full,
                                    action_horizon=horizon, action_dim=width,
                                    dtype=str(x_t.dtype).removeprefix("torch."), parallel_layout=layout)


def denoise_step(self, prefix_context, x_t, timestep, *, use_cuda_graph=True, action_position_offset=0,
                 action_sp_enabled=False, denoise_layout=None):
    """Velocity of one step, on the action graph unless graphs are off for this context."""
    step = functools.partial(self.action_expert, action_position_offset=action_position_offset,
                             denoise_layout=denoise_layout)
    if not use_cuda_graph or not prefix_context.layout.get("cuda_graph_eligible", True):
        return step(prefix_context, x_t, timestep)
    signature = _step_signature(self, prefix_context, x_t, action_position_offset, action_sp_enabled)
    return self.graph_runner.capture_or_run(signature, step, prefix_context, x_t, timestep)


def _initial_state(self, observation, prefix_context, noise, generator):
    """(x_t, its first action position, action sequence parallel?) of a request."""
    split = get_vla_split_group()
    action_sp = self._can_use_action_sequence_parallel(prefix_context, self.config.action_horizon)
    x_t = None
    if split is None or split.rank == split.action_root:
        x_t = (self.sample_noise(observation.batch_size, generator=generator) if noise is None
               else noise.to(device=self.device, dtype=torch.float32).clone())
    if action_sp:
        x_t, offset = self._shard_action_sequence(self._broadcast_initial_action_state(x_t))
        return x_t, offset, True
    if x_t is None:
        raise RuntimeError("Pi05 action fallback must run on the action root")
    return x_t, 0, False


def sample_actions(self, observation, prefix_context, *, noise, num_steps, use_cuda_graph=True, generator=None):
    offload_action = self._offload_action_expert_between_requests()
    if offload_action:
        self._move_action_modules_to_device(self.device)
        use_cuda_graph = False
    x_t, offset, action_sp = _initial_state(self, observation, prefix_context, noise, generator)
    x_t = _denoise(self, observation.batch_size, prefix_context, x_t, num_steps, offset, action_sp, use_cuda_graph)
    if action_sp:
        x_t = sequence_model_parallel_all_gather(x_t.contiguous(), dim=1)
    if offload_action:
        self._move_action_modules_to_device(torch.device("cpu"))
        torch.cuda.empty_cache()
    return x_t


def _denoise(self, batch_size, prefix_context, x_t, num_steps, offset, action_sp, use_cuda_graph):
    """x_t after `num_steps` Euler steps: the fused-kernel loop, one graph for every step, or step by step."""
    full = bool(prefix_context.layout.get("full_attention", False))
    eligible = prefix_context.layout.get("cuda_graph_eligible", True)
    graph = bool(use_cuda_graph and self.graph_runner.enabled and eligible)
    dt = -1.0 / num_steps
    options = state_of(self).options
    if options.fast and not action_sp and _fast_path(self).serves("denoise"):
        denoised = _fast_denoise(self, prefix_context, x_t, num_steps, dt, full, offset, graph)
        if denoised is not None:
            return denoised
    timesteps = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float32, device=self.device)
    if graph and not action_sp and options.fused_denoise:
        def exact_loop(context, state, steps):  # the per-step path's kernels, the layout computed once
            layout = self.core_model.prepare_denoise_layout(context.prefix_pad_masks, state, full,
                                                            action_position_offset=offset)
            for step in steps:
                velocity = self.action_expert(context, state, step.expand(state.shape[0]),
                                              action_position_offset=offset, denoise_layout=layout)
                state.add_(velocity, alpha=dt)
            return state

        return _loop_graph(self, prefix_context, x_t, timesteps, exact_loop, offset)
    layout = None if graph else self.core_model.prepare_denoise_layout(
        prefix_context.prefix_pad_masks, x_t, full, action_position_offset=offset)
    for timestep in timesteps:
        velocity = self.denoise_step(prefix_context, x_t, timestep.expand(batch_size), use_cuda_graph=use_cuda_graph,
                                     action_position_offset=offset, action_sp_enabled=action_sp, denoise_layout=layout)
        x_t.add_(velocity, alpha=dt)
    return x_t


def _loop_graph(self, prefix_context, x_t, steps, loop_fn, offset, kernels="exact"):
    """All denoise steps of one request as one graph replay; `loop_fn(context, x_t, steps)` runs them."""
    signature = VLADenoiseLoopGraphSignature(step=_step_signature(self, prefix_context, x_t, offset, False),
                                             num_steps=int(steps.shape[0]), kernels=kernels)
    return self.graph_runner.capture_or_run_loop(signature, loop_fn, prefix_context, x_t, steps)


def _fast_denoise(self, prefix_context, x_t, num_steps, dt, full_attention, offset, graph):
    """The fused-kernel loop (one graph per request, or eager); None when its first use here failed."""
    fast = _fast_path(self)
    table = fast.time_conditioning(num_steps, x_t.shape[0], x_t.device)
    loop_fn = functools.partial(fast.denoise, dt=dt, full_attention=full_attention, action_position_offset=offset)

    def run(state):
        if not graph:
            return loop_fn(prefix_context, state, table)
        # The table is the loop's step input: the graph keeps its own copy.
        return _loop_graph(self, prefix_context, state, table, loop_fn, offset, "fast")

    if fast.verified():
        return run(x_t)
    result = fast.run("denoise", lambda: run(x_t.clone()))  # x_t replaced only on success
    return None if result is None else x_t.copy_(result)


def backport_policy(ctx, module) -> None:
    """0.5.17: the action expert takes a hoisted denoise layout (0.5.19)."""
    # Bound by `from ... import` when pi05_policy was imported before activation: 0.5.17's __init__
    # builds a runner through this name (replaced right after).
    ctx.setattr(module, "VLADenoiseGraphRunner", VLADenoiseGraphRunner)
    ctx.setattr(module, "VLADenoiseGraphSignature", VLADenoiseGraphSignature)
    ctx.setattr(module.Pi05ActionExpert, "forward", action_expert_forward)


def patch_policy(ctx, module) -> None:
    cls = module.Pi05PolicyModel
    graphs = PolicyGraphs(ctx, cls.__dict__["__init__"])

    @functools.wraps(graphs.sglang_init)
    def __init__(self, config, **kwargs):  # sglang's constructor, then our runners (_build_graphs)
        graphs.sglang_init(self, config, **kwargs)
        _build_graphs(self, graphs)

    __init__.graphs = graphs
    for method in (__init__, _prefix_tensor_parallel_enabled, _prefix_cuda_graph_enabled,
                   _prompt_token_bucketing_enabled, build_prefix_cache_key, encode_prefix, denoise_step,
                   sample_actions):
        ctx.setattr(cls, method.__name__, method)
