"""The multimodal_gen worker around the Pi0.5 pipeline, on sglang 0.5.17's real code, CPU only.

Patch mg_worker_request_overhead. Memory snapshots: sglang's own `capture_memory_snapshot` against
ours on the same CUDA allocator statistics (the only fake: the table a GPU's allocator would return).
Stage logs: sglang's four Pi0.5 stages, run through their real `PipelineStage.__call__` on
requests built by sglang's own action endpoint code (real preprocessor, `StandInPi05Policy` for
the 3.35 B model): the same answers, their stage lines at debug level, other requests unchanged.
"""

from __future__ import annotations

import importlib
import logging
import types

import numpy as np
import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only
from sglang_ext_testkit import fake_pi05_server as stand_in
from sglang_ext_testkit import pi05_checkpoint as pc
from sglang_ext_testkit import pi05_clients as clients

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

MIB = 1024**2


def _allocator_table(seed: int) -> dict:
    """A table shaped like torch.cuda.memory_stats_as_nested_dict() on a GPU."""
    rng = np.random.default_rng(seed)
    pools = ("all", "small_pool", "large_pool")
    fields = ("current", "peak", "allocated", "freed")
    table = {name: {pool: {f: int(rng.integers(0, 80 * 1024**3)) for f in fields} for pool in pools}
             for name in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                          "active_bytes", "inactive_split_bytes", "requested_bytes")}
    table.update({"num_alloc_retries": 0, "num_ooms": 0, "num_device_alloc": 3, "max_split_size": -1,
                  "oversize_allocations": dict.fromkeys(fields, 0), "oversize_segments": dict.fromkeys(fields, 0)})
    return table


@pytest.fixture
def cuda_allocator(monkeypatch):
    """torch.cuda as the worker sees it on a GPU, its allocator statistics `state["table"]`; counts reads."""
    importlib.import_module("sglang.multimodal_gen.runtime.managers.gpu_worker")  # before torch.cuda is faked

    state = {"table": _allocator_table(0), "reads": 0}

    def nested(device=None):
        state["reads"] += 1
        return state["table"]

    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", nested)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: torch.cuda)
    return state


@plugin_only
def test_worker_snapshots_equal_sglangs_from_one_read(cuda_allocator, ext_patches):
    from sglang.multimodal_gen.runtime.managers import gpu_worker
    from sglang.multimodal_gen.runtime.utils import perf_logger

    assert gpu_worker.capture_memory_snapshot is perf_logger.capture_memory_snapshot
    statuses = ext_patches()
    assert str(statuses["mg_worker_request_overhead"]) == "applied"
    assert gpu_worker.capture_memory_snapshot is not perf_logger.capture_memory_snapshot
    for seed, table in enumerate([_allocator_table(1), _allocator_table(2), {}]):  # {}: CUDA not initialized
        cuda_allocator["table"] = table
        before = cuda_allocator["reads"]
        theirs = perf_logger.capture_memory_snapshot()
        assert cuda_allocator["reads"] - before == 4, seed  # sglang: one full table per getter
        ours = gpu_worker.capture_memory_snapshot()
        assert cuda_allocator["reads"] - before == 5, seed
        assert ours == theirs, seed
        assert ours.allocated_mb == table.get("allocated_bytes", {}).get("all", {}).get("current", 0) / MIB


@plugin_only
def test_other_devices_take_sglangs_snapshot(monkeypatch, ext_patches):
    from sglang.multimodal_gen.runtime.managers import gpu_worker
    from sglang.multimodal_gen.runtime.utils import perf_logger

    ext_patches()
    calls = []
    original = perf_logger.capture_memory_snapshot
    monkeypatch.setattr(perf_logger, "capture_memory_snapshot", lambda: calls.append(1) or original())
    other_device = types.SimpleNamespace(is_available=lambda: False)  # a device module that is not torch.cuda
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: other_device)
    assert gpu_worker.capture_memory_snapshot() == original()
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: torch.cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_worker.capture_memory_snapshot() == original()
    assert len(calls) == 2


@pytest.fixture(scope="module")
def server_args(tmp_path_factory):
    import os

    from sglang_ext_testkit.server_process import free_port

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pc.serve_args(pc.write_pi05_assets(tmp_path_factory.mktemp("assets") / "random-pi05"),
                         free_port(), free_port())


