"""Per-request hop times of the Pi0.5 action server in every answer's timings (knob pi05_server_timing).

Patch: pi05_server_timing
Targets: sglang.multimodal_gen.runtime.entrypoints.action.protocol:infer_action,
sglang.multimodal_gen.runtime.entrypoints.utils:prepare_request,
sglang.multimodal_gen.runtime.entrypoints.action.api:create_action_generation,
sglang.multimodal_gen.runtime.managers.scheduler:Scheduler.recv_reqs,
sglang.multimodal_gen.runtime.managers.gpu_worker:GPUWorker.execute_forward
Upstream PR: none (sglang-ext only)
Retire when: upstream reports per-request hop times itself (not in 0.5.23)

Why: an answer's timings hold the stage times only, not where the rest of the latency goes.
How: wrappers stamp CLOCK_MONOTONIC times (one clock for all processes of the host) that travel
with the request (`Req.extra["ext_trace"]`); the HTTP process adds the hop times. Knob off:
sglang's own functions stay installed.
"""

from __future__ import annotations

import contextvars
import functools
import time

from sglang_ext.pi05.endpoint import ACTION_PATH, like_endpoint, post_route, sibling

TRACE_KEY = "ext_trace"  # Req.extra key: {"sent": t, "worker_in": t}
_REPLY_AT = "_ext_reply_at"  # timings key the worker adds and the HTTP process removes
# When the endpoint got the request now being served (per asyncio task).
_ARRIVED_AT = contextvars.ContextVar("sglang_ext_pi05_arrived_at", default=None)
# Set by the traced infer_action while it runs: prepare_request records the send time in it.
_SENT = contextvars.ContextVar("sglang_ext_pi05_sent", default=None)


def _traced(ctx, original, trace):
    """`trace(original)` when the knob is on, else sglang's own function (installed as it is)."""
    return trace(original) if ctx.settings.pi05_server_timing else original


def _ms(later: float, earlier: float) -> float:
    return (later - earlier) * 1000.0


def _traced_infer_action(original):
    @functools.wraps(original)
    async def infer_action(payload, server_args):
        arrived = _ARRIVED_AT.get()
        parsed = time.monotonic()
        sent = {}
        token = _SENT.set(sent)
        try:
            output = await original(payload, server_args)
        finally:
            _SENT.reset(token)
        back = time.monotonic()
        timings = output.get("timings") if isinstance(output, dict) else None
        if isinstance(timings, dict):
            reply_at = timings.pop(_REPLY_AT, None)
            if arrived is not None:
                timings["http_parse_ms"] = _ms(parsed, arrived)
                timings["server_total_ms"] = _ms(back, arrived)
            if "at" in sent:
                timings["http_decode_ms"] = _ms(sent["at"], parsed)
            if reply_at is not None:
                timings["from_worker_ms"] = _ms(back, reply_at)
        return output

    return infer_action


def _stamping_prepare_request(original):
    @functools.wraps(original)
    def prepare_request(server_args, sampling_params, *args, **kwargs):
        req = original(server_args, sampling_params, *args, **kwargs)
        sent = _SENT.get()
        if sent is not None:  # called by the traced infer_action: the request goes to the worker next
            sent["at"] = time.monotonic()
            req.extra[TRACE_KEY] = {"sent": sent["at"]}
        return req

    return prepare_request


def patch_protocol(ctx, module) -> None:
    """Part for entrypoints.vla.protocol: wrap infer_action and the prepare_request it calls."""
    for name, trace in (("infer_action", _traced_infer_action), ("prepare_request", _stamping_prepare_request)):
        ctx.setattr(module, name, _traced(ctx, getattr(module, name), trace))


def _stamp_arrival(endpoint, enabled: bool, request_cls):
    async def create_action_generation(request):
        if not enabled:
            return await endpoint(request)
        token = _ARRIVED_AT.set(time.monotonic())
        try:
            return await endpoint(request)
        finally:
            _ARRIVED_AT.reset(token)

    create_action_generation.__sglang_ext_wraps__ = endpoint
    return like_endpoint(create_action_generation, endpoint, request_cls)


def _stamping_unpack(original):
    @functools.wraps(original)
    def unpack_msgpack(payload):
        _ARRIVED_AT.set(time.monotonic())  # the websocket loop: one message, then infer_action
        return original(payload)

    return unpack_msgpack


def patch_api(ctx, module) -> None:
    """Part for entrypoints.vla.api: rebind infer_action, stamp the JSON endpoint's arrival."""
    ctx.setattr(module, "infer_action", sibling(module, "protocol").infer_action)
    route = post_route(module.router)
    if route is None:
        raise RuntimeError(f"entrypoints.vla.api.router has no POST {ACTION_PATH} route")
    on = bool(ctx.settings.pi05_server_timing)
    ctx.setattr(route, "endpoint", _stamp_arrival(route.endpoint, on, module.Request))


def patch_ws_utils(ctx, module) -> None:
    """Part for entrypoints.vla.ws_utils: rebind infer_action, stamp each message's arrival."""
    ctx.setattr(module, "infer_action", sibling(module, "protocol").infer_action)
    ctx.setattr(module, "unpack_msgpack", _traced(ctx, module.unpack_msgpack, _stamping_unpack))


def _stamping_recv_reqs(original):
    @functools.wraps(original)
    def recv_reqs(self):
        received = original(self)
        now = time.monotonic()
        for _identity, req in received:
            extra = getattr(req, "extra", None)
            if isinstance(extra, dict) and TRACE_KEY in extra:
                extra[TRACE_KEY]["worker_in"] = now
        return received

    return recv_reqs


def patch_scheduler(ctx, module) -> None:
    """Part for managers.scheduler: stamp each request when the scheduler has unpickled it."""
    scheduler = module.Scheduler
    ctx.setattr(scheduler, "recv_reqs", _traced(ctx, scheduler.__dict__["recv_reqs"], _stamping_recv_reqs))


def _timed_execute_forward(original):
    @functools.wraps(original)
    def execute_forward(self, batch, return_req=False):
        start = time.monotonic()
        result = original(self, batch, return_req)
        end = time.monotonic()
        trace = getattr(batch[0], "extra", {}).get(TRACE_KEY) if len(batch) == 1 else None
        output = getattr(result, "output", None)
        if trace is None or not isinstance(output, list) or not output or not isinstance(output[0], dict):
            return result
        timings = output[0].get("timings")
        if isinstance(timings, dict):
            worker_in = trace.get("worker_in", start)
            timings["to_worker_ms"] = _ms(worker_in, trace["sent"])
            timings["worker_queue_ms"] = _ms(start, worker_in)
            timings["worker_forward_ms"] = _ms(end, start)
            timings[_REPLY_AT] = end
        return result

    return execute_forward


def patch_gpu_worker(ctx, module) -> None:
    """Part for managers.gpu_worker: time execute_forward, put the worker's stamps in the answer."""
    worker = module.GPUWorker
    ctx.setattr(worker, "execute_forward", _traced(ctx, worker.__dict__["execute_forward"], _timed_execute_forward))
