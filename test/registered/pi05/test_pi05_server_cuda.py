"""Pi0.5 through the real server: `python -m sglang_ext.serve` and unpatched `sglang serve` 0.5.17.

The checkpoint is synthesized on the GPU machine (sglang_ext_testkit.pi05_checkpoint: sglang's
own Pi05 core model, 3.35 B, seeded random weights, a tiny Gemma-style tokenizer; reused from
SGLANG_EXT_TEST_PI05_CHECKPOINT while the machine is held). Each server is started in its own
process group on 127.0.0.1 (sglang_ext_testkit.server_process), gets two HTTP requests to
/v1/actions/generations (same layout, other images, state and noise), and is stopped:

- both servers: actions of shape [50, 7], finite, different for different inputs;
- sglang-ext: the worker's activation record lists pi05_graphs applied, and the graph
  counters it publishes (Prometheus multiprocess folder, read with MultiProcessCollector)
  show prefix and action graphs captured and replayed, resident <= capacity;
- unpatched: the same requests give the same actions within bf16 noise (relative max-abs
  difference <= 5e-2 of the largest action: merged GEMMs and graphs reorder bf16 sums).

Server logs go to SGX_TEST_LOG_DIR (e.g. $OUT) or the test's tmp folder; their tails
are in every failure.
Run the two servers in separate device calls if one call's time is short: `-k sglang_ext`
then `-k unpatched` (the checkpoint and the sglang-ext actions stay in /tmp while the
machine is held, so the comparison still happens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch

from sglang.test.ci.ci_register import register_cuda_ci

from conftest import plugin_only  # noqa: E402  (test/registered/conftest.py)
from sglang_ext_testkit import pi05_checkpoint

register_cuda_ci(est_time=900, stage="base-b", runner_config="1-gpu-small")

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), plugin_only]  # starts the launcher

CHECKPOINT, START_TIMEOUT = pi05_checkpoint.CHECKPOINT_DIR, pi05_checkpoint.SERVER_START_TIMEOUT
REQUEST_TIMEOUT = 300.0
SERVER_TOLERANCE = 5e-2
CACHES = ("pi05_prefix_graph", "pi05_action_graph")
# The sglang-ext server's actions, kept for the unpatched test (also when it runs in a later call).
EXT_ACTIONS = CHECKPOINT.rstrip("/") + ".sglang_ext-actions.npy"


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k != "SGLANG_EXT" and not k.startswith("SGLANG_EXT_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="module")
def checkpoint():
    from sglang_ext_testkit import pi05_checkpoint

    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "sglang_ext_testkit.pi05_checkpoint", CHECKPOINT],
                         env=_clean_env(), capture_output=True, text=True, timeout=900)
    print(out.stdout[-2000:])
    assert out.returncode == 0, f"checkpoint synthesis failed:\n{out.stderr[-4000:]}"
    print(f"checkpoint ready in {time.monotonic() - started:.0f} s")
    assert os.path.exists(os.path.join(CHECKPOINT, "COMPLETE"))
    return pi05_checkpoint


def _post(server, payload) -> dict:
    request = urllib.request.Request(server.url + "/v1/actions/generations", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return json.loads(response.read())
    except Exception as exc:  # noqa: BLE001 - re-raised with the server's log
        body = getattr(exc, "read", lambda: b"")()
        raise AssertionError(f"request failed: {exc} {body[:2000]!r}\nserver log:\n{server.log_tail()}") from exc


def _actions(spec, response, server):
    action = response["data"][0]["action"]
    values = np.asarray(action["values"], dtype=np.float32)
    expected = [spec.ACTION_HORIZON, spec.OUTPUT_ACTION_DIM]
    assert action["shape"] == expected and list(values.shape) == expected, (action["shape"], server.log_tail())
    assert np.isfinite(values).all(), "non-finite actions"
    return values


def _serve_two_requests(spec, argv, env, tmp_path, name):
    """Start the server, send the two requests; returns (server still running, [actions, actions])."""
    from sglang_ext_testkit.server_process import free_port, start_server

    port = free_port()
    log_path = os.path.join(os.environ.get("SGX_TEST_LOG_DIR") or str(tmp_path), f"pi05-{name}-server.log")
    server = start_server([*argv, "--model-path", CHECKPOINT,
                           "--pipeline-config-path", os.path.join(CHECKPOINT, "pipeline_config.json"),
                           "--host", "127.0.0.1", "--port", str(port), "--num-gpus", "1",
                           "--warmup-mode", "off", *pi05_checkpoint.serve_attention_args()], env, port, log_path)
    try:
        took = server.wait_healthy(START_TIMEOUT)
        print(f"[{name}] healthy after {took:.0f} s (log {log_path})")
        responses = [_post(server, spec.action_request(seed)) for seed in (1, 2)]
        actions = [_actions(spec, r, server) for r in responses]
        for r in responses:
            print(f"[{name}] timings {r.get('timings')} cache {r.get('cache')}")
        return server, actions
    except BaseException:
        print(f"[{name}] server log tail:\n{server.log_tail()}")
        server.stop()
        raise


def _read_graph_metrics(directory) -> dict:
    """{(metric, cache): value summed over processes} from a Prometheus multiprocess folder."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    values = {}
    for family in registry.collect():
        for sample in family.samples:
            cache = sample.labels.get("cache")
            if cache is None or not sample.name.startswith("sglang_ext_graph_"):
                continue
            key = (sample.name, cache)
            values[key] = values.get(key, 0.0) + sample.value
    return values


