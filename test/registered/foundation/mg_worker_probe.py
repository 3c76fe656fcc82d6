"""Stand-in for `ServerArgs` inside a spawned multimodal_gen worker (used by test_mg_spawned_worker).

sglang's worker entry `gpu_worker.run_scheduler_process` reads `server_args.log_level`
(via `configure_logger`) near its start. A `WorkerProbe` passed as `server_args` turns
that first read into a report of the child's own state -- activation statuses, the live
`launch_server` globals, the call stack that led there -- sent through a pipe, after
which the child exits before any GPU scheduler is built. Everything reported is
observed inside the child.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

# The sglang-ext copy under test: the plugin, or on the patched tree the fork's vendored copy
# (the spawned child inherits EXT_TEST_TREE).
EXT = "sglang.ext" if os.environ.get("EXT_TEST_TREE", "plugin") == "patched" else "sglang_ext"

# Read by `_run_disagg_role_process` before it calls the worker entry: answered, not reported.
_PASSTHROUGH = {"master_port": 29999}


class WorkerProbe:
    """`payload`: any picklable sglang object; unpickling it in the child imports sglang modules
    the way unpickling a real `ServerArgs` does."""

    def __init__(self, conn, payload=None) -> None:
        self._conn = conn
        self._payload = payload

    def __getattr__(self, name):
        if name.startswith("_"):  # pickle protocol and our own fields
            raise AttributeError(name)
        if name in _PASSTHROUGH:
            return _PASSTHROUGH[name]
        self._conn.send(observe_child(first_read=name))
        self._conn.close()
        os._exit(0)  # stop here: no scheduler, no GPU


def _qualified(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def observe_child(first_read: str) -> dict:
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(f"{frame.f_globals.get('__name__')}:{frame.f_code.co_name}")
        frame = frame.f_back
    frames.reverse()  # outermost first

    report = {
        "pid": os.getpid(),
        "process_name": multiprocessing.current_process().name,
        "has_parent_process": multiprocessing.parent_process() is not None,
        "first_read": first_read,
        "stack": frames,
        "sglang_ext_imported": EXT in sys.modules,
        "statuses": {},
    }
    if f"{EXT}.activation" in sys.modules:
        activation = sys.modules[f"{EXT}.activation"]
        report["statuses"] = {name: str(st) for name, st in activation.statuses().items()}
    launch_server = sys.modules.get("sglang.multimodal_gen.runtime.launch_server")
    if launch_server is not None:
        report["launch_server.run_scheduler_process"] = _qualified(launch_server.run_scheduler_process)
        report["launch_server._run_disagg_role_process"] = _qualified(launch_server._run_disagg_role_process)
        report["launch_server._run_http_server_process"] = _qualified(launch_server._run_http_server_process)
        wrappers = sys.modules.get(f"{EXT}.mg_worker.entries")
        report["worker_entry_is_sglang_ext_wrapper"] = (
            wrappers is not None and launch_server.run_scheduler_process is wrappers.ENTRIES["run_scheduler_process"]
        )
    # sys.modules keeps insertion order: a module enters it when its import starts.
    order = list(sys.modules)
    report["import_position"] = {name: order.index(name) for name in (f"{EXT}.activation", "sglang.multimodal_gen")
                                 if name in sys.modules}
    return report
