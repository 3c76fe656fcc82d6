"""Pi0.5 action transport patches on sglang 0.5.17's real code, CPU only.

In-process: sglang's own FastAPI app (`http_server.create_app`), its `/v1/actions/generations`
endpoint and `/openpi/policy` websocket handler (starlette's TestClient), its request parsing and
image decoding (`entrypoints.vla.protocol`), its `AsyncSchedulerClient` over real ZMQ to a
scheduler stand-in thread that runs sglang's four Pi0.5 stages (real preprocessor with the offline
Gemma-style tokenizer, real postprocessor) on `StandInPi05Policy` (the only fake: no 3.35 B model).
Every answer is checked against what that policy must answer for its own request
(`fake_pi05_server.expected_actions`), with and without the patches, and the patched answers must
equal the unpatched ones; bad payloads get sglang's own error, unchanged.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
import threading

import numpy as np
import pytest
import zmq
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only
from sglang_ext_testkit import fake_pi05_server as stand_in
from sglang_ext_testkit import pi05_checkpoint as pc
from sglang_ext_testkit import pi05_clients as clients

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

TRANSPORT = ("mg_scheduler_client_reuse", "pi05_action_transport")


@pytest.fixture(scope="module")
def server_args(tmp_path_factory):
    """sglang serve's own ServerArgs for the checkpoint folder (weights are never read)."""
    import os

    from sglang_ext_testkit.server_process import free_port

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = pc.write_pi05_assets(tmp_path_factory.mktemp("assets") / "random-pi05")
    return pc.serve_args(folder, free_port(), free_port())


class SchedulerStandIn(threading.Thread):
    """A ROUTER on the scheduler endpoint running sglang's Pi0.5 stages for each request (what the
    GPU worker's scheduler does, without the process)."""

    def __init__(self, server_args, *, reply: bool = True) -> None:
        super().__init__(daemon=True)
        from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.pi05_preprocess import (
            Pi05Preprocessor)
        from sglang.multimodal_gen.runtime.pipelines_core.stages.vla import (
            VLAActionDenoisingStage, VLAActionPostprocessStage, VLAObservationPreprocessStage, VLAPrefixEncodingStage)
        from sglang.multimodal_gen.runtime.vla.prefix_cache import VLAPrefixCacheManager

        policy = stand_in.StandInPi05Policy(server_args.pipeline_config)
        self.stages = [VLAObservationPreprocessStage(Pi05Preprocessor(server_args.pipeline_config)),
                       VLAPrefixEncodingStage(policy, VLAPrefixCacheManager(max_entries=1)),
                       VLAActionDenoisingStage(policy), VLAActionPostprocessStage()]
        self.server_args, self.reply = server_args, reply
        self.identities, self.requests = [], 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(server_args.scheduler_endpoint)
        self._done = threading.Event()

    def run(self) -> None:
        from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch

        while not self._done.is_set():
            if not self._sock.poll(50):
                continue
            identity, _, payload = self._sock.recv_multipart()
            self.identities.append(identity)
            self.requests += 1
            try:
                received = pickle.loads(payload)
                batch = received[0] if isinstance(received, list) else received
                for stage in self.stages:
                    batch = stage.forward(batch, self.server_args)
                out = batch
            except Exception as exc:  # noqa: BLE001 - the worker turns errors into OutputBatch.error
                out = OutputBatch(error=f"Error executing request: {exc}")
            if self.reply:
                self._sock.send_multipart([identity, b"", pickle.dumps(out)])

    def close(self) -> None:
        self._done.set()
        self.join(5)
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture
def scheduler(server_args):
    running = SchedulerStandIn(server_args)
    running.start()
    yield running
    running.close()


def _app(server_args):
    from sglang.multimodal_gen.runtime.entrypoints.http_server import create_app

    return create_app(server_args)


def _expected(obs, config):
    first = obs.images[config.image_keys[0]]
    return stand_in.expected_actions(first, obs.state, obs.noise, config.action_horizon, config.action_dim,
                                     config.output_action_dim)


OBSERVATIONS = [clients.make_observation(seed, pc.CAMERAS) for seed in range(4)]


