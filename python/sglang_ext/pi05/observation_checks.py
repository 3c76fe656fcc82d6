"""Pi0.5 observations checked before they reach the model: one line naming the field, the server serving on.

Patch: pi05_observation_checks
Targets: sglang.multimodal_gen.runtime.entrypoints.action.protocol:build_action_sampling_params,
sglang.multimodal_gen.runtime.entrypoints.action.protocol:images_from_observation,
sglang.multimodal_gen.runtime.entrypoints.action.ws_utils:run_action_msgpack_ws,
sglang.multimodal_gen.runtime.pipelines_core.stages.vla:VLAObservationPreprocessStage.forward
Upstream PR: none (0.5.23 checks neither values nor camera names)
Retire when: upstream refuses non-finite states and noise, badly shaped and unknown cameras and observations
without a camera, per request, and its websockets answer a refused request without closing

Why: a NaN state or noise came back as NaN actions; the HTTP process knows only the default cameras, so a
camera the checkpoint names otherwise (sglang's own LIBERO benchmark: `image`, `image2`) was dropped
silently, and an observation whose first camera is missing ended the server in a device-side assert; the
OpenPI websocket answered any failed request with a traceback and closed the robot's connection.
How: the HTTP process checks values, shapes and camera names (against the checkpoint's, read with sglang's
own config reader) and refuses with one line (JSON: 400); the websocket answers `{"error": line}` and
goes on; the worker checks again for requests that reach it another way.
"""

from __future__ import annotations

import functools
import importlib
import sys

import numpy as np

from sglang_ext.pi05.checkpoint_cameras import checkpoint_cameras

# Marks a worker's refusal in the error text sglang carries back to the HTTP process.
REFUSED = "invalid observation: "
CHANNELS = (1, 3, 4)
def _finite(field: str, value) -> None:
    if value is None or isinstance(value, (str, bytes, dict)):
        return  # absent, or a form sglang's own parser answers for
    if hasattr(value, "isfinite"):  # a torch tensor (any dtype, bf16 included)
        finite = bool(value.isfinite().all())
    else:
        try:
            finite = bool(np.isfinite(np.asarray(value, dtype=np.float64)).all())
        except (TypeError, ValueError):
            return  # not numbers: sglang's own parsing answers
    if not finite:
        raise ValueError(f"{field}: NaN or infinite values are not allowed; allowed: finite numbers")


def _image(name: str, value) -> None:
    shape = getattr(value, "shape", None)
    if shape is None and not isinstance(value, (list, tuple)):
        return  # a PIL image (decoded, always usable) or a payload sglang decodes later
    shape = tuple(int(d) for d in (np.asarray(value).shape if shape is None else shape))
    if len(shape) == 4 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 3 or (shape[0] not in CHANNELS and shape[-1] not in CHANNELS) or min(shape) < 1:
        raise ValueError(f"images.{name}: shape {shape} is not allowed; allowed: HWC or CHW with 1, 3 or 4 "
                         "channels, at least 1x1")
    floating = value.is_floating_point() if hasattr(value, "is_floating_point") else np.asarray(value).dtype.kind == "f"
    if floating:
        _finite(f"images.{name}", value)


def check_values(observation: dict, images: dict) -> None:
    """State, noise and camera frames: finite values, images of a usable shape (raises ValueError)."""
    for field in ("state", "noise"):
        value = observation.get(field)
        _finite(field, observation.get(f"observation.{field}") if value is None else value)
    for name, value in (images.items() if isinstance(images, dict) else ()):
        _image(name, value)


def check_cameras(images: dict, image_masks, camera_order, image_keys) -> None:
    """Without a camera_order every camera is one the checkpoint names; one camera of the order is usable.
    (A camera_order the request gives places its cameras itself: others it sends are left out, as sglang does.)"""
    if not isinstance(images, dict):
        return  # sglang's own parsing answers for other forms
    image_masks = image_masks if isinstance(image_masks, dict) else {}
    order = tuple(camera_order) if camera_order else tuple(image_keys)
    unknown = [] if camera_order else [name for name in images if name not in order]
    if unknown:
        raise ValueError(f"images: unknown camera(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(order)} "
                         "(the checkpoint's cameras), or name the order in camera_order")
    if not any(images.get(name) is not None and bool(np.asarray(image_masks.get(name, True)).all()) for name in order):
        raise ValueError(f"images: no usable camera (none present and unmasked); allowed: at least one of "
                         f"{', '.join(order)}")


