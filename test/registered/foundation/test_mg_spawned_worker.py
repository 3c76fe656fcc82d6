"""Patches reach spawned multimodal_gen GPU workers on sglang 0.5.17 (patch `mg_worker_activation`).

The parent activates sglang-ext (strict) and then starts children exactly as sglang's
`launch_server` module does: `multiprocessing.get_context("spawn").Process(target=<the
launch_server module global>, args=<the argument tuple sglang passes>)`. The only stand-in
is `server_args`: a `WorkerProbe` that, when sglang's original worker entry first reads it,
reports the child's own state through a pipe and exits before any GPU work. Every assertion
below is on state observed inside the child. On the patched tree the same route runs through
the fork's vendored copy (`sglang.ext`), activated the same way.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import ext_core, where_part_runs
from mg_worker_probe import EXT, WorkerProbe

register_cpu_ci(est_time=40, suite="base-a-test-cpu")
# the spawn route of 0.5.17; from 0.5.21 sglang's worker loads the multimodal_gen plugin group itself
pytestmark = where_part_runs("sglang_ext.mg_worker.spawn:patch_launch_server")

PATCH = "mg_worker_activation"
WRAPPER = f"{EXT}.mg_worker.entries:run_scheduler_process"
DISAGG_WRAPPER = f"{EXT}.mg_worker.entries:_run_disagg_role_process"
SGLANG_WORKER = "sglang.multimodal_gen.runtime.managers.gpu_worker:run_scheduler_process"
SGLANG_DISAGG = "sglang.multimodal_gen.runtime.launch_server:_run_disagg_role_process"
REPORT_TIMEOUT_S = 240


def _start(ctx, target, make_args, name):
    from sglang.multimodal_gen.runtime.disaggregation.roles import RoleType

    report_r, report_w = ctx.Pipe(duplex=False)
    _, scheduler_w = ctx.Pipe(duplex=False)  # the pipe_writer sglang passes; never written here
    probe = WorkerProbe(report_w, payload=RoleType.MONOLITHIC)
    proc = ctx.Process(target=target, args=make_args(probe, scheduler_w), name=name, daemon=True)
    proc.start()
    report_w.close()
    return proc, report_r


def _collect(proc, report_r):
    if not report_r.poll(REPORT_TIMEOUT_S):
        proc.kill()
        pytest.fail(f"spawned child {proc.name} sent no report (exitcode {proc.exitcode})")
    try:
        report = report_r.recv()
    except EOFError:
        proc.join(30)
        pytest.fail(f"spawned child {proc.name} died before reporting (exitcode {proc.exitcode})")
    proc.join(60)
    return report


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """Start four spawned children at once (their sglang imports overlap), collect their reports."""
    from sglang_ext.registry import PATCH_NAMES

    activation, mg_worker = ext_core("activation"), ext_core("mg_worker.entries")

    record_dir = tmp_path_factory.mktemp("activation-records")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_EXT", "1")
        env.setenv("SGLANG_EXT_STRICT", "1")
        # Only this patch: the test is about reaching the worker, not about the others' adapters.
        env.setenv("SGLANG_EXT_DISABLE", ",".join(n for n in PATCH_NAMES if n != PATCH))
        env.setenv("SGLANG_EXT_ACTIVATION_DIR", str(record_dir))
        activation.deactivate()
        activation.activate()

        from sglang.multimodal_gen.runtime import launch_server  # fires the armed part
        from sglang.multimodal_gen.runtime.managers import gpu_worker

        parent = {
            "status": str(activation.statuses()[PATCH]),
            "entry": launch_server.run_scheduler_process,
            "disagg_entry": launch_server._run_disagg_role_process,
            "entry_pickle": pickle.dumps(launch_server.run_scheduler_process),
            "http_entry": launch_server._run_http_server_process,
            "wrappers": tuple(mg_worker.ENTRIES[n] for n in (
                "run_scheduler_process", "_run_disagg_role_process", "_run_http_server_process")),
        }
        ctx = multiprocessing.get_context("spawn")
        started = {
            # launch_server.launch_server(): rank 0 of a 1-GPU server
            "monolithic": _start(
                ctx, launch_server.run_scheduler_process,
                lambda probe, w: (0, 0, 29999, probe, w, None, None, [], []),
                "sglang-diffusionWorker-0"),
            # launch_disagg_role() / launch_pool_disagg_server(): (gpu_id, local_rank, rank, args, writer, [], [])
            "disagg": _start(
                ctx, launch_server._run_disagg_role_process,
                lambda probe, w: (0, 0, 0, probe, w, [], []),
                "sglang-denoiser-r0"),
            # launch_server(--webui): the HTTP server child, _run_http_server_process(server_args)
            "http": _start(
                ctx, launch_server._run_http_server_process,
                lambda probe, w: (probe,),
                "sglang-diffusion-webui"),
            # Control: what launch_server spawns without the patch, same inherited SGLANG_EXT=1.
            "unpatched": _start(
                ctx, gpu_worker.run_scheduler_process,
                lambda probe, w: (0, 0, 29999, probe, w, None, None, [], []),
                "sglang-diffusionWorker-control"),
        }
        try:
            reports = {label: _collect(*started[label]) for label in started}
        finally:
            activation.deactivate()
        parent["entry_after_rollback"] = launch_server.run_scheduler_process
        parent["original"] = gpu_worker.run_scheduler_process
    yield parent, reports, record_dir


def test_parent_rebinds_worker_targets_to_picklable_sglang_ext_functions(children):
    parent, _, _ = children
    assert parent["status"] == "applied"
    assert (parent["entry"], parent["disagg_entry"], parent["http_entry"]) == parent["wrappers"]
    # The target pickles as a call of <EXT>.mg_worker.entries.worker_entry: the child imports sglang-ext.
    assert f"{EXT}.mg_worker.entries".encode() in parent["entry_pickle"] and b"worker_entry" in parent["entry_pickle"]
    assert parent["entry_after_rollback"] is parent["original"]


def test_monolithic_worker_activates_before_sglang_worker_entry(children):
    _, reports, _ = children
    child = reports["monolithic"]
    assert child["pid"] != os.getpid() and child["has_parent_process"]
    assert child["process_name"] == "sglang-diffusionWorker-0"
    assert child["statuses"][PATCH] == "applied"
    # knobs inherited through the environment: the other patches are disabled in the child too
    assert {n: s for n, s in child["statuses"].items() if n != PATCH} == {
        n: "disabled" for n in child["statuses"] if n != PATCH}
    assert child["worker_entry_is_sglang_ext_wrapper"] is True
    assert child["launch_server._run_disagg_role_process"] == DISAGG_WRAPPER
    stack = child["stack"]
    assert WRAPPER in stack and SGLANG_WORKER in stack
    assert stack.index(WRAPPER) < stack.index(SGLANG_WORKER), stack
    assert child["first_read"] == "log_level"  # sglang's configure_logger(server_args)
    # activated while unpickling the target, before the arguments imported sglang.multimodal_gen
    position = child["import_position"]
    assert position[f"{EXT}.activation"] < position["sglang.multimodal_gen"], position


def test_pool_disagg_worker_activates_before_sglang_worker_entry(children):
    _, reports, _ = children
    child = reports["disagg"]
    assert child["statuses"][PATCH] == "applied"
    assert child["worker_entry_is_sglang_ext_wrapper"] is True
    stack = child["stack"]
    # our disagg wrapper -> sglang's original _run_disagg_role_process -> (patched global) -> worker
    chain = [DISAGG_WRAPPER, SGLANG_DISAGG, WRAPPER, SGLANG_WORKER]
    assert all(frame in stack for frame in chain), stack
    assert [stack.index(f) for f in chain] == sorted(stack.index(f) for f in chain), stack


def test_webui_http_server_child_activates_before_sglang_http_server(children):
    _, reports, _ = children
    child = reports["http"]
    assert child["process_name"] == "sglang-diffusion-webui"
    assert child["statuses"][PATCH] == "applied"
    assert child["launch_server._run_http_server_process"] == f"{EXT}.mg_worker.entries:_run_http_server_process"
    stack = child["stack"]
    chain = [f"{EXT}.mg_worker.entries:_run_http_server_process",
             "sglang.multimodal_gen.runtime.launch_server:_run_http_server_process",
             "sglang.multimodal_gen.runtime.launch_server:launch_http_server_only"]
    assert all(frame in stack for frame in chain), stack
    assert [stack.index(f) for f in chain] == sorted(stack.index(f) for f in chain), stack


def test_unpatched_worker_target_gets_no_activation_on_0_5_17(children):
    """Control: SGLANG_EXT=1 alone does not reach a 0.5.17 worker (nothing there loads plugins)."""
    _, reports, _ = children
    child = reports["unpatched"]
    assert child["statuses"] == {}
    assert f"{EXT}.activation" not in child["import_position"]
    assert child["worker_entry_is_sglang_ext_wrapper"] is False
    assert child["launch_server.run_scheduler_process"] == SGLANG_WORKER
    assert WRAPPER not in child["stack"]


def test_worker_writes_its_activation_record(children):
    _, reports, record_dir = children
    child = reports["monolithic"]
    path = record_dir / f"sglang-diffusionWorker-0-{child['pid']}.json"
    assert path.exists(), sorted(p.name for p in record_dir.iterdir())
    record = json.loads(path.read_text())
    assert record["pid"] == child["pid"]
    assert record["patches"][PATCH]["state"] == "applied"
    assert not list(record_dir.glob(f"sglang-diffusionWorker-control-{reports['unpatched']['pid']}.json"))
