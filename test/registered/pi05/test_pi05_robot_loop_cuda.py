"""A robot's closed control loop over /openpi/policy against `python -m sglang_ext.serve`.

Pi0.5 at the real size with random weights (the server test's checkpoint,
sglang_ext_testkit.pi05_checkpoint), on the H200. Two servers, one after another, both
sglang-ext with the transport patches and the defaults (graphs captured at load):

1. exact mode (`--ext-strict`): the loop's observations once each, over the OpenPI websocket;
   their actions are the reference;
2. the fast path (`--ext-strict --ext-pi05-fast`): the same observations
   in a closed loop (the next observation is sent when the previous answer has arrived), over one
   websocket, after WARMUP untimed steps of another stream.

The robot moves: a new random state every step (its prompt, which carries the discretized state,
changes length), a smooth trajectory after it, a task switch and another camera set (both cameras,
or one) every TASK_EVERY steps (sglang_ext_testkit.pi05_clients.robot_stream), random cameras and
noise per step.

Asserted on both servers: no CUDA graph captured after the server reported healthy and no request
run eager for want of a graph (their logs). On the fast server: one answer per observation, each
the answer to its own observation (max|fast - exact| / max|exact| <= 5e-3 and cosine >= 0.9999; a
mixed-up or dropped answer fails this), shape [50, 7], finite. The latency percentiles and their
breakdown (client, stages, outside the pipeline) are printed; latency targets are
scripts/bench_pi05_server.py's.
Server logs go to SGX_TEST_LOG_DIR or the test's tmp folder.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from sglang.test.ci.ci_register import register_cuda_ci

from conftest import plugin_only  # noqa: E402  (test/registered/conftest.py)
from sglang_ext_testkit import pi05_checkpoint

register_cuda_ci(est_time=720, stage="base-b", runner_config="1-gpu-small")

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), plugin_only]  # starts the launcher

CHECKPOINT, START_TIMEOUT = pi05_checkpoint.CHECKPOINT_DIR, pi05_checkpoint.SERVER_START_TIMEOUT
STEPS_PER_MOTION = 150  # random, then smooth: 300 control steps
TASK_EVERY = 50
WARMUP = 10
RELATIVE_TOLERANCE = 5e-3  # fast vs exact path, every answer
COSINE_FLOOR = 0.9999


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k != "SGLANG_EXT" and not k.startswith("SGLANG_EXT_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)
    from sglang_ext.versions import installed_sglang_version, source_tree_version

    if installed_sglang_version() is None:  # unpacked source tree on the GPU machine
        import sglang

        version = source_tree_version(os.path.dirname(os.path.dirname(sglang.__file__)))
        if version:
            env["SGLANG_EXT_ASSUME_SGLANG"] = version
    return env


@pytest.fixture(scope="module")
def checkpoint():
    from sglang_ext_testkit import pi05_checkpoint

    out = subprocess.run([sys.executable, "-m", "sglang_ext_testkit.pi05_checkpoint", CHECKPOINT],
                         env=_clean_env(), capture_output=True, text=True, timeout=900)
    print(out.stdout[-2000:])
    assert out.returncode == 0, f"checkpoint synthesis failed:\n{out.stderr[-4000:]}"
    return pi05_checkpoint


def _serve(name, flags, tmp_path):
    from sglang_ext_testkit.server_process import free_port, start_server

    port = free_port()
    log_path = os.path.join(os.environ.get("SGX_TEST_LOG_DIR") or str(tmp_path), f"pi05-loop-{name}-server.log")
    server = start_server([sys.executable, "-m", "sglang_ext.serve", "--ext-strict", *flags,
                           "--model-path", CHECKPOINT,
                           "--pipeline-config-path", os.path.join(CHECKPOINT, "pipeline_config.json"),
                           "--host", "127.0.0.1", "--port", str(port), "--num-gpus", "1", "--warmup-mode", "off",
                           *pi05_checkpoint.serve_attention_args()],
                          _clean_env(), port, log_path)
    try:
        print(f"[{name}] healthy after {server.wait_healthy(START_TIMEOUT):.0f} s (log {log_path})")
    except BaseException:
        server.stop()
        raise
    return server


def _observations(spec):
    from sglang_ext_testkit import pi05_clients

    return [o for seed, motion in enumerate(("random", "smooth"))
            for o in pi05_clients.robot_stream(STEPS_PER_MOTION, spec.CAMERAS, motion=motion, seed=seed,
                                               task_every=TASK_EVERY)]


def _answers(name, flags, payloads, tmp_path, warmup):
    """A server's answers to `payloads` over /openpi/policy, one at a time (a closed loop: the next
    observation once the answer is back), after `warmup` untimed ones; the loop's seconds; and the graph
    counts of its log after start-up (captures, requests run eager since the load-time capture)."""
    from sglang_ext_testkit import pi05_clients

    server = _serve(name, flags, tmp_path)
    try:
        at_start = pi05_clients.graph_log_counts(server.log_path)
        client = pi05_clients.OpenPIClient(server.url)
        for payload in warmup:
            client.infer(payload)
        loop_start = time.perf_counter()
        records = [client.infer(payload) for payload in payloads]
        loop_s = time.perf_counter() - loop_start
        client.close()
        after = pi05_clients.graph_log_counts(server.log_path)
    except BaseException:
        print(server.log_tail())
        raise
    finally:
        server.stop()
    eager = sum(v for k, v in after.items() if k.startswith("eager_after_load"))
    return records, loop_s, (after["captures"] - at_start["captures"], eager)


def test_moving_robot_loop_matches_exact_mode_without_captures_drops_or_tail_latency(checkpoint, tmp_path):
    from sglang_ext_testkit import pi05_clients
    from sglang_ext_testkit.pi05_random import cosine, relative_diff

    observations = _observations(checkpoint)
    payloads = [pi05_clients.openpi_payload(o) for o in observations]
    warmup = [pi05_clients.openpi_payload(o)
              for o in pi05_clients.robot_stream(WARMUP, checkpoint.CAMERAS, motion="random", seed=99)]

    exact, _, exact_graphs = _answers("exact", [], payloads, tmp_path, warmup=[])
    records, loop_s, fast_graphs = _answers("fast", ["--ext-pi05-fast"], payloads, tmp_path, warmup)
    exact = [r.actions for r in exact]
    print(f"[loop] prompt lengths vary; graphs captured after start / requests eager since load: exact "
          f"{exact_graphs}, fast {fast_graphs}")
    assert exact_graphs == (0, 0) and fast_graphs == (0, 0)

    assert len(records) == len(observations) == 2 * STEPS_PER_MOTION
    worst = (0.0, 1.0, -1)
    for step, (record, reference) in enumerate(zip(records, exact)):
        assert record.actions.shape == (checkpoint.ACTION_HORIZON, checkpoint.OUTPUT_ACTION_DIM), record.actions.shape
        assert np.isfinite(record.actions).all(), step
        got, want = torch.from_numpy(record.actions), torch.from_numpy(reference)
        relative, cos = relative_diff(got, want), cosine(got, want)
        if relative > worst[0] or cos < worst[1]:
            worst = (max(relative, worst[0]), min(cos, worst[1]), step)
        assert relative <= RELATIVE_TOLERANCE and cos >= COSINE_FLOOR, (
            f"step {step}: relative {relative:.3e}, cosine {cos:.7f} against its own observation's exact actions")
    # answers differ between observations: an answer for another observation would have failed above
    assert float(np.abs(records[0].actions - records[1].actions).max()) > 0

    totals = [r.total_ms for r in records]
    p50, p90, p99 = (pi05_clients.percentile(totals, q) for q in (50, 90, 99))
    parts = [pi05_clients.breakdown(r) for r in records]
    medians = {k: statistics.median(p[k] for p in parts) for k in parts[0] if all(k in p for p in parts)}
    print(f"[loop] {len(records)} steps in {loop_s:.2f} s; client p50 {p50:.2f} p90 {p90:.2f} p99 {p99:.2f} "
          f"max {max(totals):.2f} ms; p99/p50 {p99 / p50:.3f}; worst vs exact: relative {worst[0]:.3e}, "
          f"cosine {worst[1]:.7f}")
    print("[loop] p50 breakdown ms: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
