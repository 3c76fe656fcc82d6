"""Activate sglang-ext inside the multimodal_gen processes that 0.5.17 spawns.

Patch: mg_worker_activation
Targets: sglang.multimodal_gen.runtime.launch_server:run_scheduler_process,
sglang.multimodal_gen.runtime.launch_server:_run_disagg_role_process,
sglang.multimodal_gen.runtime.launch_server:_run_http_server_process
Upstream PR: (multimodal_gen plugin group, sglang 0.5.21)
Retire when: the minimum supported sglang loads sglang.multimodal_gen.plugins in workers (>= 0.5.21)

Why: 0.5.17 spawns the GPU workers (and the `--webui` HTTP server) without loading plugins there.
How: launch_server's process targets are rebound to `entries.ENTRIES` objects that pickle as a call of
`entries.worker_entry(name)`: the child activates while unpickling (an installed function unpickles as the original).
"""

from __future__ import annotations

import sys


def patch_launch_server(ctx, module) -> None:
    from sglang_ext.mg_worker import entries as mg_worker

    gpu_worker = sys.modules["sglang.multimodal_gen.runtime.managers.gpu_worker"]
    if module.run_scheduler_process is not gpu_worker.run_scheduler_process:
        raise RuntimeError("launch_server.run_scheduler_process is not gpu_worker.run_scheduler_process "
                           f"(found {module.run_scheduler_process!r}); another patch owns the worker entry")
    for name in ("_run_disagg_role_process", "_run_http_server_process"):  # the entries call these
        ctx.setitem(mg_worker.ORIGINALS, name, getattr(module, name))
    for name, entry in mg_worker.ENTRIES.items():
        ctx.setattr(module, name, entry)
