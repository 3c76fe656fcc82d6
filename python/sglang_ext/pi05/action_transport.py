"""The Pi0.5 action endpoints parse and decode requests faster, with the same results.

Target symbols (sglang 0.5.17, fingerprint-gated):
    sglang.multimodal_gen.runtime.entrypoints.vla.api.create_action_generation
        (the endpoint of POST /v1/actions/generations; replaced in the module and as the
        `router` route's `endpoint`, which `FastAPI.include_router` copies into the app)
    sglang.multimodal_gen.runtime.entrypoints.vla.protocol._decode_b64_image (replaced)
    sglang.multimodal_gen.runtime.entrypoints.vla.protocol._normalize_observation (wrapped)
sglang versions: 0.5.17.
Upstream PR: none (0.5.23's entrypoints/action/ parses and decodes the same way).
Why: per request, the HTTP process parses the JSON body with the standard library's json
    (starlette's `Request.json()`), base64-decodes each camera frame with the standard
    library and decodes the frames one after another, all on the event loop: about 4 ms of
    the 0.5.17 JSON path for two 224x224 PNG cameras on a 2-core CPU (docs/pi05-server-path.md).
How: the endpoint is sglang's, except that the body is parsed with orjson; a body orjson
    refuses (invalid JSON, NaN, integers beyond 64 bits, non-UTF-8 encodings) is parsed by
    json.loads as before, so its result or its error (HTTP 400 with json's message) is
    unchanged; so is one holding an integral float beyond 2**63 (orjson reads integer literals
    beyond 64 bits as floats). Base64 goes through pybase64 (SIMD; strict alphabet) and falls back to the
    standard library for anything pybase64 refuses (whitespace, missing padding, junk), so
    the bytes and the errors are those of 0.5.17. When a request carries two or more encoded
    cameras, they are decoded on a small thread pool (Pillow releases the GIL while it
    decodes); the frames are the same PIL images, and the first failing camera in the
    request's order raises the error the sequential code would have raised.
Retire when: upstream parses action requests off the standard library json and decodes the
    cameras concurrently.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import orjson
import pybase64

if TYPE_CHECKING:  # module globals of entrypoints.vla.api / .protocol that the transplanted code uses
    from fastapi import HTTPException, Request, Response
    from PIL import Image

    from sglang.multimodal_gen.runtime.entrypoints.vla.api import (
        _prefer_numpy_output, _response_format, _wants_msgpack, action_generation_response, action_raw_response,
        infer_action, orjson_response, pack_msgpack, unpack_msgpack)
    from sglang.multimodal_gen.runtime.entrypoints.vla.protocol import io
    from sglang.multimodal_gen.runtime.server_args import ServerArgs

_ACTION_PATH = "/v1/actions/generations"
_EXT_DECODE_THREADS = max(2, min(8, os.cpu_count() or 2))
_EXT_INT64_LIMIT = float(2**63)
_ext_decode_pool = None
_ext_decode_pool_lock = threading.Lock()


def _ext_maybe_wide_int(parsed) -> bool:
    """True when the parse holds an integral float of magnitude >= 2**63: orjson reads integer
    literals beyond 64 bits as floats where json.loads keeps them ints (a float literal such as
    1e30 also lands here; json.loads then decides, as before)."""
    stack = [parsed]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif type(item) is float and abs(item) >= _EXT_INT64_LIMIT and item == item and item.is_integer():
            return True
    return False


def _ext_json_body(body: bytes):
    """orjson's parse of a JSON body; json.loads (starlette's parser) for anything orjson refuses
    or may read differently."""
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


async def create_action_generation(request: Request):
    server_args: ServerArgs = request.app.state.server_args
    try:
        if "msgpack" in request.headers.get("content-type", "").lower():
            payload = unpack_msgpack(await request.body())
        else:
            payload = _ext_json_body(await request.body())
        wants_msgpack = _wants_msgpack(request)
        if wants_msgpack:
            _prefer_numpy_output(payload)
        output = await infer_action(payload, server_args)
        if _response_format(payload) == "raw":
            response = action_raw_response(output, preserve_numpy=wants_msgpack)
        else:
            response = action_generation_response(
                output,
                server_args,
                preserve_numpy=wants_msgpack,
            )
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc
    if wants_msgpack:
        return Response(
            content=pack_msgpack(response), media_type="application/msgpack"
        )
    return orjson_response(response)


def _decode_b64_image(payload):
    data = payload.get("b64_json") or payload.get("base64")
    if not data:
        raise ValueError("image payload requires b64_json")
    if isinstance(data, str) and "," in data and data.startswith("data:"):
        data = data.split(",", 1)[1]
    return Image.open(io.BytesIO(_ext_b64decode(data))).convert("RGB")


def _ext_is_encoded_image(value) -> bool:
    return isinstance(value, dict) and ("b64_json" in value or "base64" in value)


def _ext_pool() -> ThreadPoolExecutor:
    global _ext_decode_pool
    with _ext_decode_pool_lock:
        if _ext_decode_pool is None:
            _ext_decode_pool = ThreadPoolExecutor(_EXT_DECODE_THREADS, thread_name_prefix="sglang-ext-image-decode")
        return _ext_decode_pool


def _ext_decode_concurrently(decode, images: dict) -> dict:
    """`images` with every encoded camera decoded by `decode` on the pool; the first failure in
    the dict's order is raised, as the one-by-one decoding would."""
    names = [name for name, value in images.items() if _ext_is_encoded_image(value)]
    if len(names) < 2:
        return images
    futures = [_ext_pool().submit(decode, images[name]) for name in names]
    decoded, first_error = {}, None
    for name, future in zip(names, futures):
        try:
            decoded[name] = future.result()
        except Exception as exc:  # noqa: BLE001 - re-raised below, the first in request order
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    return {name: decoded.get(name, value) for name, value in images.items()}


def _wrap_normalize_observation(original, protocol):
    def _normalize_observation(observation):
        images = observation.get("images") if isinstance(observation, dict) else None
        if isinstance(images, dict):
            decoded = _ext_decode_concurrently(protocol._decode_b64_image, images)
            if decoded is not images:
                observation = {**observation, "images": decoded}
        return original(observation)

    _normalize_observation.__wrapped__ = original
    return _normalize_observation


def patch_protocol(ctx, module) -> None:
    """Part for entrypoints.vla.protocol: pybase64 decoding, cameras decoded concurrently."""
    ctx.transplant_function(module, _decode_b64_image)
    ctx.setattr(module, "_normalize_observation",
                _wrap_normalize_observation(module._normalize_observation, module))


def patch_api(ctx, module) -> None:
    """Part for entrypoints.vla.api: the JSON endpoint parses with orjson."""
    route = next((r for r in module.router.routes
                  if getattr(r, "path", None) == _ACTION_PATH and "POST" in getattr(r, "methods", ())), None)
    if route is None or route.endpoint is not module.create_action_generation:
        raise RuntimeError(f"entrypoints.vla.api.router: POST {_ACTION_PATH} is not sglang's "
                           f"create_action_generation (found {getattr(route, 'endpoint', None)!r})")
    endpoint = ctx.transplant_function(module, create_action_generation)
    ctx.setattr(route, "endpoint", endpoint)
