"""Entry points of spawned multimodal_gen processes, with sglang-ext activation.

sglang 0.5.17 starts multimodal_gen GPU workers (and, with `--webui`, the HTTP
server) with the spawn method and never loads plugins in them, so patches
applied in the launcher process do not exist there. The `mg_worker_activation`
patch rebinds the `sglang.multimodal_gen.runtime.launch_server` globals used as
process targets to the `WorkerEntry` objects below.

A spawned child unpickles its target before its arguments. A `WorkerEntry`
pickles as a call of `worker_entry(name)` here, so the child imports sglang-ext
and activates it while unpickling the target, before the arguments
(`ServerArgs`, the pipeline config) import `sglang.multimodal_gen`: patches
then apply as those modules are imported, exactly as in the launcher process.
Calling the entry activates again (a no-op) and runs sglang's original target.

Nothing here is transplanted into sglang's module: an object that pickles as
`launch_server.<name>` would be resolved by the child's fresh import to the
unpatched original.
"""

from __future__ import annotations


def _activate_in_worker() -> None:
    # force: entries are only installed when the launcher process activated sglang-ext
    # (also via an explicit `activate(force=True)` without SGLANG_EXT=1). Knob values come
    # from the inherited environment; in strict mode a failure aborts the child with
    # SglangExtActivationError, which the launcher reports as a dead rank.
    from sglang_ext.activation import activate

    activate(force=True)


def run_scheduler_process(*args, **kwargs):
    """GPU worker (monolithic `launch_server`, one per GPU; also called by the disagg target)."""
    _activate_in_worker()
    from sglang.multimodal_gen.runtime.managers import gpu_worker

    return gpu_worker.run_scheduler_process(*args, **kwargs)


def _run_disagg_role_process(*args, **kwargs):
    """GPU worker of `launch_pool_disagg_server` / `launch_disagg_role`. sglang's original body
    calls the module global `run_scheduler_process`, which is the entry above when patched."""
    _activate_in_worker()
    return _original("_run_disagg_role_process")(*args, **kwargs)


def _run_http_server_process(*args, **kwargs):
    """HTTP server child of `launch_server` with `--webui` (serves e.g. the Pi0.5 action metadata)."""
    _activate_in_worker()
    return _original("_run_http_server_process")(*args, **kwargs)


def _original(name: str):
    from sglang.multimodal_gen.runtime import launch_server

    return getattr(launch_server, f"_ext_orig_{name}", None) or getattr(launch_server, name)


class WorkerEntry:
    """Process target that activates sglang-ext in a spawned child as early as unpickling."""

    def __init__(self, function):
        self.function = function
        self.__name__ = self.__qualname__ = function.__name__
        self.__module__ = function.__module__
        self.__doc__ = function.__doc__

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)

    def __reduce__(self):
        return (worker_entry, (self.__name__,))

    def __repr__(self) -> str:
        return f"<sglang-ext worker entry {self.__module__}.{self.__name__}>"


ENTRIES = {fn.__name__: WorkerEntry(fn) for fn in (run_scheduler_process, _run_disagg_role_process,
                                                   _run_http_server_process)}


def worker_entry(name: str) -> WorkerEntry:
    """Called by pickle in the spawned child: activate, then hand back the entry."""
    _activate_in_worker()
    return ENTRIES[name]
