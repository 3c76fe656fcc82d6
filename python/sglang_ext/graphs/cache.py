"""A capacity-bounded cache of captured graphs with an explicit admission step.

Protocol for a runner (one cache per runner, single-threaded like sglang's runners):

    entry = cache.get(key)
    if entry is None:
        if cache.admit(key, expected_bytes=...).capture:   # may evict LRU entries NOW
            try:
                entry = capture(...)
            except Exception as exc:
                cache.fail(key, exc)                         # quarantined (transient: retried later)
            else:
                cache.put(key, entry, nbytes=...)
    run entry if there is one, else run eager

`admit` evicts before the capture so the evicted graph's pool memory is reused by the new one.
A sealed cache (`seal()`, for graphs captured at load) never captures again: a miss runs eager and
is counted in `sealed_misses`.
Decisions depend only on the calls (keys and the byte sizes passed in), never on free memory or time.
A transient failure (out of memory) quarantines the key for 2, 4, 8, ... of its next misses (at most
`MAX_RETRY_BACKOFF`), then retries it; any other failure stays quarantined until `clear()`.
"""

from __future__ import annotations

import enum
import functools
from collections import OrderedDict
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any, Callable, Dict, Generic, Hashable, Mapping, Optional, TypeVar

from sglang_ext.graphs import stats as _stats
from sglang_ext.graphs.keys import _check_int

K = TypeVar("K", bound=Hashable)
E = TypeVar("E")

POLICIES = ("lru", "exact")
# Bounded bookkeeping for keys that are NOT resident (warming counts, quarantine):
# a stream of distinct keys must not grow memory without bound.
MAX_TRACKED_KEYS = 4096
# Longest wait (in misses of the key) before a transiently failed key is captured again.
MAX_RETRY_BACKOFF = 1024


def is_transient_failure(exc: Optional[BaseException]) -> bool:
    """Whether a failed capture may succeed later: out of memory, matched by message (no torch needed)."""
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


@dataclass
class _Quarantined:
    reason: str
    transient: bool
    failures: int = 1  # consecutive failures (sets the backoff)
    wait: int = 0  # misses left before a transient key is tried again


def release_entry(entry: Any) -> None:
    """Default release: `entry.release()`, else `entry.graph.reset()`, else `entry.reset()`."""
    for release in (getattr(entry, "release", None), getattr(getattr(entry, "graph", None), "reset", None),
                    getattr(entry, "reset", None)):
        if callable(release):
            release()
            return


@dataclass(frozen=True)
class CacheInfo:
    name: str
    size: int
    capacity: int
    hits: int
    misses: int
    captures: int
    evictions: int
    rejections: int
    failures: int
    bytes_resident: int
    max_bytes: int
    policy: str
    min_hits: int = 1
    quarantined: int = 0
    sealed: bool = False
    sealed_misses: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


class Admission(enum.Enum):
    """What to do with a key that missed the cache."""

    CAPTURE = "capture"
    EAGER_CAPACITY = "eager_capacity"  # full and the policy keeps what it has (exact), or too big for the budget
    EAGER_WARMING = "eager_warming"  # anti-thrash: not seen min_hits times yet
    EAGER_QUARANTINED = "eager_quarantined"  # its capture failed before (transient: until its backoff ends)
    EAGER_DISABLED = "eager_disabled"  # capacity 0
    EAGER_SEALED = "eager_sealed"  # captured at load; nothing is captured while serving

    @property
    def capture(self) -> bool:
        return self is Admission.CAPTURE


