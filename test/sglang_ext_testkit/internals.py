"""Test-only views of sglang-ext's internal state (not part of the package's API)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from sglang_ext import patching
from sglang_ext.graphs import stats


def pending_triggers() -> Dict[str, int]:
    """Callbacks still waiting for their trigger module to be imported, by module."""
    with patching._lock:
        return {k: len(v) for k, v in patching._pending.items()}


def is_quarantined(cache: Any, key: Any) -> bool:
    return key in cache._quarantine


def quarantine_reason(cache: Any, key: Any) -> Optional[str]:
    entry = cache._quarantine.get(key)
    return None if entry is None else entry.reason


def lease_released(lease: Any) -> bool:
    return lease._backing is None


def live_leases(pool: Any) -> int:
    """Leases not yet released, over every backing buffer a workspace pool still holds."""
    return sum(b.leases for b in pool._alive())


def metrics_registry(stats_module: Any = stats):
    """The CollectorRegistry holding this process's sglang-ext metrics (None before the first publish);
    `stats_module`: sglang_ext's, or the patched tree's copy."""
    metrics = stats_module._prom["metrics"]
    return None if metrics is None else metrics["registry"]


def unregister(name: str) -> None:
    """Drop a graph-cache registration (tests that register their own caches)."""
    stats._registry.pop(name, None)
