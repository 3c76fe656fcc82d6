"""Entry points of spawned multimodal_gen processes that activate sglang-ext (patch mg_worker_activation):
the child activates while unpickling its target, before its arguments import `sglang.multimodal_gen`."""

from __future__ import annotations

import functools

# sglang's targets the entries replaced, by name (filled, and emptied on rollback, by the patch's context).
ORIGINALS: dict = {}


def _activate_in_worker() -> None:
    # force: installed only when the launcher activated sglang-ext (maybe without SGLANG_EXT=1); knobs from env.
    from sglang_ext.activation import activate

    activate(force=True)


def run_scheduler_process(*args, **kwargs):
    """GPU worker (monolithic `launch_server`, one per GPU; also called by the disagg target)."""
    _activate_in_worker()
    from sglang.multimodal_gen.runtime.managers import gpu_worker

    return gpu_worker.run_scheduler_process(*args, **kwargs)


def _run_disagg_role_process(*args, **kwargs):
    """GPU worker of `launch_pool_disagg_server` / `launch_disagg_role` (its body calls the entry above)."""
    _activate_in_worker()
    return _original("_run_disagg_role_process")(*args, **kwargs)


def _run_http_server_process(*args, **kwargs):
    """HTTP server child of `launch_server` with `--webui` (serves e.g. the Pi0.5 action metadata)."""
    _activate_in_worker()
    return _original("_run_http_server_process")(*args, **kwargs)


def _original(name: str):
    from sglang.multimodal_gen.runtime import launch_server

    return ORIGINALS.get(name) or getattr(launch_server, name)


class WorkerEntry:
    """Process target that activates sglang-ext in a spawned child as early as unpickling."""

    def __init__(self, function):
        functools.update_wrapper(self, function)  # __wrapped__, __name__, __module__, ...

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

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