def _publishes(method):
    """After the step: refresh this process's Prometheus metrics (a no-op unless they are on)."""
    @functools.wraps(method)
    def step(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            _stats.publish()

    return step


class BoundedGraphCache(Generic[K, E]):
    """At most `max_entries` graphs (and `max_bytes` bytes if > 0), in LRU order. `exact` keeps the
    first graphs; `min_hits` > 1 captures a key only on its min_hits-th sighting (one-off layouts do
    not evict graphs in use). `release` runs once for every entry dropped."""

    def __init__(self, name: str, max_entries: int, *, policy: str = "lru", max_bytes: int = 0, min_hits: int = 1,
                 release: Callable[[E], None] = release_entry) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: {name!r} is not allowed; allowed: a non-empty string")
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
        if not callable(release):
            raise ValueError(f"release: {release!r} is not allowed; allowed: a callable taking an entry")
        self.name = name
        self.capacity = _check_int("max_entries", max_entries, 0)
        self.max_bytes = _check_int("max_bytes", max_bytes, 0)
        self.min_hits = _check_int("min_hits", min_hits, 1)
        self.policy = policy
        self._release = release
        self._entries: "OrderedDict[K, E]" = OrderedDict()
        self._nbytes: Dict[K, int] = {}
        self._sightings: "OrderedDict[K, int]" = OrderedDict()
        # Failed keys -> reason (a string: a traceback would keep the capture's tensors alive), retry state.
        self._quarantine: "OrderedDict[K, _Quarantined]" = OrderedDict()
        self.sealed = False
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.hits = self.misses = self.captures = 0
        self.evictions = self.rejections = self.failures = self.sealed_misses = 0

    @_publishes
    def seal(self, sealed: bool = True) -> None:
        """Sealed: a miss never captures (EAGER_SEALED), what is resident stays. `clear()` keeps the seal."""
        self.sealed = bool(sealed)

    @_publishes
    def get(self, key: K) -> Optional[E]:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> Mapping[K, E]:
        """Read-only view of the resident entries, least recently used first."""
        return MappingProxyType(self._entries)

    @property
    def bytes_resident(self) -> int:
        return sum(self._nbytes.values())

    def retry_in(self, key: K) -> Optional[int]:
        """Misses of `key` left before it is tried again; None if not quarantined or permanent."""
        entry = self._quarantine.get(key)
        return entry.wait if entry is not None and entry.transient else None

    def _over_budget(self, extra_entries: int, extra_bytes: int) -> bool:
        if len(self._entries) + extra_entries > self.capacity:
            return True
        return self.max_bytes > 0 and self.bytes_resident + extra_bytes > self.max_bytes

    @_publishes
    def admit(self, key: K, *, expected_bytes: int = 0) -> Admission:
        """Decide whether to capture `key` (after a miss); `lru` evicts here, before the capture."""
        expected_bytes = _check_int("expected_bytes", expected_bytes, 0)
        if self.capacity == 0:
            return Admission.EAGER_DISABLED
        if self.sealed:
            self.sealed_misses += 1
            return Admission.EAGER_SEALED
        quarantined = self._quarantine.get(key)
        if quarantined is not None:
            self._quarantine.move_to_end(key)
            if not quarantined.transient or quarantined.wait > 0:
                quarantined.wait -= 1
                return Admission.EAGER_QUARANTINED
            # Backoff over: try again (a success forgets the failures, another failure doubles the wait).
        if key in self._entries:
            return Admission.CAPTURE  # a re-capture; put() replaces (and releases) the old entry
        too_big = self.max_bytes > 0 and expected_bytes > self.max_bytes
        if too_big or (self.policy == "exact" and self._over_budget(1, expected_bytes)):
            self.rejections += 1
            return Admission.EAGER_CAPACITY
        if self.min_hits > 1:
            seen = self._sightings.pop(key, 0) + 1
            if seen < self.min_hits:
                self._sightings[key] = seen
                _trim(self._sightings)
                return Admission.EAGER_WARMING
        while self._entries and self._over_budget(1, expected_bytes):
            self._evict_oldest()
        return Admission.CAPTURE

    @_publishes
    def put(self, key: K, entry: E, *, nbytes: int = 0) -> bool:
        """Store a freshly captured entry; returns False (and releases it) if it may not stay."""
        nbytes = _check_int("nbytes", nbytes, 0)
        quarantined = self._quarantine.get(key)
        if self.capacity == 0 or (quarantined is not None and (not quarantined.transient or quarantined.wait > 0)):
            self._release(entry)
            return False
        self._quarantine.pop(key, None)
        self.discard(key)  # a re-capture replaces the old entry
        if self.policy == "exact" and self._over_budget(1, nbytes):
            self.rejections += 1
            self._release(entry)
            return False
        self._entries[key] = entry
        self._nbytes[key] = nbytes
        self._sightings.pop(key, None)
        self.captures += 1
        while len(self._entries) > 1 and self._over_budget(0, 0):
            self._evict_oldest()
        return True

    @_publishes
    def fail(self, key: K, exc: Optional[BaseException] = None, *, transient: Optional[bool] = None) -> None:
        """Quarantine `key` after a failed capture: if transient (or `transient=`, agreed across ranks)
        for its next 2**n misses, else until `clear()`."""
        self.failures += 1
        transient = is_transient_failure(exc) if transient is None else bool(transient)
        previous = self._quarantine.pop(key, None)
        failures = previous.failures + 1 if previous is not None and previous.transient else 1
        reason = "" if exc is None else f"{type(exc).__name__}: {exc}"[:200]
        self._quarantine[key] = _Quarantined(reason, transient, failures,
                                             min(2 ** failures, MAX_RETRY_BACKOFF) if transient else 0)
        _trim(self._quarantine)
        self._sightings.pop(key, None)
        self.discard(key)

    def _evict_oldest(self) -> None:
        key = next(iter(self._entries))
        self.evictions += 1
        self.discard(key)

    @_publishes
    def discard(self, key: K) -> bool:
        """Drop `key` if resident (releasing it); returns whether it was."""
        if key not in self._entries:
            return False
        entry = self._entries.pop(key)
        self._nbytes.pop(key, None)
        self._release(entry)
        return True

    @_publishes
    def clear(self) -> None:
        """Release every entry and forget all state (quarantine, counters) as if new."""
        entries = list(self._entries.values())
        for state in (self._entries, self._nbytes, self._sightings, self._quarantine):
            state.clear()
        self._reset_counters()
        first_error: Optional[BaseException] = None
        for entry in entries:  # release all even if one release raises
            try:
                self._release(entry)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def info(self) -> CacheInfo:
        same_name = {f.name: getattr(self, f.name) for f in fields(CacheInfo) if f.name not in ("size", "quarantined")}
        return CacheInfo(size=len(self._entries), quarantined=len(self._quarantine), **same_name)


def _trim(tracked: "OrderedDict[Any, Any]") -> None:
    while len(tracked) > MAX_TRACKED_KEYS:
        tracked.popitem(last=False)
