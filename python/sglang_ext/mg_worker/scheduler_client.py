"""The HTTP process reuses its ZMQ REQ sockets to the multimodal_gen scheduler.

Target symbols: sglang.multimodal_gen.runtime.scheduler_client.AsyncSchedulerClient.forward
    (replaced) and .close (wrapped); the module singleton `async_scheduler_client` is an
    instance, so patching the class reaches it.
sglang versions: 0.5.17 (fingerprint-gated); 0.5.23 still opens a socket per request.
Upstream PR: none.
Why: every request (each /v1/actions/generations POST, each /openpi/policy message) creates a
    REQ socket, connects it over TCP to the scheduler's ROUTER, sends, receives and closes it:
    a TCP handshake, a ZMTP greeting and a new peer on the ROUTER per request, on the critical
    path of a robot's control loop.
How: sockets that completed a send/receive round trip go back to an idle list on the client
    and the next request takes one (a new one is created when none is idle, so concurrent
    requests still get a socket each, as before). A socket whose round trip did not complete
    (timeout, cancelled request, error) is closed, never reused: a REQ socket must alternate
    send and receive, and a late reply must not reach the next request. The request bytes,
    the reply handling, the logging and the timeout are sglang's. `close()` closes the idle
    sockets before terminating the context (zmq's term waits for open sockets).
Retire when: upstream keeps its scheduler sockets across requests.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:  # module globals of scheduler_client that the transplanted forward resolves there
    from sglang.multimodal_gen.runtime.scheduler_client import _materialize_output_batch_file_refs, logger

# Idle sockets kept per client; more concurrent requests than this still work (extra sockets
# are closed after their round trip instead of being kept).
_EXT_MAX_IDLE_SOCKETS = 64


def _ext_take_socket(self):
    idle = self.__dict__.setdefault("_ext_idle_sockets", [])
    while idle:
        socket = idle.pop()
        if not socket.closed:
            return socket
    socket = self.context.socket(zmq.REQ)
    socket.setsockopt(zmq.LINGER, 0)
    # 100 minute timeout, as sglang's per-request sockets
    socket.setsockopt(zmq.RCVTIMEO, 6000000)
    socket.connect(self.server_args.scheduler_endpoint)
    return socket


def _ext_give_back_socket(self, socket, context) -> None:
    idle = self.__dict__.setdefault("_ext_idle_sockets", [])
    if self.context is context and context is not None and len(idle) < _EXT_MAX_IDLE_SOCKETS:
        idle.append(socket)
    else:
        socket.close()


async def forward(self, batch):
    """Sends a batch or request to the scheduler and waits for the response."""
    self.request_logger.log_received_request(batch)
    if self.context is None:
        raise RuntimeError(
            "AsyncSchedulerClient is not initialized. Call initialize() first."
        )
    context = self.context
    socket = _ext_take_socket(self)
    completed = False
    try:
        await socket.send(pickle.dumps(batch))
        payload = await socket.recv()
        completed = True
        output_batch = pickle.loads(payload)
        _materialize_output_batch_file_refs(output_batch)
        self.request_logger.log_finished_request(batch, output_batch)
        return output_batch
    except zmq.error.Again:
        logger.error("Timeout waiting for response from scheduler.")
        raise TimeoutError("Scheduler did not respond in time.")
    finally:
        if completed:
            _ext_give_back_socket(self, socket, context)
        else:
            socket.close()


def _wrap_close(original):
    def close(self):
        """Closes the idle scheduler sockets, then sglang's close (terminates the context)."""
        for socket in self.__dict__.pop("_ext_idle_sockets", []):
            socket.close()
        return original(self)

    close.__wrapped__ = original
    close.__doc__ = original.__doc__
    return close


def patch_scheduler_client(ctx, module) -> None:
    cls = module.AsyncSchedulerClient
    ctx.transplant_method(cls, forward)
    ctx.setattr(cls, "close", _wrap_close(cls.__dict__["close"]))
