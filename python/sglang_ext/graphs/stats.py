"""Process-wide registry of graph-cache counters (`sglang-ext doctor`, Prometheus).
Registrations are weak, so runners that die leave `snapshot()` by themselves.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

# name -> a resolver returning the live info callable, or None once its object died
_registry: Dict[str, Callable[[], Optional[Callable[[], Any]]]] = {}


def _read(name: str) -> Optional[Dict[str, Any]]:
    """One registration's counters, not copied (a CacheInfo's fields are plain values)."""
    fn = _registry[name]()
    if fn is None:
        return None
    info = fn()
    return info if isinstance(info, dict) else vars(info)


def _weak_callable(info_fn: Callable[[], Any], owner: Any) -> Callable[[], Optional[Callable[[], Any]]]:
    """A resolver returning `info_fn` while its object (and `owner`) live, else None."""
    owner_ref = weakref.ref(owner) if owner is not None else None
    is_method = hasattr(info_fn, "__self__") and hasattr(info_fn, "__func__")
    # Held weakly: a strong bound method would keep its object alive.
    fn_ref = weakref.WeakMethod(info_fn) if is_method else (lambda: info_fn)
    return lambda: None if owner_ref is not None and owner_ref() is None else fn_ref()


def register(name: str, info_fn: Callable[[], Any], *, owner: Any = None) -> str:
    """Register `info_fn` (a CacheInfo or dict) under `name` (or `name#2`, ...); returns the name used."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: {name!r} is not allowed; allowed: a non-empty string")
    if not callable(info_fn):
        raise ValueError(f"info_fn: {info_fn!r} is not allowed; allowed: a callable returning CacheInfo or dict")
    _drop_dead()
    used, n = name, 1
    while used in _registry:
        n += 1
        used = f"{name}#{n}"
    _registry[used] = _weak_callable(info_fn, owner)
    return used


def snapshot() -> Dict[str, Dict[str, Any]]:
    """Counters of every live registration, by name (sorted)."""
    _drop_dead()
    return {name: dict(values) for name in sorted(_registry) if (values := _read(name)) is not None}


def _drop_dead() -> None:
    for dead in [name for name, resolve in _registry.items() if resolve() is None]:
        del _registry[dead]


# Registration name (before ":" or "#") -> the `cache` label of the sglang_ext_graph_* metrics.
CACHE_LABELS = {"vit_cuda_graph": "vit_cuda_graph", "vla.prefix": "pi05_prefix_graph",
                "vla.action-denoise": "pi05_action_graph", "prefill_cp_bucket": "prefill_cp_bucket"}
PREFIX = "sglang_ext_"
# family -> (type, help). Counters are exposed with the `_total` suffix.
_FAMILIES = {
    "graph_hits": ("counter", "Runner calls served by a resident graph"),
    "graph_misses": ("counter", "Lookups that found no resident graph"),
    "graph_captures": ("counter", "Graphs captured"),
    "graph_evictions": ("counter", "Graphs evicted to make room (released with reset())"),
    "graph_eager_fallbacks": ("counter", "Runner calls that ran eager instead of a graph, by reason"),
    "graph_padding_tokens": ("counter", "Padding rows added to reach a graph's size"),
    "graph_chunked_calls": ("counter", "Runner calls split into chunks of whole sequences"),
    "graph_resident": ("gauge", "Graphs resident now"),
    "graph_resident_bytes": ("gauge", "Bytes held by resident graphs' static buffers"),
    "graph_capacity": ("gauge", "Most graphs a cache keeps (max entries)"),
    "graph_max_bytes": ("gauge", "Byte budget of a cache's resident graphs (0 = no byte limit)"),
    "cuda_memory_reserved_bytes": ("gauge", "torch.cuda.memory_reserved() of this process"),
}
# Source fields of each family, whichever registration kind has them (first present wins).
_COUNTER_FIELDS = {
    "graph_hits": ("hits", "admitted"),
    "graph_misses": ("misses",),
    "graph_captures": ("captures",),
    "graph_evictions": ("evictions",),
    "graph_padding_tokens": ("padding_tokens", "padding_rows_total"),
    "graph_chunked_calls": ("chunked_calls",),
}
_FALLBACK_FIELDS = {"rejections": "capacity", "failures": "capture_failed",
                    "rejected_no_fit": "no_fit", "rejected_unknown_layout": "unknown_layout",
                    "sealed_misses": "no_graph_after_load"}
