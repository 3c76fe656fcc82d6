"""Action metadata reports the Pi0.5 graph settings (prefix/action availability, capacities, prompt buckets).

Patch: pi05_config
Targets: sglang.multimodal_gen.runtime.entrypoints.action.protocol:action_metadata
Upstream PR: sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)
Retire when: the minimum supported sglang has the graph config fields (>= 0.5.19) and rejects misspelled pipeline
config keys

Why: 0.5.17 answers `cuda_graph` from `enable_action_cuda_graph` alone ("auto" even when the
action graph is off) and says nothing about the prefix graph; its HTTP process reports the default
cameras, not the checkpoint's.
How: wrapped: 0.5.19's `runtime.cuda_graph` block (the plan the workers resolve) and
`runtime.cuda_graph_mode`, the checkpoint's cameras; 0.5.18's `entrypoints.action.protocol` aliased
(upstream's tests import it); api and ws_utils rebound.
"""

from __future__ import annotations

import functools
import importlib

from sglang_ext.patching import install_module
from sglang_ext.pi05 import graph_settings
from sglang_ext.pi05.checkpoint_cameras import checkpoint_cameras

_ACTION_PROTOCOL = "sglang.multimodal_gen.runtime.entrypoints.action.protocol"


def _our_graphs() -> bool:
    """Whether sglang-ext's Pi0.5 graphs (patch pi05_graphs) serve here; else sglang's own, as configured."""
    from sglang_ext import activation

    status = activation.statuses().get("pi05_graphs")
    return status is not None and status.state in (activation.ARMED, activation.APPLIED)


def _cuda_graph_block(config) -> dict:
    """The graph settings the workers resolve (graph_settings.resolve_plan) from the pipeline config; a config
    without the 0.5.19 methods reports 0.5.17's action flag."""
    prefix_available = getattr(config, "prefix_cuda_graph_available", None)
    action_available = getattr(config, "action_cuda_graph_available", None)
    plan = graph_settings.resolve_plan(config) if callable(prefix_available) and _our_graphs() else None
    return {
        "prefix_enabled": callable(prefix_available) and bool(prefix_available()),
        "prefix_max_entries": plan.prefix_entries if plan else getattr(config, "prefix_cuda_graph_max_entries", 0),
        "action_enabled": bool(action_available() if callable(action_available)
                               else getattr(config, "enable_action_cuda_graph", False)),
        "action_max_entries": plan.action_entries if plan else getattr(config, "action_cuda_graph_max_entries", None),
        "prompt_token_buckets": list(plan.prompt_buckets if plan else getattr(config, "prompt_token_buckets", ())),
    }


def _with_graph_settings(original):
    @functools.wraps(original)
    def action_metadata(server_args):
        metadata = original(server_args)
        metadata["input"]["image_keys"] = list(checkpoint_cameras(server_args))
        block = _cuda_graph_block(server_args.pipeline_config)
        any_graph = block["prefix_enabled"] or block["action_enabled"]
        runtime = metadata["runtime"]
        runtime["cuda_graph"] = block
        runtime["cuda_graph_mode"] = ("bucket" if block["prompt_token_buckets"] else "exact") if any_graph else "off"
        runtime["parallelism"] = runtime.pop("parallelism")  # keeps 0.5.19's key order
        metadata["defaults"]["cuda_graph"] = "auto" if any_graph else False
        metadata["capabilities"]["cuda_graph"] = any_graph
        return metadata

    return action_metadata


def patch_protocol(ctx, module) -> None:
    """Part for `...entrypoints.action.protocol`: wrap action_metadata; on 0.5.17 (`entrypoints.vla`) alias
    0.5.18's path."""
    ctx.setattr(module, "action_metadata", _with_graph_settings(module.action_metadata))
    if module.__name__ != _ACTION_PROTOCOL:
        install_module(ctx, _ACTION_PROTOCOL, module)


def rebind_action_metadata(ctx, module) -> None:
    """Part for `...entrypoints.action.api` / `.ws_utils`, which bound the name at import."""
    ctx.setattr(module, "action_metadata", importlib.import_module(".protocol", module.__package__).action_metadata)
