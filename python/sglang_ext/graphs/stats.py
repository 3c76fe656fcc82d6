"""Process-wide registry of graph-cache counters (for `sglang-ext doctor` and debug logs).

Registrations are weak: a bound method (`cache.info`) is held through a
`WeakMethod`, or pass `owner=` to tie any callable to an object's lifetime, so
runners that die disappear from `snapshot()` without anyone unregistering them.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

_registry: Dict[str, "_Registration"] = {}
_last_log = [float("-inf")]


@dataclass(frozen=True)
class _Registration:
    info_fn: Callable[[], Optional[Callable[[], Any]]]  # returns the live info callable, or None once dead

    def read(self) -> Optional[Dict[str, Any]]:
        fn = self.info_fn()
        if fn is None:
            return None
        info = fn()
        return dict(info.as_dict() if hasattr(info, "as_dict") else info)


def _weak_callable(info_fn: Callable[[], Any], owner: Any) -> Callable[[], Optional[Callable[[], Any]]]:
    """A resolver returning `info_fn` while its object (and `owner`) live, else None."""
    owner_ref = weakref.ref(owner) if owner is not None else None
    if hasattr(info_fn, "__self__") and hasattr(info_fn, "__func__"):
        # Held weakly: a strong bound method would keep its object alive.
        method = weakref.WeakMethod(info_fn)
        return lambda: None if owner_ref is not None and owner_ref() is None else method()
    return lambda: None if owner_ref is not None and owner_ref() is None else info_fn


def register(name: str, info_fn: Callable[[], Any], *, owner: Any = None) -> str:
    """Register `info_fn` (returns a CacheInfo or dict) under `name`; returns the name used.

    A name already held by a live registration gets a suffix (`name#2`), so two
    runners of the same kind in one process are both visible.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: {name!r} is not allowed; allowed: a non-empty string")
    if not callable(info_fn):
        raise ValueError(f"info_fn: {info_fn!r} is not allowed; allowed: a callable returning CacheInfo or dict")
    _drop_dead()
    used, n = name, 1
    while used in _registry:
        n += 1
        used = f"{name}#{n}"
    _registry[used] = _Registration(_weak_callable(info_fn, owner))
    return used


def unregister(name: str) -> None:
    _registry.pop(name, None)


def _drop_dead() -> None:
    for name in [n for n, r in _registry.items() if r.info_fn() is None]:
        del _registry[name]


def snapshot() -> Dict[str, Dict[str, Any]]:
    """Counters of every live registration, by name (sorted)."""
    out = {}
    for name in sorted(_registry):
        values = _registry[name].read()
        if values is None:
            del _registry[name]
        else:
            out[name] = values
    return out


def maybe_log(logger: logging.Logger, interval_s: float) -> bool:
    """Debug-log a one-line summary per cache, at most once per `interval_s`; returns whether it logged.

    `interval_s == 0` means never (the knob's documented meaning). Time only gates
    logging here, never a graph decision.
    """
    if interval_s < 0:
        raise ValueError(f"interval_s: {interval_s!r} is not allowed; allowed: numbers >= 0 (0 = never)")
    if interval_s == 0:
        return False
    now = time.monotonic()
    if not logger.isEnabledFor(logging.DEBUG) or now - _last_log[0] < interval_s:
        return False
    _last_log[0] = now
    for name, values in snapshot().items():
        logger.debug("sglang-ext graphs %s: %s", name, " ".join(f"{k}={v}" for k, v in values.items() if k != "name"))
    return True
