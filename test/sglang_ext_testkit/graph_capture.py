"""Graph-capture helpers for the GPU tests: a private shared pool, capture with warm-up, and
what a capture took from the device (built on sglang_ext.graphs.capture)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Tuple, TypeVar

from sglang_ext.graphs.capture import _cuda_index, capture_stream, guarded_capture, pin_graph_pool
from sglang_ext.graphs.keys import _is_int

T = TypeVar("T")

_pools: Dict[int, Any] = {}


def shared_graph_pool(device: Any = None) -> Any:
    """The process-wide graph pool handle of `device` (created on first use)."""
    import torch

    index = _cuda_index(device)
    pool = _pools.get(index)
    if pool is None:
        with torch.cuda.device(index):
            pool = torch.cuda.graph_pool_handle()
        pin_graph_pool(pool, index)
        _pools[index] = pool
    return pool


def pool_reserved_bytes(device: Any = None) -> int:
    """Bytes the caching allocator holds from the device (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_reserved(_cuda_index(device)))


def capture_measured(fn_capture: Callable[[], T], device: Any = None) -> Tuple[T, int]:
    """Run `fn_capture()`; return its result and how many bytes it newly took from the device.

    This is the growth of reserved memory: a capture that reuses blocks an
    evicted graph returned to the shared pool measures 0, since it took nothing new.
    """
    before = pool_reserved_bytes(device)
    result = fn_capture()
    return result, max(0, pool_reserved_bytes(device) - before)


def capture_graph(fn: Callable[[], T], *, pool: Any = None, stream: Any = None, warmup_iters: int = 1) -> Tuple[Any, T]:
    """Warm `fn` up on the capture stream, then capture it into a new CUDAGraph; returns (graph, output).

    Warm-up runs lazy initialisation (cuBLAS handles, autotuning) outside the
    capture, where it would otherwise fail or be baked in.
    """
    import torch

    if not _is_int(warmup_iters) or warmup_iters < 0:
        raise ValueError(f"warmup_iters: {warmup_iters!r} is not allowed; allowed: integers >= 0")
    stream = capture_stream() if stream is None else stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_iters):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with guarded_capture(graph, pool=pool, stream=stream):
        output = fn()
    return graph, output


def largest_first(sizes: Iterable[int]) -> Tuple[int, ...]:
    """Capture order for a set of sizes captured up front: the largest graph sizes the
    shared pool, so smaller ones fit into blocks it already holds."""
    return tuple(sorted(set(sizes), reverse=True))