def _checked_stage_forward(forward):
    @functools.wraps(forward)
    def checked(self, batch, server_args):
        from sglang.multimodal_gen.runtime.pipelines_core.stages.vla import vla_state

        config = getattr(self.preprocessor, "config", None)
        raw = vla_state(batch).get("observation") or {}
        if config is not None and isinstance(raw, dict):
            try:
                check_values(raw, raw.get("images"))
                check_cameras(raw.get("images"), raw.get("image_masks"), raw.get("camera_order"), config.image_keys)
            except ValueError as exc:
                raise ValueError(REFUSED + str(exc)) from None
        return forward(self, batch, server_args)

    return checked


class ObservationRefused(ValueError):
    """A request's observation, refused in the HTTP process (a ValueError: sglang's JSON endpoint answers 400)."""


def _checked_build(build):
    @functools.wraps(build)
    def build_action_sampling_params(payload, server_args):
        sampling_params = build(payload, server_args)
        images = getattr(sampling_params, "images", None)
        try:
            check_values({"state": getattr(sampling_params, "state", None),
                          "noise": getattr(sampling_params, "noise", None)}, images)
            check_cameras(images, getattr(sampling_params, "image_masks", None),
                          getattr(sampling_params, "camera_order", None), checkpoint_cameras(server_args))
        except ValueError as exc:
            raise ObservationRefused(str(exc)) from None
        return sampling_params

    return build_action_sampling_params


def _every_camera(images_from_observation, protocol):
    """Cameras sent as `observation.images.<name>` that the HTTP process's default keys do not name are kept
    (the checkpoint may name them; an unknown one is refused by name)."""
    @functools.wraps(images_from_observation)
    def every_camera(observation, pipeline_config):
        images = images_from_observation(observation, pipeline_config)
        prefix = "observation.images."
        images.update({key[len(prefix):]: protocol._normalize_image_value(value) for key, value in observation.items()
                       if isinstance(key, str) and key.startswith(prefix) and key[len(prefix):] not in images})
        return images

    return every_camera


class _RefusalAnswering:
    """The websocket as sglang's message loop sees it. That loop answers any failed request with a traceback
    and closes the connection; a refused observation is answered `{"error": line}` instead, the close is
    skipped, and the loop is entered again on this connection (accepted, its metadata sent already)."""

    def __init__(self, websocket, pack):
        self._websocket, self._pack = websocket, pack
        self.resumed = self.refused = self._metadata_pending = False

    def __getattr__(self, name):
        return getattr(self._websocket, name)

    async def accept(self, *args, **kwargs):
        if not self.resumed:
            await self._websocket.accept(*args, **kwargs)

    async def send_bytes(self, data):
        if self.resumed and not self.refused and self._metadata_pending:
            self._metadata_pending = False  # the loop's greeting: the client has it
            return
        exc = sys.exc_info()[1]
        if isinstance(exc, ObservationRefused):
            self.refused = True
            data = self._pack({"error": str(exc)})
        await self._websocket.send_bytes(data)

    async def close(self, *args, **kwargs):
        if not self.refused:
            await self._websocket.close(*args, **kwargs)

    def resume(self):
        self.resumed, self.refused, self._metadata_pending = True, False, True


def _answering_refusals(run_action_msgpack_ws, protocol):
    @functools.wraps(run_action_msgpack_ws)
    async def run(websocket, server_args, **kwargs):
        connection = _RefusalAnswering(websocket, protocol.pack_msgpack)
        while True:
            try:
                return await run_action_msgpack_ws(connection, server_args, **kwargs)
            except ObservationRefused:
                connection.resume()

    return run


def patch_protocol(ctx, module) -> None:
    ctx.setattr(module, "build_action_sampling_params", _checked_build(module.build_action_sampling_params))
    ctx.setattr(module, "images_from_observation", _every_camera(module.images_from_observation, module))


def patch_ws_utils(ctx, module) -> None:
    protocol = importlib.import_module(".protocol", module.__package__)
    ctx.setattr(module, "run_action_msgpack_ws", _answering_refusals(module.run_action_msgpack_ws, protocol))


def rebind_ws_loop(ctx, module) -> None:
    """Parts for the OpenPI and realtime routes' modules: their bound name of the message loop."""
    ctx.setattr(module, "run_action_msgpack_ws",
                importlib.import_module(".ws_utils", module.__package__).run_action_msgpack_ws)


def patch_stages(ctx, module) -> None:
    cls = module.VLAObservationPreprocessStage
    ctx.setattr(cls, "forward", _checked_stage_forward(cls.__dict__["forward"]))
