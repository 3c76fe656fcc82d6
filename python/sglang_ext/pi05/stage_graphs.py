"""Pi0.5 prefix stage: the request's graph option reaches the policy; prefix-graph outputs owned while requests wait.

Patch: pi05_graphs
Targets: sglang.multimodal_gen.runtime.pipelines_core.stages.vla:_grouped_fingerprint,
sglang.multimodal_gen.runtime.pipelines_core.stages.vla:VLAPrefixEncodingStage.forward,
sglang.multimodal_gen.runtime.pipelines_core.stages.vla:VLAPrefixEncodingStage.run_grouped_requests,
sglang.multimodal_gen.runtime.pipelines_core.stages.vla:VLAPrefixEncodingStage._send_prefix_result
Upstream PR: sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)
Retire when: upstream keys the action-graph K/V refresh on something id()-free and the minimum supported sglang has
vla/cuda_graph.py (>= 0.5.19)

Why: 0.5.17's prefix stage calls the policy without the request's `enable_cuda_graph` option,
and a prefix-graph output (rewritten by the next replay) must not be shared by two requests.
How: during a request the policy is seen through a view that owns the graph's output while several requests
are in flight and, on 0.5.17, passes the option on (grouping keys on it). Releases: 0.5.23, 0.5.17.
"""

from __future__ import annotations

import contextvars
import functools

from sglang.multimodal_gen.runtime.pipelines_core.stages.vla import (_effective_prefix_cache_enabled, vla_options,
                                                                     vla_state)
from sglang_ext.pi05.vla_cuda_graph import own_prefix_context


def _cuda_graph_enabled(batch) -> bool:
    return bool(vla_options(batch).get("enable_cuda_graph", True))


class _RequestPolicy:
    """The stage's policy as one request sees it (every other attribute is the policy's)."""

    def __init__(self, policy, graphs: bool, prefix_cache: bool, owned: bool):
        self._policy, self._graphs, self._prefix_cache, self._owned = policy, graphs, prefix_cache, owned

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def build_prefix_cache_key(self, observation, **options):  # 0.5.23 passes the options, 0.5.17 none
        return self._policy.build_prefix_cache_key(observation, **(options or {"bucket_prompt": self._graphs}))

    def encode_prefix(self, observation, **options):
        # A prefix-graph output is rewritten by the next replay: it never goes into the prefix cache.
        context = self._policy.encode_prefix(observation, **(options or {
            "use_cuda_graph": self._graphs and not self._prefix_cache, "bucket_prompt": self._graphs}))
        return own_prefix_context(context) if self._owned else context


def _note_prompt_bucket(batch) -> None:
    state = vla_state(batch)
    cache, context = state.get("cache"), state.get("prefix_context")
    if isinstance(cache, dict) and context is not None:
        cache.setdefault("prompt_token_bucket", context.layout.get("prompt_token_bucket"))


# Requests the prefix stage's run_grouped_requests is running (it calls forward for each, on its thread).
_REQUESTS_IN_FLIGHT: contextvars.ContextVar = contextvars.ContextVar("sglang_ext_pi05_requests_in_flight", default=1)


def forward(upstream):
    @functools.wraps(upstream)
    def forward(self, batch, server_args):
        policy = self.policy_model
        self.policy_model = _RequestPolicy(policy, _cuda_graph_enabled(batch),
                                           _effective_prefix_cache_enabled(batch, server_args),
                                           _REQUESTS_IN_FLIGHT.get() > 1)
        try:
            batch = upstream(self, batch, server_args)
        finally:
            self.policy_model = policy
        _note_prompt_bucket(batch)
        return batch

    return forward


def _send_prefix_result(upstream):
    @functools.wraps(upstream)
    def _send_prefix_result(self, batch, split, prefix_context):
        _note_prompt_bucket(batch)  # before the cache info goes to the other ranks
        return upstream(self, batch, split, prefix_context)

    return _send_prefix_result


def run_grouped_requests(upstream):
    """While more than one request is in flight, prefix-graph outputs are owned per request."""

    @functools.wraps(upstream)
    def run_grouped_requests(self, batches, server_args):
        token = _REQUESTS_IN_FLIGHT.set(len(batches))
        try:
            return upstream(self, batches, server_args)
        finally:
            _REQUESTS_IN_FLIGHT.reset(token)

    return run_grouped_requests


def _with_graph_option(original):
    @functools.wraps(original)
    def _grouped_fingerprint(batch, server_args):
        fingerprint = original(batch, server_args)
        return fingerprint if fingerprint[0] == "single" else (*fingerprint, _cuda_graph_enabled(batch))

    return _grouped_fingerprint


def _wrap(ctx, cls, *wrappers) -> None:
    for wrap in wrappers:
        ctx.setattr(cls, wrap.__name__, wrap(cls.__dict__[wrap.__name__]))


def patch_stages(ctx, module) -> None:
    _wrap(ctx, module.VLAPrefixEncodingStage, forward, run_grouped_requests)


def backport_stages(ctx, module) -> None:
    """0.5.17: grouping keys on the graph option, the prompt bucket is reported (0.5.19)."""
    ctx.setattr(module, "_grouped_fingerprint", _with_graph_option(module._grouped_fingerprint))
    _wrap(ctx, module.VLAPrefixEncodingStage, _send_prefix_result)