def _serve_requests(server_args):
    """JSON and OpenPI answers of the app for OBSERVATIONS: ([json actions], [openpi outputs])."""
    from fastapi.testclient import TestClient

    from sglang_ext_testkit.upstream import upstream

    pack_msgpack, unpack_msgpack = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:pack_msgpack"), upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:unpack_msgpack")

    json_answers, ws_answers = [], []
    with TestClient(_app(server_args)) as client:
        for obs in OBSERVATIONS:
            response = client.post("/v1/actions/generations", json=clients.json_body(obs))
            assert response.status_code == 200, response.text
            json_answers.append(response.json())
        with client.websocket_connect("/openpi/policy") as ws:
            metadata = unpack_msgpack(ws.receive_bytes())
            assert metadata["input"]["image_keys"] == list(pc.CAMERAS)
            for obs in OBSERVATIONS:
                ws.send_bytes(pack_msgpack(clients.openpi_payload(obs)))
                ws_answers.append(unpack_msgpack(ws.receive_bytes()))
    return json_answers, ws_answers


def _check_answers(server_args, json_answers, ws_answers):
    config = server_args.pipeline_config
    for obs, answer, output in zip(OBSERVATIONS, json_answers, ws_answers):
        want = _expected(obs, config)
        values = np.asarray(answer["data"][0]["action"]["values"], np.float32)
        assert answer["data"][0]["action"]["shape"] == [50, 7]
        np.testing.assert_allclose(values, want, rtol=0, atol=1e-5)
        assert isinstance(output["actions"], np.ndarray) and output["actions"].dtype == np.float32
        np.testing.assert_allclose(output["actions"], want, rtol=0, atol=1e-5)


def test_unpatched_app_answers_each_request_over_both_wires(server_args, scheduler):
    json_answers, ws_answers = _serve_requests(server_args)
    _check_answers(server_args, json_answers, ws_answers)
    # sglang 0.5.17 connects a new REQ socket per request: a new ROUTER identity each time
    assert scheduler.requests == 2 * len(OBSERVATIONS)
    assert len(set(scheduler.identities)) == scheduler.requests


@plugin_only
def test_patched_app_answers_the_same_reusing_one_socket(server_args, scheduler, ext_patches):
    unpatched = _serve_requests(server_args)
    first_identities = len(set(scheduler.identities))
    statuses = ext_patches()
    assert all(str(statuses[name]) == "applied" for name in TRANSPORT), {n: str(statuses[n]) for n in TRANSPORT}
    json_answers, ws_answers = _serve_requests(server_args)
    _check_answers(server_args, json_answers, ws_answers)
    for (ours, theirs) in zip(json_answers, unpatched[0]):
        assert ours["data"] == theirs["data"] and ours["usage"] == theirs["usage"]
    for (ours, theirs) in zip(ws_answers, unpatched[1]):
        assert np.array_equal(ours["actions"], theirs["actions"])
    # one socket served every sequential request of the patched app
    assert len(set(scheduler.identities)) == first_identities + 1
    # sglang's stage timings come through both wires, the same keys as unpatched and nothing added
    assert all(k in unpatched[0][0]["timings"] for k in ("preprocess_ms", "postprocess_ms"))
    for ours, theirs in zip(json_answers + ws_answers, unpatched[0] + unpatched[1]):
        assert set(ours["timings"]) == set(theirs["timings"]), (ours["timings"], theirs["timings"])
        assert all(v >= 0 for v in ours["timings"].values()), ours["timings"]


def _bad_requests(server_args):
    """Status and detail of sglang's answers to malformed bodies."""
    from fastapi.testclient import TestClient

    good = clients.json_body(OBSERVATIONS[0])
    bad_camera = {**good, "images": {**good["images"], pc.CAMERAS[1]: {"b64_json": "not*base64!"}}}
    no_data = {**good, "images": {pc.CAMERAS[0]: {"b64_json": ""}}}
    bodies = [b'{"prompt": "x", ', b'{"prompt": NaN, "state": [1e999]', json.dumps(bad_camera).encode(),
              json.dumps(no_data).encode(), json.dumps({**good, "runtime": {"response_format": "csv"}}).encode()]
    out = []
    with TestClient(_app(server_args), raise_server_exceptions=False) as client:
        for body in bodies:
            response = client.post("/v1/actions/generations", content=body,
                                   headers={"Content-Type": "application/json"})
            out.append((response.status_code, response.text))
    return out


