"""Activate sglang-ext inside spawned multimodal_gen GPU workers.

Target symbol(s): `sglang.multimodal_gen.runtime.launch_server.run_scheduler_process`
    (module global, `from ...managers.gpu_worker import run_scheduler_process`, used as
    `mp.Process(target=...)` by `launch_server()` and called by `_run_disagg_role_process`)
    and `launch_server._run_disagg_role_process` (spawn target of `launch_pool_disagg_server`
    and `launch_disagg_role`), and `launch_server._run_http_server_process` (the HTTP server
    child that `launch_server` spawns with `--webui`).
sglang versions: 0.5.17 (fingerprint-gated); not needed from 0.5.21.
Upstream PR: multimodal_gen plugin group `sglang.multimodal_gen.plugins`, first in 0.5.21
    (`runtime/managers/worker_bootstrap.py` loads plugins in every spawned worker).
Why: 0.5.17 spawns the workers (`diffusion_generator` forces the spawn start method) and
    nothing under multimodal_gen calls `load_plugins()`, so Pi0.5 patches applied in the
    `sglang serve` process would not exist where the graphs run.
How: rebind these launch_server globals to `sglang_ext.mg_worker.entries.ENTRIES` objects that pickle
    as a call of the top-level `sglang_ext.mg_worker.entries.worker_entry(name)`: the spawned child
    imports sglang_ext and activates while unpickling the target, before the arguments import
    sglang.multimodal_gen, then calls sglang's original entry. This deliberately uses
    `ctx.setattr` and not `ctx.transplant_function`: a transplanted function pickles as
    `launch_server.<name>` and the child would resolve that to the unpatched original.
    The fork patch series vendors this adapter too: a patched tree activates its own copy
    (`sglang.ext`) the same way, so its workers are reached by the same route.
Retire when: the minimum supported sglang is >= 0.5.21 (entry point registered under
    `sglang.multimodal_gen.plugins` in setup.py).
"""

from __future__ import annotations

import sys


def patch_launch_server(ctx, module) -> None:
    from sglang_ext.mg_worker import entries as mg_worker

    gpu_worker = sys.modules["sglang.multimodal_gen.runtime.managers.gpu_worker"]
    if module.run_scheduler_process is not gpu_worker.run_scheduler_process:
        raise RuntimeError(
            "launch_server.run_scheduler_process is not gpu_worker.run_scheduler_process "
            f"(found {module.run_scheduler_process!r}); another patch owns the worker entry"
        )
    ctx.setattr(module, "_ext_orig__run_disagg_role_process", module._run_disagg_role_process)
    ctx.setattr(module, "_ext_orig__run_http_server_process", module._run_http_server_process)
    for name, entry in mg_worker.ENTRIES.items():
        ctx.setattr(module, name, entry)
