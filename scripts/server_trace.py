"""Where a server's time goes under load: a measurement plugin for bench_vit_server.py only.

Loaded by sglang's own `load_plugins()` in every server process (graphs off, sglang-ext, unpatched
graphs on alike: the bench writes a dist-info with an entry point of group `sglang.srt.plugins` and
puts it and this folder on the server's PYTHONPATH; never installed, never shipped). In the
scheduler it wraps, by calling the original:
  Scheduler.run_batch             host ms of launching each batch (the ViT runs inside it)
  Scheduler.process_batch_result  host ms of taking a batch's results (waits for the device)
  Scheduler.recv_requests / process_input_requests  host ms of taking requests in
  ModelRunner.forward             device ms of every forward (CUDA events, read without a sync)
  the vision tower's forward      per call: tokens, images, host ms, device ms
  while <trace dir>/syncs exists: every device sync inside ModelRunner.forward, counted by its sglang call
                                  site (torch's sync debug mode; the bench sets it during the warm-up only)
  with SGX_SERVER_VIT_FREE=1: the vision tower answers zeros of its output's shape without running (after one
                                  real call), so the server's throughput is what no ViT change can exceed
  upstream's ViTCudaGraphRunner.create_graph  its captures (a server without sglang-ext's /metrics), written at
                                  once; with SGX_SERVER_TRACE=captures this is all it wraps
Cumulative totals go to $SGX_SERVER_TRACE_DIR/<pid>.json every 0.25 s, with the process's reserved CUDA
memory (a reading, not a total: servers without sglang-ext's /metrics report it here); the bench reads
them before and after a pass and reports the differences next to the pass's req/s.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time

SYNCS_FLAG = "syncs"
CAPTURES = "vit_graph_captures"  # [captures, captures] of upstream's ViT runner
RESERVED = "cuda_memory_reserved_bytes"  # [bytes at the last write, 1]
_TOTALS: dict = {}
_PENDING: list = []  # (name, start event, end event)
_LOCK = threading.Lock()
_LAST_WRITE = [0.0]


def _add(name: str, value: float, count: int = 1) -> None:
    with _LOCK:
        total = _TOTALS.setdefault(name, [0.0, 0])
        total[0] += value
        total[1] += count


def _drain_events() -> None:
    """Add the device time of every finished event pair (query(): never a sync)."""
    keep = []
    for name, start, end in _PENDING:
        if end.query():
            _add(name + "_device_ms", start.elapsed_time(end))
        else:
            keep.append((name, start, end))
    _PENDING[:] = keep
    now = time.monotonic()
    if now - _LAST_WRITE[0] > 0.25:
        _LAST_WRITE[0] = now
        path = os.path.join(os.environ["SGX_SERVER_TRACE_DIR"], f"{os.getpid()}.json")
        import torch

        reserved = float(torch.cuda.memory_reserved()) if torch.cuda.is_initialized() else 0.0
        with _LOCK:
            _TOTALS[RESERVED] = [reserved, 1]
            text = json.dumps({k: v for k, v in _TOTALS.items()})
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


def _timed(cls, method: str, name: str, device: bool = False, tokens=None) -> None:
    import torch

    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        events = None
        if device and torch.cuda.is_available():
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _add(name + "_host_ms", (time.perf_counter() - t0) * 1e3)
            if tokens is not None:
                n_tokens, n_images = tokens(*args)
                _add(name + "_tokens", n_tokens)
                _add(name + "_images", n_images)
            if events is not None:
                events[1].record()
                _PENDING.append((name,) + events)
            _drain_events()

    wrapper.sgx_trace = True
    setattr(cls, method, wrapper)


def _count_captures(cls) -> None:
    """Count upstream's ViT graph captures (the unpatched graphs-on server has no counters of ours)."""
    original = cls.create_graph

    @functools.wraps(original)
    def create_graph(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            _add(CAPTURES, 1.0)
            _LAST_WRITE[0] = float("-inf")  # written now: captures are few, and the last one must be seen
            _drain_events()

    create_graph.sgx_trace = True
    cls.create_graph = create_graph


def _sync_sites(cls, method: str) -> None:
    """Count the device syncs inside `method` by where sglang called them (torch's sync debug mode)."""
    import traceback
    import warnings

    import torch

    original = getattr(cls, method)

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/sglang/" in f.filename][-3:]
        _add("sync@" + " < ".join(f"{f.filename.split('/sglang/')[-1]}:{f.lineno}" for f in reversed(frames)), 1)

    flag = os.path.join(os.environ["SGX_SERVER_TRACE_DIR"], SYNCS_FLAG)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not os.path.exists(flag) or not torch.cuda.is_available():
            return original(*args, **kwargs)
        shown = warnings.showwarning
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown

    setattr(cls, method, wrapper)


def _vit_free(cls) -> None:
    """The tower's first call runs (it tells the output's width, dtype and rows per patch); every later call
    returns zeros of that shape at once: a ceiling for the benchmark, never a server anyone runs."""
    import torch

    original = cls.forward
    seen = {}

    @functools.wraps(original)
    def forward(self, x, *args, **kwargs):
        if not seen:
            out = original(self, x, *args, **kwargs)
            if not (torch.is_tensor(out) and out.dim() == 2 and out.shape[0]):
                return out  # not one [rows, width] tensor: this tower is never made free
            seen.update(patches_per_row=x.shape[0] // out.shape[0], width=out.shape[1], dtype=out.dtype,
                        device=out.device)  # x may arrive on the CPU (Qwen3-VL moves it inside forward)
            return out
        return torch.zeros(x.shape[0] // seen["patches_per_row"], seen["width"], dtype=seen["dtype"],
                           device=seen["device"])

    cls.forward = forward


def _vit_size(self, x, grid_thw=None, *rest):
    return int(x.shape[0]), int(grid_thw.shape[0]) if grid_thw is not None else 0


VIT_TOWERS = (("sglang.srt.models.qwen2_5_vl", "Qwen2_5_VisionTransformer"),
              ("sglang.srt.models.qwen3_vl", "Qwen3VLMoeVisionModel"))


def activate() -> None:
    """The plugin entry point: wrap what this process has (a scheduler has all of it). Without a trace
    folder only the vit-free tower (when asked for), so that server is timed as the others are."""
    import importlib

    if not os.environ.get("SGX_SERVER_TRACE_DIR"):
        if os.environ.get("SGX_SERVER_VIT_FREE") == "1":
            for module_name, cls_name in VIT_TOWERS:
                try:
                    _vit_free(getattr(importlib.import_module(module_name), cls_name))
                except Exception:  # noqa: BLE001 - a process without this class (the HTTP process) skips it
                    continue
        return
    try:
        runner = importlib.import_module("sglang.srt.multimodal.vit_cuda_graph_runner").ViTCudaGraphRunner
        if not getattr(runner.create_graph, "sgx_trace", False):
            _count_captures(runner)
    except Exception:  # noqa: BLE001 - a process without the ViT runner skips it
        pass
    if os.environ.get("SGX_SERVER_TRACE") == "captures":
        return

    targets = [
        ("sglang.srt.managers.scheduler", "Scheduler", "run_batch", "run_batch", False, None),
        ("sglang.srt.managers.scheduler", "Scheduler", "process_batch_result", "process_result", False, None),
        ("sglang.srt.managers.scheduler_components.request_receiver", "SchedulerRequestReceiver", "recv_requests",
         "recv", False, None),
        ("sglang.srt.managers.scheduler", "Scheduler", "process_input_requests", "process_input", False, None),
        ("sglang.srt.model_executor.model_runner", "ModelRunner", "forward", "forward", True, None),
    ] + [(module_name, cls_name, "forward", "vit", True, _vit_size) for module_name, cls_name in VIT_TOWERS]
    for module_name, cls_name, method, name, device, tokens in targets:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except Exception:  # noqa: BLE001 - a process without this class (the HTTP process) skips it
            continue
        if callable(getattr(cls, method, None)) and not getattr(getattr(cls, method), "sgx_trace", False):
            if name == "vit" and os.environ.get("SGX_SERVER_VIT_FREE") == "1":
                _vit_free(cls)
            if name == "forward":
                _sync_sites(cls, method)
            _timed(cls, method, name, device, tokens)


def write_dist_info(folder: str) -> str:
    """A dist-info that makes sglang's load_plugins() find `activate` (returns the folder for PYTHONPATH)."""
    info = os.path.join(folder, "sgx_server_trace-0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: sgx-server-trace\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\nsgx_server_trace = server_trace:activate\n")
    return folder


def read_totals(folder: str) -> dict:
    """The summed totals of every process that wrote to `folder` so far."""
    out: dict = {}
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        for key, (value, count) in data.items():
            total = out.setdefault(key, [0.0, 0])
            total[0] += value
            total[1] += count
    return out


def difference(after: dict, before: dict) -> dict:
    """Totals accrued between two readings (the reserved-memory reading left out: it is not a total)."""
    return {k: [round(v[0] - before.get(k, [0, 0])[0], 2), v[1] - before.get(k, [0, 0])[1]]
            for k, v in after.items() if k != RESERVED}
