"""Bucket selection: which captured size a live batch is padded to, chosen once (a `BucketDecision`) so
admission and replay use the same bucket."""

from __future__ import annotations

import bisect
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple

from sglang_ext.graphs.keys import _check_int, _is_int


@dataclass(frozen=True)
class BucketDecision:
    """Outcome of `select_bucket`; `bucket is None` means: run eager."""

    live_size: int
    bucket: Optional[int]
    required: Optional[int] = None
    capacity: Optional[int] = None

    @property
    def fits(self) -> bool:
        return self.bucket is not None

    @property
    def padding(self) -> int:
        return 0 if self.bucket is None else self.bucket - self.live_size


# Bucket lists already validated: runners pass the same list for every batch.
_VALIDATED: set = set()
_VALIDATED_MAX = 64


def validate_buckets(buckets: Sequence[Any], *, field: str = "buckets") -> Tuple[int, ...]:
    """Return `buckets` as a tuple after checking: positive ints, strictly increasing."""
    # Exact ints only: True == 1 and 1.0 == 1 would otherwise hit a cached (1,).
    if isinstance(buckets, (tuple, list)) and set(map(type, buckets)) == {int} and tuple(buckets) in _VALIDATED:
        return tuple(buckets)
    allowed = "allowed: positive integers, strictly increasing, no duplicates"
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise ValueError(f"{field}: {buckets!r} is not allowed; {allowed}")
    out = tuple(buckets)
    for i, size in enumerate(out):
        if not _is_int(size) or size <= 0:
            raise ValueError(f"{field}: element {size!r} is not allowed; {allowed}")
        if i and size <= out[i - 1]:
            what = "duplicate" if size == out[i - 1] else "out of order"
            raise ValueError(f"{field}: {size} is {what}; {allowed}")
    out = tuple(int(size) for size in out)
    if len(_VALIDATED) >= _VALIDATED_MAX:
        _VALIDATED.clear()
    _VALIDATED.add(out)
    return out


def select_bucket(live_size: int, buckets: Sequence[int], *, max_padding_factor: float = 2.0,
                  capacity: Optional[Mapping[int, int]] = None, required: Optional[int] = None) -> BucketDecision:
    """Smallest bucket with `live_size <= bucket <= live_size * max_padding_factor` and, if
    `required` is given, `capacity[bucket] >= required` (unknown capacity does not qualify)."""
    _check_int("live_size", live_size, 0)
    if (not isinstance(max_padding_factor, numbers.Real) or isinstance(max_padding_factor, bool)
            or math.isnan(max_padding_factor) or max_padding_factor < 1):
        raise ValueError(f"max_padding_factor: {max_padding_factor!r} is not allowed; allowed: numbers >= 1 "
                         "(inf = no limit)")
    if required is not None and (not _is_int(required) or required < 0):
        raise ValueError(f"required: {required!r} is not allowed; allowed: None or integers >= 0")
    sizes = validate_buckets(buckets)
    # inf means "no limit", also for live_size 0 (0 * inf would be nan).
    limit = math.inf if math.isinf(max_padding_factor) else live_size * max_padding_factor
    for bucket in sizes[bisect.bisect_left(sizes, live_size):]:
        if bucket > limit:
            break
        cap = None if capacity is None else capacity.get(bucket)
        if required is not None and (cap is None or cap < required):
            continue
        return BucketDecision(live_size, bucket, required, cap)
    return BucketDecision(live_size, None, required, None)


def geometric_buckets(smallest: int, largest: int, *, ratio: float, multiple: int = 1) -> Tuple[int, ...]:
    """Sizes from `smallest` growing by `ratio`, each rounded up to `multiple`, until one is >= `largest`
    (padding wastes under `ratio - 1`; the number of graphs stays logarithmic)."""
    for name, value in (("smallest", smallest), ("largest", largest), ("multiple", multiple)):
        _check_int(name, value, 1)
    if largest < smallest:
        raise ValueError(f"largest: {largest} is below smallest {smallest}; allowed: integers >= smallest")
    # >= 1.01 keeps the loop short (at most ~1400 steps per 10^6 of range).
    if not isinstance(ratio, numbers.Real) or isinstance(ratio, bool) or not ratio >= 1.01 or math.isinf(ratio):
        raise ValueError(f"ratio: {ratio!r} is not allowed; allowed: finite numbers >= 1.01")
    sizes = []
    size = float(smallest)
    while True:
        bucket = -(-math.ceil(size) // multiple) * multiple
        if not sizes or bucket > sizes[-1]:
            sizes.append(bucket)
        if bucket >= largest:
            return tuple(sizes)
        size *= ratio