_GAUGE_FIELDS = {"graph_resident": ("size",), "graph_resident_bytes": ("bytes_resident",),
                 "graph_capacity": ("capacity", "max_entries"), "graph_max_bytes": ("max_bytes",)}

_prom: Dict[str, Any] = {"on": None, "metrics": None, "last": {}, "gauges": {}, "children": {}, "reserved": None}


def cache_label(name: str) -> Optional[str]:
    return CACHE_LABELS.get(name.split("#")[0].split(":")[0])


def _metric_values(values: Dict[str, Any]):
    """(counters {(family, reason)}: int, gauges {family: int}) of one registration's snapshot."""
    def first(fields):
        return next((int(values[field]) for field in fields if field in values), None)

    counters: Dict[Tuple[str, str], int] = {(family, ""): value for family, fields in _COUNTER_FIELDS.items()
                                            if (value := first(fields)) is not None}
    if "fallbacks" in values:  # the ViT runner: fallback_<reason> per reason
        reasons = {k[len("fallback_"):]: v for k, v in values.items() if k.startswith("fallback_")}
    else:
        reasons = {reason: values[field] for field, reason in _FALLBACK_FIELDS.items() if field in values}
    for reason, count in reasons.items():
        counters[("graph_eager_fallbacks", reason)] = int(count)
    return counters, {family: value for family, fields in _GAUGE_FIELDS.items() if (value := first(fields)) is not None}


def _create_metrics() -> Dict[str, Any]:
    import prometheus_client as prom  # only here: after PROMETHEUS_MULTIPROC_DIR is known to be set

    registry = prom.CollectorRegistry(auto_describe=True)  # this module's own (tests read it)
    metrics: Dict[str, Any] = {"registry": registry}
    for family, (kind, doc) in _FAMILIES.items():
        labels = () if family == "cuda_memory_reserved_bytes" else (
            ("cache", "reason") if family == "graph_eager_fallbacks" else ("cache",))
        cls = prom.Counter if kind == "counter" else prom.Gauge
        metrics[family] = cls(PREFIX + family, doc, labels, registry=registry)
    return metrics


def publish() -> None:
    """Counters as `sglang_ext_graph_*` metrics (advanced by their change since the last publish) when
    PROMETHEUS_MULTIPROC_DIR is set (sglang's `--enable-metrics`); else one check."""
    if _prom["on"] is None:
        _prom["on"] = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    if not _prom["on"]:
        return
    try:
        _publish()
    except Exception as exc:  # noqa: BLE001 - metrics must never break a runner
        _prom["on"] = False
        logging.getLogger("sglang_ext").warning("sglang-ext: Prometheus metrics switched off: %s: %s",
                                                type(exc).__name__, exc)


def _child(family: str, label: str, reason: str = ""):
    key = (family, label, reason)
    if key not in _prom["children"]:  # labels() locks and validates: once per series
        metric = _prom["metrics"][family]
        _prom["children"][key] = metric.labels(label, reason) if reason else metric.labels(label)
    return _prom["children"][key]


def _publish() -> None:
    snap = {name: values for name in list(_registry)
            if cache_label(name) is not None and (values := _read(name)) is not None}
    if not snap and _prom["metrics"] is None:
        return  # no runner yet: create nothing
    if _prom["metrics"] is None:
        _prom["metrics"] = _create_metrics()
    last, last_gauges = _prom["last"], _prom["gauges"]
    gauges = dict.fromkeys(last_gauges, 0)  # a kind whose runners all died reads 0, not its last value
    for name, values in snap.items():
        label = cache_label(name)
        counters, now_gauges = _metric_values(values)
        before = last.get(name, {})
        for key, value in counters.items():
            prev = before.get(key, 0)
            delta = value - prev if value >= prev else value  # below: the cache was cleared
            if delta:
                _child(key[0], label, key[1]).inc(delta)
            elif key not in before:
                _child(key[0], label, key[1])  # a new runner's series shows 0, not nothing
        last[name] = counters
        for family, value in now_gauges.items():
            gauges[(family, label)] = gauges.get((family, label), 0) + value
    for name in [n for n in last if n not in snap]:
        del last[name]  # a dead runner: what it counted stays counted
    for key, value in gauges.items():
        if last_gauges.get(key) != value:
            _child(key[0], key[1]).set(value)
            last_gauges[key] = value
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        reserved = torch.cuda.memory_reserved()
        if _prom["reserved"] != reserved:  # kept apart from last_gauges, whose keys are (family, cache)
            _prom["metrics"]["cuda_memory_reserved_bytes"].set(reserved)
            _prom["reserved"] = reserved
