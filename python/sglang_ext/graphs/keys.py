"""Graph key material: everything that changes what a captured graph does, as CPU values (the helpers refuse
a device tensor, a sync per forward, unless asked)."""

from __future__ import annotations

import itertools
import numbers
from typing import Any, Iterable, Tuple


class DeviceSyncError(ValueError):
    """Key material lives on an accelerator; reading it would sync the device."""


def _is_int(value: Any) -> bool:
    """True for Python/numpy integers, False for bool (a flag is never a size)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name}: {value!r} is not allowed; allowed: integers >= {minimum}")
    return int(value)


def _host_values(values: Any, *, field: str, allow_device_sync: bool) -> Any:
    """Lists/tuples pass through; numpy arrays and tensors become nested lists."""
    if isinstance(values, (list, tuple)) or _is_int(values):
        return values
    if not hasattr(values, "tolist"):
        raise ValueError(f"{field}: {type(values).__name__} is not allowed; allowed: list, tuple, numpy array or "
                         "CPU tensor of ints")
    device = "cuda" if getattr(values, "is_cuda", False) else getattr(getattr(values, "device", None), "type", None)
    if isinstance(device, str) and device != "cpu" and not allow_device_sync:
        raise DeviceSyncError(f"{field}: a {device} tensor would force a device sync to build a graph key; "
                              "allowed: list, tuple, numpy array or CPU tensor (or pass allow_device_sync=True)")
    return values.tolist()


def cpu_ints(values: Any, *, field: str, allow_device_sync: bool = False) -> Tuple[int, ...]:
    """Flat tuple of Python ints from a list, tuple, numpy array or CPU tensor (else DeviceSyncError)."""
    host = _host_values(values, field=field, allow_device_sync=allow_device_sync)
    items = (host,) if _is_int(host) else host
    out = []
    for item in items:
        if not _is_int(item):
            raise ValueError(f"{field}: element {item!r} is not allowed; allowed: integers")
        out.append(int(item))
    return tuple(out)


def cumulative_lengths(lengths: Iterable[int], *, leading_zeros: int = 1) -> Tuple[int, ...]:
    """Prefix sums of non-negative lengths, e.g. [4, 4] -> (0, 4, 8) (cu_seqlens as ints)."""
    zeros = (0,) * _check_int("leading_zeros", leading_zeros, 0)
    lengths = cpu_ints(lengths, field="lengths")
    negative = [length for length in lengths if length < 0]
    if negative:
        raise ValueError(f"lengths: {negative[0]} is not allowed; allowed: integers >= 0")
    return zeros + tuple(itertools.accumulate(lengths))


def grid_thw_lengths(grid_thw: Any, *, field: str = "grid_thw") -> Tuple[int, ...]:
    """Tokens per image/video (t*h*w) from a list of [t, h, w] rows or a CPU (N, 3) tensor."""
    rows = _host_values(grid_thw, field=field, allow_device_sync=False)
    if _is_int(rows):
        raise ValueError(f"{field}: {rows!r} is not allowed; allowed: rows of [t, h, w] non-negative integers")
    out = []
    for row in rows:
        thw = cpu_ints(row, field=field)
        if len(thw) != 3 or min(thw) < 0:
            raise ValueError(f"{field}: row {row!r} is not allowed; allowed: rows of [t, h, w] non-negative integers")
        out.append(thw[0] * thw[1] * thw[2])
    return tuple(out)


def dedup_consecutive(values: Iterable[Any]) -> tuple:
    """Drop consecutive repeats, like torch.unique_consecutive, for Python values."""
    return tuple(value for value, _ in itertools.groupby(values))
