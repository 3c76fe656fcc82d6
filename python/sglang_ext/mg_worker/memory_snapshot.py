"""The multimodal_gen worker's memory snapshots read the CUDA allocator's statistics once per snapshot.

Patch: mg_worker_request_overhead
Targets: sglang.multimodal_gen.runtime.utils.perf_logger:capture_memory_snapshot
Upstream PR: none (0.5.23 still reads the statistics four times per snapshot and logs every stage at info)
Retire when: upstream reads the allocator's statistics once per snapshot and logs the stages of action requests at
debug level

Why: a snapshot before and after every request; each of its four torch.cuda getters flattens the whole table.
How: the worker's `capture_memory_snapshot` reads the four `all` counters from one `memory_stats_as_nested_dict()`.
"""

from __future__ import annotations

import torch

import sglang.multimodal_gen.runtime.utils.perf_logger as perf_logger

_MIB = 1024**2


def _counter(stats: dict, name: str, field: str) -> int:
    """`torch.cuda.memory_stats()[f"{name}.all.{field}"]`, 0 where absent (as torch's getters)."""
    return stats.get(name, {}).get("all", {}).get(field, 0)


def capture_memory_snapshot():
    """sglang's snapshot of the current CUDA device, from one read of the allocator's statistics."""
    if torch.get_device_module() is not torch.cuda or not torch.cuda.is_available():
        return perf_logger.capture_memory_snapshot()
    stats = torch.cuda.memory.memory_stats_as_nested_dict()
    host = perf_logger.__dict__.get("_host_anon_sampler")  # 0.5.23: the worker's host memory peak as well
    return perf_logger.MemorySnapshot(
        allocated_mb=_counter(stats, "allocated_bytes", "current") / _MIB,
        reserved_mb=_counter(stats, "reserved_bytes", "current") / _MIB,
        peak_allocated_mb=_counter(stats, "allocated_bytes", "peak") / _MIB,
        peak_reserved_mb=_counter(stats, "reserved_bytes", "peak") / _MIB,
        **({} if host is None else {"peak_host_anon_mb": host.peak_mb()}),
    )


def patch_gpu_worker(ctx, module) -> None:
    """Part for managers.gpu_worker: its module global capture_memory_snapshot (per request) is ours."""
    ctx.setattr(module, "capture_memory_snapshot", capture_memory_snapshot)