@plugin_only
def test_bad_payloads_get_sglangs_own_errors(server_args, scheduler, ext_patches):
    unpatched = _bad_requests(server_args)
    reached_unpatched = scheduler.requests
    ext_patches()
    patched = _bad_requests(server_args)
    reached_patched = scheduler.requests - reached_unpatched
    assert patched == unpatched
    assert [status for status, _ in patched] == [400, 400, 400, 400, 400], patched
    assert "image payload requires b64_json" in patched[3][1]
    assert "response_format" in patched[4][1]
    # bad JSON and bad cameras stop in the HTTP process; sglang checks response_format only after the
    # answer (its own order, kept)
    assert reached_patched == reached_unpatched == 1


def test_json_body_parse_matches_json_loads_including_its_errors():
    from sglang_ext.pi05.action_transport import _ext_json_body

    bodies = [b'{"a": [1, 2.5, -3e-7], "b": {"c": "\\u00e9"}}', b'{"x": NaN, "y": Infinity}',
              b'{"big": 123456789012345678901234567890}', '{"s": "caf\u00e9"}'.encode("utf-16"),
              b'{"dup": 1, "dup": 2}', b'[1, 2]']
    for body in bodies:
        want = json.loads(body)
        got = _ext_json_body(body)
        assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    for body in (b'{"a": ', b"", b"{'single': 1}"):
        with pytest.raises(json.JSONDecodeError) as ours:
            _ext_json_body(body)
        with pytest.raises(json.JSONDecodeError) as theirs:
            json.loads(body)
        assert str(ours.value) == str(theirs.value)


INT64_EDGES = [2**63 - 1, -2**63, -2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**64]