def _stages(server_args):
    """sglang's four Pi0.5 stages (built after activation, as in the worker) on the stand-in policy."""
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.pi05_preprocess import (
        Pi05Preprocessor)
    from sglang.multimodal_gen.runtime.pipelines_core.stages.vla import (
        VLAActionDenoisingStage, VLAActionPostprocessStage, VLAObservationPreprocessStage, VLAPrefixEncodingStage)
    from sglang.multimodal_gen.runtime.vla.prefix_cache import VLAPrefixCacheManager

    policy = stand_in.StandInPi05Policy(server_args.pipeline_config)
    return [VLAObservationPreprocessStage(Pi05Preprocessor(server_args.pipeline_config)),
            VLAPrefixEncodingStage(policy, VLAPrefixCacheManager(max_entries=1)),
            VLAActionDenoisingStage(policy), VLAActionPostprocessStage()]


def _run_action_request(server_args, seed: int):
    """(actions, [(level, message)] of the stage lines) of one request through the stages' __call__."""
    from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request
    from sglang_ext_testkit.upstream import upstream
    build_action_sampling_params = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:build_action_sampling_params")

    obs = clients.make_observation(seed, pc.CAMERAS)
    batch = prepare_request(server_args, build_action_sampling_params(clients.openpi_payload(obs), server_args))
    records = _StageLines()
    with records:
        for stage in _stages(server_args):
            batch = stage(batch, server_args)
    return obs, batch.output[0]["actions"], records.lines


class _StageLines(logging.Handler):
    """Collects the stage start/finish lines of sglang's stage logger while active (at every level)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines = []
        self._logger = logging.getLogger("sglang.multimodal_gen.runtime.pipelines_core.stages.base")

    def emit(self, record) -> None:
        message = record.getMessage()
        if "started..." in message or "finished in" in message or "Error during execution" in message:
            self.lines.append((record.levelno, message))

    def __enter__(self):
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self)


@pytest.fixture
def info_logging():
    """sglang's stage logger at info level (as `sglang serve` runs); restored afterwards."""
    logger = logging.getLogger("sglang.multimodal_gen.runtime.pipelines_core.stages.base")
    saved = logger.level
    logger.setLevel(logging.INFO)
    yield logger
    logger.setLevel(saved)


@plugin_only
def test_action_stage_lines_go_to_debug_with_the_same_answers(server_args, info_logging, ext_patches):
    obs, theirs, unpatched_lines = _run_action_request(server_args, 0)
    want = stand_in.expected_actions(obs.images[pc.CAMERAS[0]], obs.state, obs.noise, pc.ACTION_HORIZON,
                                     pc.ACTION_DIM, pc.OUTPUT_ACTION_DIM)
    np.testing.assert_allclose(theirs, want, rtol=0, atol=1e-5)
    assert [level for level, _ in unpatched_lines] == [logging.INFO] * 8  # 0.5.17: start + finish of 4 stages
    statuses = ext_patches()
    assert str(statuses["mg_worker_request_overhead"]) == "applied"
    _, ours, patched_lines = _run_action_request(server_args, 0)
    assert np.array_equal(ours, theirs)
    assert patched_lines == []  # debug lines, and the logger is at info
    info_logging.setLevel(logging.DEBUG)
    _, _, debug_lines = _run_action_request(server_args, 0)
    assert [level for level, _ in debug_lines] == [logging.DEBUG] * 8
    assert [m.split("]")[0] for _, m in debug_lines] == [m.split("]")[0] for _, m in unpatched_lines]


def _plain_stage(fail: bool):
    from sglang.multimodal_gen.runtime.pipelines_core.stages.base import PipelineStage

    class PlainStage(PipelineStage):
        def forward(self, batch, server_args):
            if fail:
                raise ValueError("stage failed")
            return batch

    return PlainStage()


@plugin_only
def test_other_requests_and_errors_log_as_sglang(server_args, info_logging, ext_patches):
    from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
    from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request
    from sglang_ext_testkit.upstream import upstream
    build_action_sampling_params = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:build_action_sampling_params")
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req

    def lines(batch, fail):
        with _StageLines() as records:
            try:
                _plain_stage(fail)(batch, server_args)
            except ValueError:
                pass
        return [(level, message.split(" after ")[0].split(" in ")[0]) for level, message in records.lines]

    action = prepare_request(server_args, build_action_sampling_params(
        clients.openpi_payload(clients.make_observation(0, pc.CAMERAS)), server_args))
    other = Req(sampling_params=SamplingParams())  # a video request
    unpatched = [lines(other, False), lines(other, True), lines(action, True)]
    ext_patches()
    assert lines(other, False) == unpatched[0] and [lv for lv, _ in unpatched[0]] == [logging.INFO] * 2
    assert lines(other, True) == unpatched[1]
    # an action request's failure is still logged at error level; only its "started" line is debug
    assert [lv for lv, _ in unpatched[2]] == [logging.INFO, logging.ERROR]
    assert lines(action, True) == [entry for entry in unpatched[2] if entry[0] == logging.ERROR]
