"""Entry points of spawned multimodal_gen worker processes, with sglang-ext activation.

sglang 0.5.17 starts multimodal_gen GPU workers with the spawn method and
never loads plugins in them, so patches applied in the launcher process do not
exist in the workers. The `mg_worker_activation` patch rebinds the
`sglang.multimodal_gen.runtime.launch_server` globals used as process targets
to the functions below. Under spawn a process target is pickled by reference
(module + qualified name), so the child imports *this* module, activates
sglang-ext first and only then runs sglang's original worker entry.

The functions must stay top-level here (never transplanted into sglang's
module): a function whose `__module__` is sglang's launch_server would be
pickled as `launch_server.<name>` and the child's fresh import would resolve
it to the unpatched original.
"""

from __future__ import annotations


def _activate_in_worker() -> None:
    # force: this wrapper is only installed when the launcher process activated
    # sglang-ext (also via an explicit `activate(force=True)` without SGLANG_EXT=1).
    # Knob values come from the inherited environment; strict mode aborts the
    # worker with SglangExtActivationError, which the launcher reports as a dead rank.
    from sglang_ext.activation import activate

    activate(force=True)


def run_scheduler_process(*args, **kwargs):
    """Worker target of `launch_server.launch_server` (monolithic mode, one per GPU)."""
    _activate_in_worker()
    from sglang.multimodal_gen.runtime.managers import gpu_worker

    return gpu_worker.run_scheduler_process(*args, **kwargs)


def _run_disagg_role_process(*args, **kwargs):
    """Worker target of the pool-disaggregation launchers (`launch_pool_disagg_server`,
    `launch_disagg_role`). The original body calls the (patched) module global
    `run_scheduler_process`, which activates again: a no-op."""
    _activate_in_worker()
    from sglang.multimodal_gen.runtime import launch_server

    original = getattr(launch_server, "_ext_orig__run_disagg_role_process", launch_server._run_disagg_role_process)
    return original(*args, **kwargs)


def _run_http_server_process(*args, **kwargs):
    """Target of the HTTP server child that `launch_server` spawns with `--webui` (it serves
    request/response code such as the Pi0.5 action metadata)."""
    _activate_in_worker()
    from sglang.multimodal_gen.runtime import launch_server

    original = getattr(launch_server, "_ext_orig__run_http_server_process", launch_server._run_http_server_process)
    return original(*args, **kwargs)
