"""Address-stable workspaces for captured graphs.

A graph replays with the addresses it captured, so its inputs must neither move nor be freed
while it lives. Each graph leases a slice of the current backing buffer; growth starts a new
buffer and leaves older ones where they are; a retired buffer is freed with its last lease.

Leases overlap on purpose (every graph gets the first rows): graphs of one runner never run
concurrently and each replay first copies its inputs in. Lease before capturing.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from sglang_ext.graphs.keys import _check_int, _is_int

# Each tensor of a lease starts on this byte boundary, as a fresh allocation would.
ALIGN_BYTES = 256


class _Backing:
    __slots__ = ("tensor", "leases", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.leases = 0


class WorkspaceLease:
    """Slices of one backing buffer held by one graph; `release()` when the graph goes."""

    __slots__ = ("owner", "_pool", "_backing", "_tensors")

    def __init__(self, pool: "StableWorkspacePool", backing: _Backing, owner: Any, tensors: tuple):
        self.owner = owner
        self._pool = pool
        self._backing = backing
        self._tensors = tensors

    @property
    def tensors(self) -> Tuple[Any, ...]:
        if self._backing is None:
            raise RuntimeError(f"workspace lease of {self.owner!r} used after release")
        return self._tensors

    def release(self) -> None:
        """Give the slices back (idempotent); frees a retired backing buffer with its last lease."""
        backing, self._backing, self._tensors = self._backing, None, ()
        if backing is not None:
            self._pool._release(backing)


class StableWorkspacePool:
    """Backing buffers from which graphs lease fixed-address slices (the current one outlives its leases)."""

    def __init__(self, name: str, *, allocate: Optional[Callable[[int], Any]] = None, dtype: Any = None,
                 device: Any = None) -> None:
        if allocate is None:
            import torch

            allocate = functools.partial(torch.empty, dtype=dtype, device=device)
        self.name = name
        self._allocate = allocate
        # alignment needs the element size up front; a 0-element tensor costs no memory
        self._element_size = allocate(0).element_size()
        self._current: Optional[_Backing] = None
        self._retired: Dict[int, _Backing] = {}  # id -> backing still leased by a graph

    def lease(self, owner: Any, rows: int, row_shape: Sequence[int] = (), *, count: int = 1) -> WorkspaceLease:
        """`count` non-overlapping tensors of shape (rows, *row_shape) that never move."""
        _check_int("rows", rows, 0)
        _check_int("count", count, 1)
        row_shape = tuple(row_shape)
        if not all(_is_int(d) and d >= 0 for d in row_shape):
            raise ValueError(f"row_shape: {row_shape!r} is not allowed; allowed: a tuple of integers >= 0")
        per_tensor = rows * math.prod(row_shape)
        stride = self._aligned(per_tensor)
        needed = stride * (count - 1) + per_tensor
        backing = self._backing_for(needed)
        flat = backing.tensor
        tensors = tuple(flat[i * stride : i * stride + per_tensor].view(rows, *row_shape) for i in range(count))
        backing.leases += 1
        return WorkspaceLease(self, backing, owner, tensors)

    def _aligned(self, numel: int) -> int:
        unit = max(1, ALIGN_BYTES // self._element_size)
        return -(-numel // unit) * unit

    def _backing_for(self, needed: int) -> _Backing:
        current = self._current
        if current is not None and current.tensor.numel() >= needed:
            return current
        size = needed if current is None else max(needed, 2 * current.tensor.numel())  # doubling
        new = _Backing(self._allocate(size))
        if current is not None and current.leases > 0:
            self._retired[id(current)] = current  # graphs still replay from it: keep it where it is
        self._current = new
        return new

    def _release(self, backing: _Backing) -> None:
        backing.leases -= 1
        if backing.leases == 0 and backing is not self._current:
            self._retired.pop(id(backing), None)

    def _alive(self) -> Tuple[_Backing, ...]:
        return tuple(self._retired.values()) + ((self._current,) if self._current is not None else ())

    @property
    def backing_buffers(self) -> int:
        return len(self._alive())

    @property
    def bytes_allocated(self) -> int:
        return sum(b.tensor.numel() * b.tensor.element_size() for b in self._alive())
