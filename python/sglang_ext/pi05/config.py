"""Pi0.5 graph settings on `Pi05PipelineConfig` (0.5.19's fields) validated at start-up; misspelled keys rejected.

Patch: pi05_config
Targets: sglang.multimodal_gen.configs.pipeline_configs.pi05:Pi05PipelineConfig
Upstream PR: sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)
Retire when: the minimum supported sglang has the graph config fields (>= 0.5.19) and rejects misspelled pipeline
config keys

Releases: 0.5.23 (fields upstream: knobs, stricter checks, misspelled keys), 0.5.17 (the fields backported).
Why: graph settings belong on the config, checked at start-up; `update_pipeline_config` silently drops a typo.
How: 0.5.17 gets the four fields (and 0.5.19's `vla.prompt_bucketing`); `__post_init__` applies the
`--ext-pi05-*` knobs, then validates; graph-like unknown keys raise.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import MISSING, fields

from sglang.multimodal_gen.configs.pipeline_configs.base import PipelineConfig
from sglang_ext import knobs as _ext_knobs
from sglang_ext.pi05 import graph_settings as _ext_pi05_settings
from sglang_ext.errors import ExtConfigError
from sglang_ext.graphs.keys import _is_int
from sglang_ext.patching import install_module

# Keys a misspelling is checked against: the new fields and 0.5.17's action flag.
_EXT_PI05_GRAPH_KEYS = tuple(f.name for f in _ext_pi05_settings.GRAPH_FIELDS) + ("enable_action_cuda_graph",)


def config_init(upstream):
    """0.5.17's generated __init__ knows neither the new fields nor __post_init__."""

    @functools.wraps(upstream)
    def __init__(self, *args, **kwargs):
        defaults = _ext_pi05_settings.GraphConfigFields()
        for graph_field in _ext_pi05_settings.GRAPH_FIELDS:
            setattr(self, graph_field.name, kwargs.pop(graph_field.name, getattr(defaults, graph_field.name)))
        upstream(self, *args, **kwargs)
        self.__post_init__()

    return __init__


def __post_init__(self) -> None:
    """Apply the `--ext-pi05-*` knobs set, then validate (an error names the knobs applied)."""
    overrides = []
    for field_name, knob_name in _ext_pi05_settings.KNOB_OF.items():
        value = _ext_pi05_settings.knob_override(field_name)
        if value is not None:
            setattr(self, field_name, value)
            knob = _ext_knobs.knob(knob_name)
            overrides.append(f"{field_name} (from {knob.flag} / {knob.env})")
    try:
        self._validate_cuda_graph_config()
    except ValueError as exc:
        if not overrides:
            raise
        raise ValueError(f"{exc}; overridden: {', '.join(overrides)}") from exc


def _validate_cuda_graph_config(self) -> None:
    raw = self.prompt_token_buckets
    if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
        raise ValueError(f"prompt_token_buckets must contain integers, got {raw!r}")
    buckets = list(raw)
    for index, bucket in enumerate(buckets):
        if not _is_int(bucket):
            raise ValueError(f"prompt_token_buckets must contain integers (not bool), got {bucket!r} at index {index}")
        if bucket <= 0:
            raise ValueError(f"prompt_token_buckets must contain positive lengths, got {bucket} at index {index}")
        if index and bucket <= buckets[index - 1]:
            raise ValueError(f"prompt_token_buckets must be strictly increasing and unique, got {buckets} "
                             f"({bucket} at index {index} follows {buckets[index - 1]})")
    if buckets and buckets[-1] > self.max_token_len:
        raise ValueError(f"prompt_token_buckets cannot exceed max_token_len ({self.max_token_len}), got {buckets[-1]}")
    for name in ("prefix_cuda_graph_max_entries", "action_cuda_graph_max_entries"):
        value = getattr(self, name)
        if not _is_int(value):
            raise ValueError(f"{name} must be an integer (not bool), got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be non-negative (0 disables these graphs), got {value}")
        setattr(self, name, int(value))
    self.prompt_token_buckets = [int(bucket) for bucket in buckets]


def check_pipeline_config(self) -> None:
    """0.5.17: the base's checks, then the graph fields' (0.5.23's own does both)."""
    PipelineConfig.check_pipeline_config(self)
    self._validate_cuda_graph_config()


def update_pipeline_config(self, source_pipeline_dict) -> None:
    known = {f.name for f in fields(self)}
    for key in source_pipeline_dict:
        if not isinstance(key, str) or key in known:
            continue
        close = difflib.get_close_matches(key, _EXT_PI05_GRAPH_KEYS, n=1, cutoff=0.8)
        if close or "cuda_graph" in key or "token_bucket" in key:
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ExtConfigError(f"unknown Pi0.5 pipeline config key {key!r}: {hint}"
                                 f"allowed graph keys: {', '.join(_EXT_PI05_GRAPH_KEYS)}")
    PipelineConfig.update_pipeline_config(self, source_pipeline_dict)


def patch_pipeline_config(ctx, module) -> None:
    cls = module.Pi05PipelineConfig
    if "prompt_token_buckets" not in cls.__dataclass_fields__:  # 0.5.17: the fields backported
        for graph_field in _ext_pi05_settings.GRAPH_FIELDS:
            ctx.setitem(cls.__dataclass_fields__, graph_field.name, graph_field)
            # For instances unpickled from a process without the patch; a tuple, never a shared list.
            fallback = () if graph_field.default_factory is not MISSING else graph_field.default
            ctx.setattr(cls, graph_field.name, fallback)
        ctx.setattr(cls, "__init__", config_init(cls.__dict__["__init__"]))
        ctx.setattr(cls, "prefix_cuda_graph_available", _ext_pi05_settings.prefix_graph_available)
        ctx.setattr(cls, "action_cuda_graph_available", _ext_pi05_settings.action_graph_available)
        ctx.setattr(cls, "check_pipeline_config", check_pipeline_config)
    for method in (__post_init__, _validate_cuda_graph_config, update_pipeline_config):
        ctx.setattr(cls, method.__name__, method)


def install_prompt_bucketing(ctx, module) -> None:
    """Part for `sglang.multimodal_gen.runtime.vla` (before 0.5.19): add upstream's prompt_bucketing module."""
    from sglang_ext.pi05 import prompt_bucketing

    install_module(ctx, f"{module.__name__}.prompt_bucketing", prompt_bucketing)
