"""Robot-side clients of a Pi0.5 server, with per-request timing: the OpenPI websocket
(`/openpi/policy`, msgpack with numpy arrays) and the JSON action endpoint
(`/v1/actions/generations`, cameras as base64 PNG). Used by `scripts/bench_pi05_server.py`,
the robot-loop GPU test and the CPU tests of the transport patches.

Every request's record holds the client's own times (encode, round trip, decode, total, ms)
and the answer's `timings` (sglang's stage times): `breakdown()` splits a record into where the
time went.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

import numpy as np

PROMPT = "pick up the red block and put it in the basket"
# sglang's stage timings (VLA pipeline): their sum is the time inside the pipeline
STAGE_KEYS = ("preprocess_ms", "cache_lookup_ms", "prefix_ms", "action_denoise_ms", "postprocess_ms")


# Tasks a robot switches between (robot_stream): prompts of other lengths.
TASKS = (PROMPT, "open the top drawer and put the bowl inside", "turn on the stove",
         "push the plate to the front of the stove and then pick up the black bowl next to it")
MOTIONS = ("random", "smooth", "fixed")


@dataclass
class Observation:
    images: Dict[str, np.ndarray]  # camera -> uint8 HWC
    state: np.ndarray  # float32 [state_dim]
    noise: np.ndarray  # float32 [horizon, action_dim]
    seed: int
    prompt: str = PROMPT


def make_observation(seed: int, cameras: Sequence[str], *, state_dim: int = 8, horizon: int = 50,
                     action_dim: int = 32, size: int = 224, fixed_state: bool = True,
                     state: Optional[np.ndarray] = None, prompt: str = PROMPT) -> Observation:
    """Random cameras and noise from `seed`. The state is fixed by default (the prompt, which
    carries the discretized state, then has one token length: one graph layout); `state` sets it."""
    rng = np.random.default_rng(seed)
    images = {name: rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for name in cameras}
    if state is None:
        state = np.linspace(-0.8, 0.6, state_dim) if fixed_state else rng.uniform(-1, 1, state_dim)
    noise = rng.standard_normal((horizon, action_dim)).astype(np.float32)
    return Observation(images, np.asarray(state, np.float32), noise, seed, prompt)


def robot_stream(count: int, cameras: Sequence[str], *, motion: str, seed: int = 0, task_every: int = 50,
                 state_dim: int = 8, keep_first_camera: bool = False) -> list:
    """`count` observations of one robot, one per control step. `motion`: 'random' (a new state drawn in
    [-1, 1] every step), 'smooth' (every joint on its own slow sine) or 'fixed' (one state, one task, every
    camera: one prompt length). Moving robots switch task every `task_every` steps and, with the task, the
    cameras they send (every one, then each one alone, in the checkpoint's order). `keep_first_camera`:
    never drop the first camera (unpatched sglang 0.5.17 ends in a device-side assert without it)."""
    if motion not in MOTIONS:
        raise ValueError(f"motion: {motion!r} is not allowed; allowed: {', '.join(MOTIONS)}")
    rng = np.random.default_rng(seed)
    phase, speed = rng.uniform(0, 2 * np.pi, state_dim), rng.uniform(0.02, 0.08, state_dim)
    out = []
    for step in range(count):
        segment = step // task_every
        if motion == "fixed":
            out.append(make_observation(seed * 100_003 + step, cameras, state_dim=state_dim))
            continue
        state = rng.uniform(-1, 1, state_dim) if motion == "random" else 0.9 * np.sin(phase + speed * step)
        subsets = [list(cameras)] + [[c] for c in cameras] if len(cameras) > 1 else [list(cameras)]
        if keep_first_camera:
            subsets = [s for s in subsets if s[0] == cameras[0]]
        present = subsets[segment % len(subsets)]
        out.append(make_observation(seed * 100_003 + step, present, state_dim=state_dim, state=state,
                                    prompt=TASKS[segment % len(TASKS)]))
    return out


def openpi_payload(obs: Observation, *, steps: int = 10, prompt: Optional[str] = None) -> Dict[str, Any]:
    """An OpenPI-style observation, as sglang's bench_pi05_openpi.py sends it (numpy arrays)."""
    payload = {"prompt": obs.prompt if prompt is None else prompt, "observation.state": obs.state, "observation.noise": obs.noise,
               "num_inference_steps": steps, "enable_pi_prefix_cache": False, "enable_pi_cuda_graph": True,
               "output_format": "numpy"}
    for name, image in obs.images.items():
        payload[f"observation.images.{name}"] = image
    return payload


def png_b64(image: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def json_body(obs: Observation, *, steps: int = 10, prompt: Optional[str] = None,
              pngs: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """A /v1/actions/generations body: PNG cameras (base64), state and noise as JSON lists."""
    pngs = pngs or {name: png_b64(image) for name, image in obs.images.items()}
    return {"prompt": obs.prompt if prompt is None else prompt,
            "images": {name: {"b64_json": pngs[name]} for name in obs.images},
            "camera_order": list(obs.images), "state": obs.state.tolist(), "noise": obs.noise.tolist(),
            "num_inference_steps": steps,
            "runtime": {"cuda_graph": True, "prefix_cache": False, "return_timing": True}}


@dataclass
class Record:
    encode_ms: float
    round_trip_ms: float
    decode_ms: float
    total_ms: float
    actions: np.ndarray
    timings: Dict[str, float] = field(default_factory=dict)
    server_timing: Dict[str, float] = field(default_factory=dict)  # sglang's own OpenPI one (infer_ms, ...)


def _floats(mapping) -> Dict[str, float]:
    return {str(k): float(v) for k, v in (mapping or {}).items() if isinstance(v, (int, float))}


class OpenPIClient:
    """One persistent websocket to /openpi/policy; `infer` sends one observation, waits for its answer."""

    def __init__(self, url: str, timeout: float = 300.0) -> None:
        from websockets.sync.client import connect

        from sglang_ext_testkit.upstream import upstream

        pack_msgpack, unpack_msgpack = upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:pack_msgpack"), upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol:unpack_msgpack")

        self._pack, self._unpack = pack_msgpack, unpack_msgpack
        ws_url = url.replace("http://", "ws://").rstrip("/") + "/openpi/policy"
        self._ws = connect(ws_url, max_size=None, open_timeout=timeout, compression=None)
        self._timeout = timeout
        self.metadata = self._unpack(self._ws.recv(timeout=timeout))

    def infer(self, payload: Dict[str, Any]) -> Record:
        t0 = time.perf_counter()
        message = self._pack(payload)
        t1 = time.perf_counter()
        self._ws.send(message)
        answer = self._ws.recv(timeout=self._timeout)
        t2 = time.perf_counter()
        output = self._unpack(answer)
        if "error" in output:
            raise RuntimeError(f"server error: {str(output['error'])[-2000:]}")
        actions = np.asarray(output["actions"], dtype=np.float32)
        t3 = time.perf_counter()
        return Record((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t3 - t0) * 1e3, actions,
                      _floats(output.get("timings")), _floats(output.get("server_timing")))

    def close(self) -> None:
        self._ws.close()


class JsonActionClient:
    """One keep-alive HTTP connection to POST /v1/actions/generations."""

    def __init__(self, host: str, port: int, timeout: float = 300.0) -> None:
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout)

    def infer(self, body: Dict[str, Any]) -> Record:
        t0 = time.perf_counter()
        data = json.dumps(body).encode()
        t1 = time.perf_counter()
        self._conn.request("POST", "/v1/actions/generations", body=data, headers={"Content-Type": "application/json"})
        response = self._conn.getresponse()
        raw = response.read()
        t2 = time.perf_counter()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {raw[:2000]!r}")
        answer = json.loads(raw)
        actions = np.asarray(answer["data"][0]["action"]["values"], dtype=np.float32)
        t3 = time.perf_counter()
        return Record((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t3 - t0) * 1e3, actions,
                      _floats(answer.get("timings")))

    def close(self) -> None:
        self._conn.close()


def breakdown(record: Record) -> Dict[str, float]:
    """Where one request's time went (ms): the client's encode and decode, `pipeline` = sglang's stage
    times (and each stage's), `outside_pipeline` = the client's total minus them."""
    t = record.timings
    pipeline = sum(t.get(k, 0.0) for k in STAGE_KEYS)
    out = {"total": record.total_ms, "client_encode": record.encode_ms, "client_decode": record.decode_ms,
           "pipeline": pipeline, "outside_pipeline": record.total_ms - pipeline}
    out.update({k[:-3]: t[k] for k in STAGE_KEYS if k in t})
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, int(round(q / 100.0 * (len(ordered) - 1)))))
    return float(ordered[index])


_CAPTURE_LINE = re.compile(r"Captured VLA \S+ CUDA graph")
_EAGER_SINCE_LOAD = re.compile(r"VLA (\S+) CUDA graphs were captured at load: (\d+) requests ran eager since")


def graph_log_counts(log_path: str) -> Dict[str, int]:
    """From a Pi0.5 server's log: graphs captured so far (sglang's and sglang-ext's "Captured VLA ... CUDA
    graph" lines) and the requests that ran eager since the load-time capture, per graph kind (the last
    count sglang-ext logged; it logs the 1st, 2nd, 4th, ...: a lower bound)."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    counts = {"captures": len(_CAPTURE_LINE.findall(text))}
    for kind, count in _EAGER_SINCE_LOAD.findall(text):
        counts[f"eager_after_load_{kind}"] = int(count)
    return counts
