"""Observations that break a robot loop (patch pi05_observation_checks), on sglang 0.5.17's real code, CPU only.

sglang's own FastAPI app, its `/v1/actions/generations` endpoint and `/openpi/policy` websocket, its request
parsing, the ZMQ hop and sglang's four Pi0.5 stages with the real preprocessor (test_pi05_transport's
scheduler stand-in; the only fake is the policy). Each bad observation gets one line naming its field (JSON:
400; OpenPI: `{"error": ...}` on the same connection), and the next good observation gets its own answer.
"""

from __future__ import annotations

import numpy as np
import pytest

from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only
from sglang_ext_testkit import pi05_checkpoint as pc
from sglang_ext_testkit import pi05_clients as clients

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

from test_pi05_transport import _app, _expected, scheduler, server_args  # noqa: E402,F401

GOOD = clients.make_observation(7, pc.CAMERAS, fixed_state=False)


def _openpi(**changes):
    payload = clients.openpi_payload(GOOD)
    for key, value in changes.items():
        if value is None:
            payload.pop(key, None)
        else:
            payload[key] = value
    return payload


NAN_STATE = GOOD.state.copy()
NAN_STATE[3] = np.nan
INF_NOISE = GOOD.noise.copy()
INF_NOISE[0, 0] = np.inf
CAM0, CAM1 = (f"observation.images.{name}" for name in pc.CAMERAS)

# (case, OpenPI payload, the field its error must name)
OPENPI_CASES = [
    ("nan state", _openpi(**{"observation.state": NAN_STATE}), "state: NaN or infinite"),
    ("infinite state", _openpi(**{"observation.state": np.full(8, np.inf, np.float32)}), "state: NaN or infinite"),
    ("infinite noise", _openpi(**{"observation.noise": INF_NOISE}), "noise: NaN or infinite"),
    ("camera without channels", _openpi(**{CAM0: np.zeros((224, 224), np.uint8)}), f"images.{pc.CAMERAS[0]}: shape"),
    ("camera with 5 channels", _openpi(**{CAM0: np.zeros((224, 224, 5), np.uint8)}), f"images.{pc.CAMERAS[0]}: shape"),
    ("empty camera", _openpi(**{CAM0: np.zeros((0, 0, 3), np.uint8)}), f"images.{pc.CAMERAS[0]}: shape"),
    ("nan float camera", _openpi(**{CAM0: np.full((224, 224, 3), np.nan, np.float32)}), f"images.{pc.CAMERAS[0]}:"),
    # sglang's benchmarks/bench_pi05_openpi.py, LIBERO profile: cameras `image`, `image2`
    ("unknown camera names", _openpi(**{CAM0: None, CAM1: None, "observation.images.image": GOOD.images[pc.CAMERAS[0]],
                                        "observation.images.image2": GOOD.images[pc.CAMERAS[1]]}),
     "images: unknown camera(s) 'image', 'image2'"),
    ("no camera", _openpi(**{CAM0: None, CAM1: None}), "images: no usable camera"),
]


def _single_line_naming(text: str, field: str) -> None:
    assert "\n" not in text.strip() and "Traceback" not in text, text
    assert field in text, (field, text)


@plugin_only
@pytest.mark.parametrize("case", [c[0] for c in OPENPI_CASES])
def test_openpi_refuses_a_bad_observation_in_one_line_and_serves_the_next(server_args, scheduler, ext_patches, case):
    from fastapi.testclient import TestClient

    from sglang_ext_testkit.upstream import upstream

    pack_msgpack, unpack_msgpack = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:pack_msgpack"), upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:unpack_msgpack")

    statuses = ext_patches()
    assert str(statuses["pi05_observation_checks"]) == "applied"
    _, payload, field = next(c for c in OPENPI_CASES if c[0] == case)
    with TestClient(_app(server_args)) as client, client.websocket_connect("/openpi/policy") as ws:
        unpack_msgpack(ws.receive_bytes())
        ws.send_bytes(pack_msgpack(payload))
        refused = unpack_msgpack(ws.receive_bytes())
        assert "actions" not in refused
        _single_line_naming(refused["error"], field)
        ws.send_bytes(pack_msgpack(clients.openpi_payload(GOOD)))  # the same connection serves on
        answer = unpack_msgpack(ws.receive_bytes())
    np.testing.assert_allclose(answer["actions"], _expected(GOOD, server_args.pipeline_config), rtol=0, atol=1e-5)


