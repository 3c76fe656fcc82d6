"""Pi0.5 graph settings: the pipeline config's graph fields (0.5.19's defaults where a config lacks them),
each overridable by an `--ext-pi05-*` knob, and the `GraphPlan` a policy resolves from them once."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from sglang_ext import knobs
from sglang_ext.graphs.buckets import geometric_buckets


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
    value = getattr(config, name, MISSING)  # the default only for a config without the field (read per request)
    return getattr(GraphConfigFields(), name) if value is MISSING else value


def _segmented(config) -> bool:  # 0.5.23's segmented actions denoise eagerly: no graphs (upstream's rule)
    return bool(getattr(config, "enable_segmented_actions", False))


def prefix_graph_available(config) -> bool:
    """Upstream's `prefix_cuda_graph_available`."""
    offloaded = (any(getattr(config, name, False) for name in PREFIX_OFFLOAD_FLAGS)
                 or getattr(config, "offload_prefix_language_layer_count_after_prefix", 0) > 0)
    return bool(getattr(config, "enable_prefix_cuda_graph", True) and not _segmented(config)
                and _field(config, "prefix_cuda_graph_max_entries") > 0 and not offloaded)


def action_graph_available(config) -> bool:
    """Upstream's `action_cuda_graph_available`."""
    return bool(getattr(config, "enable_action_cuda_graph", True) and not _segmented(config)
                and _field(config, "action_cuda_graph_max_entries") > 0
                and not getattr(config, "offload_action_expert_after_denoise", False))


def prompt_ladder(max_token_len: int) -> tuple:
    """Prompt buckets up to `max_token_len` (the tokenizer pads or cuts every prompt to it), the last one it."""
    largest = max(int(max_token_len), 1)
    # The shortest prompts (task + state) fit the first, 32 tokens; each step pads a prompt by at most 25 %
    # (a prompt is a small part of a prefix that also holds 256 tokens per camera).
    ladder = geometric_buckets(min(32, largest), largest, ratio=1.25, multiple=16)
    return tuple(b for b in ladder if b < largest) + (largest,)


@dataclass(frozen=True)
class GraphPlan:
    """How a policy's graphs are captured and bounded, resolved once when the policy is built."""

    at_load: bool  # knob pi05_graph_capture: every bucket captured at load, nothing while serving
    prompt_buckets: tuple  # empty: exact prompt lengths (no padding)
    prefix_entries: int
    action_entries: int
    max_bytes: int  # per cache; 0 = no byte limit


def resolve_plan(config) -> GraphPlan:
    """The knobs and the config as one plan. At load each cache holds every bucket (a capacity knob caps it;
    a config capacity of 0 still switches those graphs off); lazy keeps upstream's capacities."""
    at_load = knobs.current("pi05_graph_capture") == "load"
    buckets = tuple(setting(config, "prompt_token_buckets") or ())
    if at_load and not buckets:
        buckets = prompt_ladder(getattr(config, "max_token_len", 200))

    def entries(field_name):
        configured = setting(config, field_name)
        if not at_load or knob_override(field_name) is not None or configured == 0:
            return configured
        return max(configured, len(buckets), 1)

    return GraphPlan(at_load=at_load, prompt_buckets=buckets, prefix_entries=entries("prefix_cuda_graph_max_entries"),
                     action_entries=entries("action_cuda_graph_max_entries"),
                     max_bytes=int(knobs.current("pi05_graph_max_bytes")))
