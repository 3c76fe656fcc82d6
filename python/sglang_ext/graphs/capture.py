"""Capture helpers: one shared graph memory pool per device, and what a capture cost.

All graphs of sglang-ext on a device capture into one pool, so blocks of an
evicted (reset) graph are reused by the next capture instead of each graph
holding a private pool. Inside sglang, adapters pass sglang's own pool
(`sglang.srt.model_executor.runner_utils.pool.get_or_create_global_graph_memory_pool`)
so sglang's graphs and ours share one. torch is imported only when called,
and CUDA is touched only when available.

Pinning: PyTorch counts the graphs using a pool (`use_count`). When the last
one is reset the pool becomes "freeable": it is torn down at the next
`empty_cache()` only if none of its blocks is still allocated (e.g. an output a
caller kept), and until it is torn down a new capture into the same handle
fails an internal assert (`use_count > 0` in `create_or_incref_pool`). A
bounded cache empties the pool exactly this way (capacity 1, or `clear()`), so
every shared pool is pinned by one tiny graph that is never reset. Blocks of
reset graphs then stay in the pool and are reused by later captures instead of
going back to the device and being allocated again.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Tuple, TypeVar

from sglang_ext.graphs.keys import _is_int

T = TypeVar("T")

_pools: Dict[int, Any] = {}
_capture_streams: Dict[int, Any] = {}
_pins: Dict[Tuple[int, Tuple[int, ...]], Any] = {}  # (device, pool id) -> (graph, tensor) never reset


def _cuda_index(device: Any) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if _is_int(device):
        return int(device)
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device: {device!r} is not allowed; allowed: None, a CUDA index or a cuda device")
    return torch.cuda.current_device() if dev.index is None else dev.index


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


def pin_graph_pool(pool: Any, device: Any = None) -> None:
    """Keep `pool` in use with one tiny graph that is never reset (idempotent).

    Call it for sglang's global pool too, before the first capture that may be
    evicted; not while another capture is underway.
    """
    import torch

    index = _cuda_index(device)
    key = (index, tuple(pool))
    if key in _pins:
        return
    with torch.cuda.device(index):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=capture_stream(index)):
            anchor = torch.zeros(1, device=torch.device("cuda", index))
    _pins[key] = (graph, anchor)


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


def capture_stream(device: Any = None) -> Any:
    """The side stream all captures on `device` use by default.

    One stream on purpose: the allocator reuses a freed pool block only on the
    stream it was allocated on, so a new stream per capture would never reuse
    the blocks that evicted graphs gave back.
    """
    import torch

    index = _cuda_index(device)
    stream = _capture_streams.get(index)
    if stream is None:
        stream = _capture_streams[index] = torch.cuda.Stream(device=index)
    return stream


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
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        output = fn()
    return graph, output


def largest_first(sizes: Iterable[int]) -> Tuple[int, ...]:
    """Capture order for a set of sizes captured up front: the largest graph sizes the
    shared pool, so smaller ones fit into blocks it already holds."""
    return tuple(sorted(set(sizes), reverse=True))