def _json_cases():
    good = clients.json_body(GOOD)
    return [
        ("nan state", {**good, "state": [float("nan")] * 8}, "state: NaN or infinite"),
        ("infinite noise", {**good, "noise": [[float("inf")] * 32] * 50}, "noise: NaN or infinite"),
        ("unknown camera", {**good, "images": {"image": good["images"][pc.CAMERAS[0]]}, "camera_order": None},
         "images: unknown camera(s) 'image'"),
        ("all cameras masked", {**good, "image_masks": {name: False for name in pc.CAMERAS}},
         "images: no usable camera"),
    ]


@plugin_only
def test_json_refuses_bad_observations_with_400_naming_the_field(server_args, scheduler, ext_patches):
    import json

    from fastapi.testclient import TestClient

    ext_patches()
    with TestClient(_app(server_args), raise_server_exceptions=False) as client:
        for case, body, field in _json_cases():
            body = {k: v for k, v in body.items() if v is not None}
            response = client.post("/v1/actions/generations", content=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"})
            assert response.status_code == 400, (case, response.status_code, response.text)
            _single_line_naming(response.json()["detail"], field)
            good = client.post("/v1/actions/generations", json=clients.json_body(GOOD))
            assert good.status_code == 200, good.text
            values = np.asarray(good.json()["data"][0]["action"]["values"], np.float32)
            np.testing.assert_allclose(values, _expected(GOOD, server_args.pipeline_config), rtol=0, atol=1e-5)


def test_camera_checks_name_the_allowed_cameras():
    from sglang_ext.pi05.observation_checks import check_cameras, check_values

    keys = ("base_0_rgb", "left_wrist_0_rgb")
    check_cameras({"left_wrist_0_rgb": object()}, {}, None, keys)  # a missing first camera is usable
    with pytest.raises(ValueError, match=r"^images: unknown camera\(s\) 'image'; allowed: base_0_rgb, "
                                         r"left_wrist_0_rgb \(the checkpoint's cameras\), or name the order in "
                                         r"camera_order$"):
        check_cameras({"image": object()}, {}, None, keys)
    check_cameras({"image": object(), "extra": object()}, {}, ["image"], keys)  # the request's own order
    with pytest.raises(ValueError, match="no usable camera"):
        check_cameras({"extra": object()}, {}, ["image"], keys)
    with pytest.raises(ValueError, match="no usable camera"):
        check_cameras({"base_0_rgb": object()}, {"base_0_rgb": False}, None, keys)
    check_values({"state": [0.5, -1.5], "noise": None}, {"cam": np.zeros((3, 8, 8), np.float32)})
    import torch

    check_values({}, {"cam": torch.zeros(1, 3, 8, 8, dtype=torch.bfloat16)})  # a torch frame, batch of one
    with pytest.raises(ValueError, match=r"^images\.cam: NaN or infinite"):
        check_values({}, {"cam": torch.full((3, 8, 8), float("nan"), dtype=torch.bfloat16)})
    check_cameras(["not", "a", "dict"], None, None, keys)  # other forms: sglang's own parsing answers
    with pytest.raises(ValueError, match=r"^state: NaN or infinite values are not allowed; allowed: finite numbers$"):
        check_values({"observation.state": [np.nan]}, {})


@plugin_only
def test_the_worker_refuses_what_reaches_it_another_way(server_args, ext_patches):
    """Requests that do not come through the HTTP process (sglang's Python API) are checked by the preprocess stage."""
    from types import SimpleNamespace

    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.pi05_preprocess import (
        Pi05Preprocessor)
    from sglang.multimodal_gen.runtime.pipelines_core.stages.vla import VLAObservationPreprocessStage

    ext_patches()
    stage = VLAObservationPreprocessStage(Pi05Preprocessor(server_args.pipeline_config))
    raw = {"images": {"image": GOOD.images[pc.CAMERAS[0]]}, "state": GOOD.state}
    batch = SimpleNamespace(prompt="go", extra={"vla": {"observation": raw}})
    with pytest.raises(ValueError, match=r"^invalid observation: images: unknown camera\(s\) 'image'; allowed: "):
        stage.forward(batch, server_args)
    raw["images"] = {pc.CAMERAS[1]: GOOD.images[pc.CAMERAS[1]]}  # the first camera missing: served
    stage.forward(batch, server_args)
    observation = batch.extra["vla"]["observation_batch"]
    assert [bool(observation.image_masks[name]) for name in pc.CAMERAS] == [False, True]


@plugin_only
def test_the_http_process_knows_the_checkpoints_cameras(server_args, ext_patches):
    """sglang applies the checkpoint's config.json in the worker only; the HTTP process reports and checks the
    checkpoint's cameras (LIBERO-like: two), not the pipeline config's default three."""
    import copy

    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig

    ext_patches()
    from sglang_ext_testkit.upstream import upstream
    action_metadata, build_action_sampling_params = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:action_metadata"), upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:build_action_sampling_params")

    http_args = copy.copy(server_args)
    http_args.pipeline_config = Pi05PipelineConfig()  # as the HTTP process has it: the defaults
    assert len(http_args.pipeline_config.image_keys) == 3
    assert action_metadata(http_args)["input"]["image_keys"] == list(pc.CAMERAS)
    third = _openpi(**{"observation.images.right_wrist_0_rgb": GOOD.images[pc.CAMERAS[0]]})
    with pytest.raises(ValueError, match=r"^images: unknown camera\(s\) 'right_wrist_0_rgb'; allowed: "
                                         + ", ".join(pc.CAMERAS)):
        build_action_sampling_params(third, http_args)