def _graphs_replayed(metrics) -> bool:
    return all(metrics.get(("sglang_ext_graph_captures_total", c), 0) >= 1
               and metrics.get(("sglang_ext_graph_hits_total", c), 0) >= 1 for c in CACHES)


def test_pi05_server_with_sglang_ext_returns_actions_and_replays_graphs(checkpoint, tmp_path):
    from sglang_ext.tools import doctor
    from sglang_ext.versions import installed_sglang_version, source_tree_version

    if os.path.exists(EXT_ACTIONS):
        os.remove(EXT_ACTIONS)

    metrics_dir, records_dir = tmp_path / "prometheus", tmp_path / "records"
    metrics_dir.mkdir()
    env = _clean_env(PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), SGLANG_EXT_ACTIVATION_DIR=str(records_dir))
    if installed_sglang_version() is None:  # unpacked source tree on the GPU machine
        import sglang

        version = source_tree_version(os.path.dirname(os.path.dirname(sglang.__file__)))
        if version:
            env["SGLANG_EXT_ASSUME_SGLANG"] = version
    server, actions = _serve_two_requests(
        checkpoint, [sys.executable, "-m", "sglang_ext.serve", "--ext-strict"], env, tmp_path, "sglang_ext")
    try:
        # counters are published at least every 0.5 s and on every capture: allow a few seconds
        deadline = time.monotonic() + 5.0
        metrics = _read_graph_metrics(metrics_dir)
        while not _graphs_replayed(metrics) and time.monotonic() < deadline:
            time.sleep(0.5)
            metrics = _read_graph_metrics(metrics_dir)
        records = doctor.read_records(str(records_dir))
    finally:
        server.stop()
    np.save(EXT_ACTIONS, np.stack(actions))
    print("graph metrics:", json.dumps({f"{n}{{cache={c}}}": v for (n, c), v in sorted(metrics.items())}))
    assert float(abs(actions[0] - actions[1]).max()) > 0, "actions do not depend on the inputs"

    applied_in = [r.get("role") for r in records
                  if r.get("pid") != server.proc.pid
                  and (r.get("patches") or {}).get("pi05_graphs", {}).get("state") == "applied"]
    assert applied_in, f"no worker record shows pi05_graphs applied: {[(r.get('role'), r.get('patches', {}).get('pi05_graphs')) for r in records]}"
    assert metrics, (f"no sglang_ext_graph_* metrics in {metrics_dir} (files: {os.listdir(metrics_dir)}); "
                     "the graph caches must publish them when PROMETHEUS_MULTIPROC_DIR is set")
    for cache in CACHES:
        def value(name):
            return metrics.get((name, cache), 0.0)

        assert value("sglang_ext_graph_captures_total") >= 1, (cache, metrics)
        assert value("sglang_ext_graph_hits_total") >= 1, (cache, metrics)
        resident, capacity = value("sglang_ext_graph_resident"), value("sglang_ext_graph_capacity")
        assert 1 <= resident and (capacity <= 0 or resident <= capacity), (cache, resident, capacity)


def test_pi05_server_unpatched_returns_the_same_actions(checkpoint, tmp_path):
    launch = ("import sys; from sglang.cli.main import main; "
              "sys.argv = ['sglang', 'serve', *sys.argv[1:]]; main()")
    server, actions = _serve_two_requests(
        checkpoint, [sys.executable, "-c", launch], _clean_env(SGLANG_EXT="0"), tmp_path, "unpatched")
    try:
        log = server.log_tail(200_000)
    finally:
        server.stop()
    assert "sglang-ext: patch" not in log, "sglang-ext was active in the unpatched server"
    assert float(abs(actions[0] - actions[1]).max()) > 0, "actions do not depend on the inputs"
    if not os.path.exists(EXT_ACTIONS):
        print(f"not compared: no sglang-ext actions at {EXT_ACTIONS} (run the sglang_ext test first)")
        return
    patched = np.load(EXT_ACTIONS)
    for index, (ours, theirs) in enumerate(zip(patched, actions)):
        scale = max(float(np.abs(theirs).max()), 1e-6)
        relative = float(np.abs(ours - theirs).max()) / scale
        print(f"request {index}: max|ext - unpatched| / max|unpatched| = {relative:.3e} "
              f"(bit-equal {np.array_equal(ours, theirs)})")
        assert relative <= SERVER_TOLERANCE, (index, relative)
