"""Action metadata reports the Pi0.5 graph settings (prefix/action availability, capacities, buckets).

Target symbols:
    sglang.multimodal_gen.runtime.entrypoints.vla.protocol.action_metadata
        (replaced; rebound in entrypoints.vla.api and entrypoints.vla.ws_utils,
        which import it by name)
    new module alias sglang.multimodal_gen.runtime.entrypoints.action.protocol
        (0.5.18 renamed entrypoints/vla to entrypoints/action; upstream tests
        import the new path)
sglang versions: 0.5.17 (fingerprint-gated; 0.5.19 reports the same block upstream).
Upstream PR: the Pi0.5 bounded-graph PR released in 0.5.19 (supersedes #34588).

Why: 0.5.17 reports `cuda_graph` from `enable_action_cuda_graph` alone, so a
client sees "auto" even when the action graph is disabled by capacity 0 or by
action-expert offload, and nothing about the prefix graph or prompt buckets.

How: 0.5.17's function with upstream 0.5.19's additions: `runtime.cuda_graph =
{prefix_enabled, prefix_max_entries, action_enabled, action_max_entries,
prompt_token_buckets}` from `Pi05PipelineConfig.prefix_cuda_graph_available()`
/ `action_cuda_graph_available()` (patch `pi05_config`), and
`defaults.cuda_graph` / `capabilities.cuda_graph` = either graph available.
Beyond upstream: `runtime.cuda_graph_mode` = "bucket" (buckets configured and a
graph available), "exact" or "off". Like upstream these are the configuration's
answers; per-process conditions the HTTP process cannot see (prefix TP, runtime
role, device) are decided by the policy in the worker. 0.5.17's other fields
("model" = model_id or model_path, no kv_gather_degree) are kept.

Retire when: the minimum supported sglang is >= 0.5.19.
"""

from __future__ import annotations

import sys

from sglang_ext.patching import install_module

_ACTION_PROTOCOL = "sglang.multimodal_gen.runtime.entrypoints.action.protocol"


def _ext_pi05_cuda_graph_metadata(pipeline_config) -> dict:
    """The graph settings block; configs without the 0.5.19 methods report 0.5.17's flag."""
    action_flag = bool(getattr(pipeline_config, "enable_action_cuda_graph", False))
    prefix_available = getattr(pipeline_config, "prefix_cuda_graph_available", None)
    action_available = getattr(pipeline_config, "action_cuda_graph_available", None)
    return {
        "prefix_enabled": bool(prefix_available()) if callable(prefix_available) else False,
        "prefix_max_entries": getattr(pipeline_config, "prefix_cuda_graph_max_entries", 0),
        "action_enabled": bool(action_available()) if callable(action_available) else action_flag,
        "action_max_entries": getattr(pipeline_config, "action_cuda_graph_max_entries", None),
        "prompt_token_buckets": list(getattr(pipeline_config, "prompt_token_buckets", ())),
    }


def action_metadata(server_args):
    pipeline_config = server_args.pipeline_config
    policy_family = getattr(
        pipeline_config,
        "policy_family",
        type(pipeline_config).__name__.removesuffix("PipelineConfig").lower(),
    )
    cuda_graph = _ext_pi05_cuda_graph_metadata(pipeline_config)
    any_graph = cuda_graph["prefix_enabled"] or cuda_graph["action_enabled"]
    if not any_graph:
        cuda_graph_mode = "off"
    elif cuda_graph["prompt_token_buckets"]:
        cuda_graph_mode = "bucket"
    else:
        cuda_graph_mode = "exact"
    return {
        "object": "action.metadata",
        "model": server_args.model_id or server_args.model_path,
        "model_path": server_args.model_path,
        "policy_family": policy_family,
        "input": {
            "image_keys": list(pipeline_config.image_keys),
            "image_size": list(pipeline_config.image_size),
            "state_dim": pipeline_config.state_dim,
        },
        "output": {
            "action_type": "continuous",
            "action_horizon": pipeline_config.action_horizon,
            "action_dim": pipeline_config.output_action_dim,
            "padded_action_dim": pipeline_config.action_dim,
            "dtype": "float32",
        },
        "runtime": {
            "materialize_dtype": pipeline_config.materialize_dtype,
            "enable_autocast": pipeline_config.enable_autocast,
            "cuda_graph": cuda_graph,
            "cuda_graph_mode": cuda_graph_mode,
            "parallelism": {
                "num_gpus": server_args.num_gpus,
                "tp_size": server_args.tp_size,
                "sp_degree": server_args.sp_degree,
                "ulysses_degree": server_args.ulysses_degree,
                "ring_degree": server_args.ring_degree,
                "prefix_strategy": pipeline_config.prefix_parallel_strategy,
                "action_strategy": pipeline_config.action_parallel_strategy,
                "layout_version": pipeline_config.parallel_layout_version,
            },
        },
        "defaults": {
            "num_inference_steps": pipeline_config.default_num_inference_steps,
            "prefix_cache": ("auto" if pipeline_config.enable_global_prefix_cache else False),
            "cuda_graph": "auto" if any_graph else False,
        },
        "capabilities": {
            "exact_prefix_cache": True,
            "cuda_graph": any_graph,
            "realtime_websocket": True,
            "openpi_websocket": True,
            "batch_inputs": False,
            "multiple_candidates": False,
        },
    }


def patch_protocol(ctx, module) -> None:
    """Part for `...entrypoints.vla.protocol`: replace action_metadata, alias the 0.5.18+ path."""
    ctx.transplant_function(module, action_metadata)
    install_module(ctx, _ACTION_PROTOCOL, module)


def rebind_action_metadata(ctx, module) -> None:
    """Part for `...entrypoints.vla.api` / `.ws_utils`: they bound the name at import.

    A module imported after `patch_protocol` already holds the replacement; one
    imported before it (activation after import) still holds 0.5.17's function.
    """
    protocol = sys.modules["sglang.multimodal_gen.runtime.entrypoints.vla.protocol"]
    ctx.setattr(module, "action_metadata", protocol.action_metadata)
