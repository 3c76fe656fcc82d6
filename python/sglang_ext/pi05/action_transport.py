"""The Pi0.5 action endpoints parse and decode requests faster, with the same results and errors.

Patch: pi05_action_transport
Targets: sglang.multimodal_gen.runtime.entrypoints.action.api:create_action_generation,
sglang.multimodal_gen.runtime.entrypoints.action.protocol:_decode_b64_image,
sglang.multimodal_gen.runtime.entrypoints.action.protocol:_normalize_observation
Upstream PR: none (0.5.23 parses and decodes the same way)
Retire when: upstream parses JSON fast, decodes cameras concurrently and sends number lists as arrays

Why: the HTTP process parses JSON and base64 with the standard library and decodes the frames one
after another, all on the event loop; from 0.5.21 a JSON noise list costs ~10 ms more on the scheduler hop.
How: `request.json()` parses with orjson, `_decode_b64_image` uses pybase64 (stdlib fallbacks for
what they refuse), `_normalize_observation` decodes two or more cameras on a small thread pool and
hands state and noise lists on as float64 arrays (equal after the preprocessor's float32 cast).
"""

from __future__ import annotations

import base64
import binascii
import inspect
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import orjson
import pybase64
from PIL import Image

ACTION_PATH = "/v1/actions/generations"
# JSON state and noise lists: 0.5.21+ walks a request's lists element by element on both sides of the
# scheduler hop (ipc_cuda._map_tree), and the request holds each list three times: ~10 ms for 50x32 noise.
_NUMBER_FIELDS = ("state", "noise", "observation.state", "observation.noise")
# Its threads start on the first submit.
_EXT_DECODE_POOL = ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="sglang-ext-image-decode")


def _ext_maybe_wide_int(parsed) -> bool:
    """True when the parse holds an integral float of magnitude >= 2**63 (orjson reads integers
    beyond 64 bits as floats; json.loads then decides)."""
    stack = [parsed]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif type(item) is float and abs(item) >= 2.0**63 and item == item and item.is_integer():
            return True
    return False


def _ext_json_body(body: bytes):
    """orjson's parse of a JSON body; json.loads for anything orjson refuses or may read differently."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return json.loads(body)
    return json.loads(body) if _ext_maybe_wide_int(parsed) else parsed


def _ext_b64decode(data):
    try:
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError):
        return base64.b64decode(data)


class _OrjsonBodyRequest:
    def __init__(self, request):
        self._request = request

    def __getattr__(self, name):
        return getattr(self._request, name)

    async def json(self):
        return _ext_json_body(await self._request.body())


def _orjson_endpoint(endpoint, request_cls):
    """The endpoint on `_OrjsonBodyRequest`, with its doc and the signature by which FastAPI injects the Request:
    the class itself, not a name FastAPI would resolve in our module."""
    async def create_action_generation(request):
        return await endpoint(_OrjsonBodyRequest(request))

    create_action_generation.__wrapped__ = endpoint
    create_action_generation.__doc__ = endpoint.__doc__
    create_action_generation.__signature__ = inspect.Signature(
        [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=request_cls)])
    return create_action_generation


def _decode_b64_image(payload):
    """0.5.17's image payload decoding, on the faster base64 decoder."""
    data = payload.get("b64_json") or payload.get("base64")
    if not data:
        raise ValueError("image payload requires b64_json")
    if isinstance(data, str) and data.startswith("data:") and "," in data:
        data = data.partition(",")[2]  # a data URL: the payload after the header
    return Image.open(io.BytesIO(_ext_b64decode(data))).convert("RGB")


def _ext_number_array(value):
    """A JSON list of numbers as one float64 array, else `value` unchanged (sglang then raises its own error).
    Exact: the preprocessor rounds the array's doubles to float32 as it rounded the list's Python floats."""
    if not isinstance(value, list):
        return value
    try:
        array = np.asarray(value)
    except (ValueError, TypeError):
        return value
    return array.astype(np.float64) if array.dtype.kind in "iuf" else value


def _wrap_normalize_observation(original, protocol):
    def _normalize_observation(observation):
        images = observation.get("images") if isinstance(observation, dict) else None
        encoded = [name for name, value in images.items() if isinstance(value, dict)
                   and ("b64_json" in value or "base64" in value)] if isinstance(images, dict) else []
        if len(encoded) > 1:  # decoded on the pool; all end before the first failure, in request order, is raised
            futures = {name: _EXT_DECODE_POOL.submit(protocol._decode_b64_image, images[name]) for name in encoded}
            wait(futures.values())
            decoded = {name: futures[name].result() if name in futures else value for name, value in images.items()}
            observation = {**observation, "images": decoded}
        normalized = original(observation)
        if isinstance(normalized, dict):
            for name in _NUMBER_FIELDS:
                if name in normalized:
                    normalized[name] = _ext_number_array(normalized[name])
        return normalized

    _normalize_observation.__wrapped__ = original
    return _normalize_observation


def patch_protocol(ctx, module) -> None:
    """Part for entrypoints.vla.protocol: pybase64 decoding, cameras decoded concurrently."""
    ctx.setattr(module, "_decode_b64_image", _decode_b64_image)
    ctx.setattr(module, "_normalize_observation", _wrap_normalize_observation(module._normalize_observation, module))


def patch_api(ctx, module) -> None:
    """Part for entrypoints.vla.api: the JSON endpoint parses with orjson."""
    route = next((r for r in module.router.routes
                  if getattr(r, "path", None) == ACTION_PATH and "POST" in getattr(r, "methods", ())), None)
    if route is None or route.endpoint is not module.create_action_generation:
        raise RuntimeError(f"entrypoints.vla.api.router: POST {ACTION_PATH} is not sglang's "
                           f"create_action_generation (found {getattr(route, 'endpoint', None)!r})")
    endpoint = _orjson_endpoint(module.create_action_generation, module.Request)
    ctx.setattr(module, "create_action_generation", endpoint)
    ctx.setattr(route, "endpoint", endpoint)