def _same_value_and_types(got, want) -> bool:
    """Equal, with the same type at every level (1 == 1.0 would hide an integer read as a float)."""
    if type(got) is not type(want):
        return False
    if isinstance(want, dict):
        return list(got) == list(want) and all(_same_value_and_types(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(_same_value_and_types(g, w) for g, w in zip(got, want))
    return got == want


@pytest.mark.parametrize("value", INT64_EDGES)
def test_json_body_parse_keeps_integers_at_the_int64_edges(value):
    """orjson reads integers outside int64 / uint64 as floats; the body must parse as json.loads does."""
    from sglang_ext.pi05.action_transport import _ext_json_body

    for text in (f"{value}", f"[{value}]", f'{{"state": [0.5, {value}, 1]}}',
                 f'{{"a": {{"b": [[{value}]], "c": -1}}, "d": [{{"e": {value}}}]}}'):
        want = json.loads(text)
        got = _ext_json_body(text.encode())
        assert _same_value_and_types(got, want), (text, got, want)


def test_wide_int_check_looks_inside_lists_and_objects_at_every_depth():
    from sglang_ext.pi05.action_transport import _ext_maybe_wide_int

    edge = float(2**63)  # orjson's parse of -2**63 - 1 is -edge
    for parsed in (edge, -edge, [edge], {"a": -edge}, [1, {"b": [2.5, [edge]]}], {"a": [{"b": {"c": edge}}]}, 1e300):
        assert _ext_maybe_wide_int(parsed) is True, parsed
    below = float(2**63 - 1024)  # the largest float below 2**63: integral, and exact in int64
    for parsed in (below, -below, [2**63 - 1, -2**63], {"a": [1e18, 0.5]}, float("inf"), float("nan"),
                   "9223372036854775808", [], {}):
        assert _ext_maybe_wide_int(parsed) is False, parsed


def test_b64_decoding_gives_the_standard_librarys_bytes_and_errors():
    from sglang_ext.pi05.action_transport import _ext_b64decode

    raw = np.random.default_rng(0).integers(0, 256, 3001, dtype=np.uint8).tobytes()
    text = base64.b64encode(raw).decode()
    for variant in (text, text[:1000] + "\n" + text[1000:], text.rstrip("="), "", "!!!!"):
        try:
            want = base64.b64decode(variant)
        except Exception as exc:  # noqa: BLE001 - compared below
            with pytest.raises(type(exc), match=str(exc)):
                _ext_b64decode(variant)
        else:
            assert _ext_b64decode(variant) == want


@plugin_only
def test_cameras_decode_concurrently_into_the_same_images(server_args, ext_patches):
    from PIL import Image

    from sglang_ext_testkit.upstream import upstream

    protocol = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol")

    body = clients.json_body(OBSERVATIONS[1])
    body["images"]["extra_rgba"] = {"b64_json": _png(np.full((5, 7, 4), 200, np.uint8))}
    unpatched = protocol.build_action_sampling_params(json.loads(json.dumps(body)), server_args)
    ext_patches()
    assert protocol._normalize_observation.__wrapped__ is not None
    patched = protocol.build_action_sampling_params(json.loads(json.dumps(body)), server_args)
    assert set(patched.images) == set(unpatched.images) == {*pc.CAMERAS, "extra_rgba"}
    for name in unpatched.images:
        ours, theirs = patched.images[name], unpatched.images[name]
        assert isinstance(ours, Image.Image) and ours.mode == theirs.mode == "RGB"
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    for name, image in OBSERVATIONS[1].images.items():
        assert np.array_equal(np.asarray(patched.images[name]), image)


@plugin_only
def test_json_state_and_noise_go_on_as_arrays_the_preprocessor_reads_the_same(server_args, ext_patches):
    """0.5.21+ walks every list of a request element by element on both sides of the scheduler hop: JSON state
    and noise lists go on as float64 arrays, which the real preprocessor turns into the same tensors and prompt
    (float32 rounding of doubles, subnormals and -0.0 included); lists numpy cannot read as numbers stay lists."""
    import torch

    from sglang_ext_testkit.upstream import upstream

    protocol = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol")
    preprocess = upstream("sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.pi05_preprocess")
    body = clients.json_body(OBSERVATIONS[2])
    body["state"] = [0.1, 1 / 3, -0.0, 1e-40, -1, 2 ** -126 * 1.5, 0.999999999, 7e-46]
    body["noise"][0][:3] = [1e-45, -0.0, 3]

    def build():
        return protocol.build_action_sampling_params(json.loads(json.dumps(body)), server_args)

    unpatched = build()
    ext_patches()
    patched = build()
    assert isinstance(unpatched.noise, list) and isinstance(unpatched.state, list)
    for field in ("state", "noise"):
        value = getattr(patched, field)
        assert isinstance(value, np.ndarray) and value.dtype == np.float64, (field, type(value))
        assert patched.observation[field] is value  # one array for the request's references, not three lists
    config = server_args.pipeline_config
    raw = lambda sp: {"prompt": sp.prompt, "images": dict(sp.images), "state": sp.state, "noise": sp.noise}  # noqa: E731
    want, got = preprocess.Pi05Preprocessor(config)(raw(unpatched)), preprocess.Pi05Preprocessor(config)(raw(patched))
    for field in ("state", "noise", "tokens"):
        a, b = getattr(want, field), getattr(got, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
        if a.is_floating_point():
            assert torch.equal(torch.signbit(a), torch.signbit(b)), field
    body["state"] = ["0.5"] * 8  # not numbers: sglang's own handling, unchanged
    assert build().state == ["0.5"] * 8


def _png(array) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@plugin_only
def test_a_socket_whose_round_trip_did_not_complete_is_closed_not_reused(server_args, ext_patches):
    ext_patches()
    from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request
    from sglang_ext_testkit.upstream import upstream
    build_action_sampling_params = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:build_action_sampling_params")
    from sglang.multimodal_gen.runtime.scheduler_client import AsyncSchedulerClient

    silent = SchedulerStandIn(server_args, reply=False)
    silent.start()
    client = AsyncSchedulerClient()
    try:
        async def cancelled_then_concurrent():
            client.initialize(server_args)
            req = prepare_request(server_args, build_action_sampling_params(
                clients.openpi_payload(OBSERVATIONS[0]), server_args))
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.forward(req), timeout=0.5)
            return list(client.__dict__.get("_ext_idle_sockets", []))

        idle = asyncio.run(cancelled_then_concurrent())
        assert idle == []  # the socket still waiting for its reply was closed
        assert silent.requests == 1
    finally:
        client.close()
        silent.close()


@plugin_only
def test_concurrent_requests_get_their_own_answers_and_sockets_are_kept(server_args, scheduler, ext_patches):
    ext_patches()
    from sglang_ext_testkit.upstream import upstream
    infer_action = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:infer_action")
    from sglang.multimodal_gen.runtime.scheduler_client import async_scheduler_client

    async def burst():
        async_scheduler_client.initialize(server_args)
        try:
            outputs = await asyncio.gather(*[infer_action(clients.openpi_payload(o), server_args)
                                             for o in OBSERVATIONS for _ in range(2)])
            idle = len(async_scheduler_client.__dict__.get("_ext_idle_sockets", []))
            again = await infer_action(clients.openpi_payload(OBSERVATIONS[0]), server_args)
            return outputs, idle, again
        finally:
            async_scheduler_client.close()

    outputs, idle, again = asyncio.run(burst())
    config = server_args.pipeline_config
    for i, output in enumerate(outputs):
        np.testing.assert_allclose(output["actions"], _expected(OBSERVATIONS[i // 2], config), rtol=0, atol=1e-5)
    assert 1 <= idle <= len(outputs)
    assert len(set(scheduler.identities)) == idle  # the last request reused one of them
    assert "_ext_idle_sockets" not in async_scheduler_client.__dict__  # close() closed them
    np.testing.assert_allclose(again["actions"], _expected(OBSERVATIONS[0], config), rtol=0, atol=1e-5)


@plugin_only
def test_large_arrays_reach_each_request_through_its_kept_sockets_folder(server_args, ext_patches):
    """0.5.23 spills a reply's large arrays into a folder the request socket's identity names (ipc_array):
    over one kept socket each request still gets its own arrays, and the folder goes with the socket."""
    from sglang.multimodal_gen.runtime import ipc_array

    if not hasattr(ipc_array, "array_ipc_request"):
        pytest.skip("per-request array folders are new in sglang 0.5.23 (0.5.17 spills into one shared folder)")
    ext_patches()
    import os

    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import OutputBatch
    from sglang.multimodal_gen.runtime.scheduler_client import AsyncSchedulerClient

    if ipc_array._array_ipc_dir() is None or not ipc_array.is_local_endpoint(server_args.scheduler_endpoint):
        pytest.skip("no writable /dev/shm or a remote endpoint: arrays travel inline")
    size = ipc_array._MIN_FILE_REF_BYTES // 4  # float32 elements: just large enough to be spilled
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(server_args.scheduler_endpoint)
    seen = []

    def serve(n):
        for _ in range(n):
            identity, _, payload = router.recv_multipart()
            value = pickle.loads(payload)
            seen.append(identity)
            out = OutputBatch(output=ipc_array.spill_large_arrays_to_file_refs(
                np.full(size, float(value), dtype=np.float32), identity))
            assert isinstance(out.output, ipc_array.NumpyArrayFileRef)  # really spilled into the folder
            router.send_multipart([identity, b"", pickle.dumps(out)])

    thread = threading.Thread(target=serve, args=(3,), daemon=True)
    thread.start()
    client = AsyncSchedulerClient()
    try:
        async def three():
            client.initialize(server_args)
            return [await asyncio.wait_for(client.forward(i), timeout=60) for i in (1, 2, 3)]

        outputs = asyncio.run(three())
        thread.join(10)
        assert [float(o.output[0]) for o in outputs] == [1.0, 2.0, 3.0]
        assert all(o.output.shape == (size,) and float(o.output[-1]) == float(i + 1) for i, o in enumerate(outputs))
        assert len(set(seen)) == 1  # one kept socket answered all three
        folder = os.path.join(ipc_array._array_ipc_dir(), seen[0].decode())
        assert os.path.isdir(folder) and os.listdir(folder) == []  # alive with its socket, its files consumed
    finally:
        client.close()
        router.close(linger=0)
        ctx.term()
    assert not os.path.exists(folder)  # closed with the socket