@plugin_only
def test_sglangs_libero_bench_runs_to_the_end_refused_request_by_request(server_args, tmp_path):
    """sglang's own benchmarks/bench_pi05_openpi.py, LIBERO profile (cameras `image`, `image2`), against
    sglang's real server (every process; the stand-in policy of fake_pi05_server) with sglang-ext on: it
    runs to the end, each request refused in one line, and the server then answers a good observation."""
    import os
    import subprocess
    import sys

    from sglang_ext_testkit.server_process import free_port, start_server

    folder = pc.write_pi05_assets(tmp_path / "random-pi05")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_EXT")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    port = free_port()
    server = start_server([sys.executable, "-m", "sglang_ext_testkit.fake_pi05_server", "--ext", "--model-path",
                           str(folder), "--pipeline-config-path", str(folder / "pipeline_config.json"), "--host",
                           "127.0.0.1", "--port", str(port), "--num-gpus", "1", "--warmup-mode", "off"],
                          env, port, tmp_path / "server.log")
    try:
        server.wait_healthy(300)
        bench = subprocess.run(
            [sys.executable, "-m", "sglang.multimodal_gen.benchmarks.bench_pi05_openpi", "--profile", "libero",
             "--skip-openpi", "--sglang-api", "openpi_ws", "--sglang-url", server.url, "--batch-size", "1",
             "--num-samples", "3", "--repeats", "3", "--warmup", "1", "--disable-prefix-cache",
             "--output-file", str(tmp_path / "bench.json")], env=env, capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stderr[-3000:]
        client = clients.OpenPIClient(server.url)
        libero = {"prompt": "go", "observation.images.image": GOOD.images[pc.CAMERAS[0]],
                  "observation.images.image2": GOOD.images[pc.CAMERAS[1]], "observation.state": GOOD.state}
        with pytest.raises(RuntimeError, match=r"server error: images: unknown camera\(s\) 'image', 'image2'"):
            client.infer(libero)
        answer = client.infer(clients.openpi_payload(GOOD))  # the same connection, then a good observation
        client.close()
    except BaseException:
        print(server.log_tail())
        raise
    finally:
        server.stop()
    np.testing.assert_allclose(answer.actions, _expected(GOOD, server_args.pipeline_config), rtol=0, atol=1e-5)
