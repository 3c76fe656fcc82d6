"""Captures into one shared graph pool: the pool pinned, one capture stream, failures undone.
A pool whose last graph is reset fails new captures until `empty_cache()`, so a shared pool is pinned by
one never-reset graph. The undo of a failed capture leans on torch internals, so it runs only on the
releases it was tested on (`REPAIR_TESTED_TORCH`); elsewhere one warning. torch is imported only when called.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from sglang_ext.graphs.keys import _is_int
from sglang_ext.versions import version_key

_logger = logging.getLogger("sglang_ext.graphs.capture")

# Torch releases (major, minor) whose capture internals the undo was tested on, inclusive.
REPAIR_TESTED_TORCH = ((2, 11), (2, 14))

_CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed

_capture_streams: Dict[int, Any] = {}
_pins: Dict[Tuple[int, Tuple[int, ...]], Any] = {}  # (device, pool id) -> (graph, tensor) never reset
_warned_no_repair: list = []
_runtime_begin: list = []  # [cudaStreamBeginCapture or None] once looked up


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


def pin_graph_pool(pool: Any, device: Any = None) -> None:
    """Keep `pool` in use with one tiny graph that is never reset (idempotent; not during a capture)."""
    import torch

    index = _cuda_index(device)
    key = (index, tuple(pool))
    if key in _pins:
        return
    with torch.cuda.device(index):
        graph = torch.cuda.CUDAGraph()
        with guarded_capture(graph, pool=pool, stream=capture_stream(index)):
            anchor = torch.zeros(1, device=torch.device("cuda", index))
    _pins[key] = (graph, anchor)


def capture_stream(device: Any = None) -> Any:
    """The one side stream of all captures on `device` (a freed pool block is reused only on its stream)."""
    import torch

    index = _cuda_index(device)
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(device=index)
    return _capture_streams[index]


@contextlib.contextmanager
def guarded_capture(graph: Any, *, stream: Any, pool: Any = None) -> Iterator[Any]:
    """`torch.cuda.graph(...)`, safe to fail and from the GC (collecting a dropped graph invalidates a capture)."""
    import torch

    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        # The outer stream context restores the caller's stream even when graph.__exit__ raises first.
        with torch.cuda.stream(stream):
            capture = torch.cuda.graph(graph, pool=pool, stream=stream)
            capture.__enter__()
            try:
                yield graph
            except BaseException as body_error:
                try:
                    capture.__exit__(type(body_error), body_error, body_error.__traceback__)
                except BaseException:  # noqa: BLE001 - the body's error is the one to report
                    _undo_failed_capture(graph, pool, stream)
                raise
            try:
                capture.__exit__(None, None, None)
            except BaseException:
                _undo_failed_capture(graph, pool, stream)
                raise
    finally:
        if gc_was_enabled:
            gc.enable()


def _undo_failed_capture(graph: Any, pool: Any, stream: Any) -> None:
    """Make the pool, the CUDA generator and later captures usable after `capture_end` raised: call it again on an
    empty capture (it also ends the pinned-host allocator's unbound recording), else undo both by hand."""
    import torch

    missing = repair_unavailable()
    if missing is None and callable(getattr(graph, "capture_end", None)) and _end_capture_in_place(graph, stream):
        try:
            graph.reset()
        except Exception as exc:  # noqa: BLE001
            _logger.debug("reset of the failed graph raised: %s", exc)
        return
    absent = [f"torch._C.{n}" for n in ("_cuda_endAllocateToPool", "_cuda_releasePool")
              if not callable(getattr(torch._C, n, None))]
    if missing is None and absent:
        missing = f"missing torch internals: {', '.join(absent)}"
    if missing is not None:
        if not _warned_no_repair:
            _warned_no_repair.append(True)
            _logger.warning("a failed CUDA graph capture is not repaired (%s): its key runs eager, and later "
                            "captures into the same pool may fail and run eager too", missing)
        return
    index = torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except Exception as exc:  # noqa: BLE001 - already ended (capture_end failed later than usual)
        _logger.debug("graph pool %s was not recording after the failed capture: %s", pool, exc)
    else:
        # capture_begin took a use of the pool; reset() releases it only after a capture that ended.
        torch._C._cuda_releasePool(index, pool)
    try:
        graph.reset()  # drops the graph's capture registrations
    except Exception as exc:  # noqa: BLE001
        _logger.debug("reset of the failed graph raised: %s", exc)
    # An ended capture takes the generator out of capture mode: capture a no-op once (own pool, same stream).
    probe = torch.empty(1, device=torch.device("cuda", index))
    repair = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(repair, stream=stream):
            probe.fill_(0)
    except Exception as exc:  # noqa: BLE001 - report the original failure, not this one
        _logger.warning("CUDA graph state could not be restored after a failed capture: %s", exc)
    finally:
        repair.reset()


def _torch_release(version: str) -> Tuple[int, ...]:
    return version_key(version)[:2]


def repair_unavailable() -> Optional[str]:
    """Why no failed capture is repaired with this torch (None: a tested release)."""
    import torch

    release = _torch_release(torch.__version__)
    low, high = REPAIR_TESTED_TORCH
    if not low <= release <= high:
        return (f"torch {torch.__version__} is outside the releases the repair was tested on "
                f"({low[0]}.{low[1]} to {high[0]}.{high[1]})")
    return None


def _end_capture_in_place(graph: Any, stream: Any) -> bool:
    """Re-open an empty capture and let `graph.capture_end()` clean up (False: use the fallback)."""
    import warnings

    begin = _runtime_begin_capture()
    if begin is None or begin(stream.cuda_stream, _CAPTURE_MODE_RELAXED) != 0:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty": it is, on purpose
            graph.capture_end()
    except Exception as exc:  # noqa: BLE001
        _logger.debug("capture_end of the re-opened capture raised: %s", exc)
        return False
    return True


def _runtime_begin_capture() -> Optional[Callable[[int, int], int]]:
    """`cudaStreamBeginCapture` of the CUDA runtime this process loaded (None if not found)."""
    if _runtime_begin:
        return _runtime_begin[0]
    import ctypes

    fn = None
    try:  # Linux only; elsewhere the fallback undo (or none) is used
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in sorted(paths):
            fn = getattr(ctypes.CDLL(path), "cudaStreamBeginCapture", None)
            if fn is not None:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
                fn.restype = ctypes.c_int
                break
    except OSError as exc:
        _logger.debug("CUDA runtime not found for capture clean-up: %s", exc)
    _runtime_begin.append(fn)
    return fn
