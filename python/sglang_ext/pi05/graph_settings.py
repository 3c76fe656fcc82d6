"""Pi0.5 graph settings: the pipeline config's graph fields (0.5.19's defaults where a config lacks
them), each overridable by an `--ext-pi05-*` knob, read when a config or policy is built.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from sglang_ext import knobs


@dataclass
class GraphConfigFields:
    """The dataclass fields upstream 0.5.19 has and 0.5.17 lacks (upstream defaults)."""

    enable_prefix_cuda_graph: bool = True
    prompt_token_buckets: list[int] = field(default_factory=list)
    prefix_cuda_graph_max_entries: int = 1
    action_cuda_graph_max_entries: int = 4


GRAPH_FIELDS = fields(GraphConfigFields)

# config field -> knob that overrides it ("-1" / empty = keep the config value).
KNOB_OF = {"prefix_cuda_graph_max_entries": "pi05_prefix_graph_max_entries",
           "action_cuda_graph_max_entries": "pi05_action_graph_max_entries",
           "prompt_token_buckets": "pi05_prompt_token_buckets"}

# Prefix graphs need the prefix modules resident: any of these offload settings turns them off.
PREFIX_OFFLOAD_FLAGS = ("offload_prefix_image_encoder", "offload_prefix_image_encoder_after_embed",
                        "offload_prefix_token_embedding", "offload_prefix_language_layers",
                        "offload_prefix_language_layers_after_prefix", "empty_cache_after_prefix")


def default(graph_field):
    return graph_field.default_factory() if graph_field.default_factory is not MISSING else graph_field.default


def knob_override(field_name: str):
    """The knob's value for a config field, or None when the knob is unset."""
    value = knobs.current(KNOB_OF[field_name])
    if value == -1 or value == ():
        return None
    return list(value) if isinstance(value, tuple) else value


def setting(config, field_name: str):
    """The knob when set, else the config field (upstream's default if the config lacks it)."""
    override = knob_override(field_name)
    return _field(config, field_name) if override is None else override


def _field(config, name: str):
    return getattr(config, name, default(next(f for f in GRAPH_FIELDS if f.name == name)))


def prefix_graph_available(config) -> bool:
    """Upstream's `prefix_cuda_graph_available`."""
    offloaded = (any(getattr(config, name, False) for name in PREFIX_OFFLOAD_FLAGS)
                 or getattr(config, "offload_prefix_language_layer_count_after_prefix", 0) > 0)
    return bool(getattr(config, "enable_prefix_cuda_graph", True)
                and _field(config, "prefix_cuda_graph_max_entries") > 0 and not offloaded)


def action_graph_available(config) -> bool:
    """Upstream's `action_cuda_graph_available`."""
    return bool(getattr(config, "enable_action_cuda_graph", True)
                and _field(config, "action_cuda_graph_max_entries") > 0
                and not getattr(config, "offload_action_expert_after_denoise", False))
