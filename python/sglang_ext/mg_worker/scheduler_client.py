"""The multimodal_gen HTTP process reuses its ZMQ REQ sockets to the scheduler.

Patch: mg_scheduler_client_reuse
Targets: sglang.multimodal_gen.runtime.scheduler_client:AsyncSchedulerClient.forward,
sglang.multimodal_gen.runtime.scheduler_client:AsyncSchedulerClient.close
Upstream PR: none (0.5.23 still opens a socket per request)
Retire when: upstream keeps its scheduler sockets across requests

Why: every request connects a new REQ socket to the scheduler: a TCP handshake and a ZMTP greeting
on the critical path of a robot's control loop.
How: sockets that completed a round trip go back to an idle list for the next request; one that
did not is closed (a REQ socket must alternate send and receive).
"""

from __future__ import annotations

import pickle

import zmq

from sglang.multimodal_gen.runtime import scheduler_client as sglang_client

# Idle sockets kept per client (more concurrent requests still work: extras are closed).
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
        raise RuntimeError("AsyncSchedulerClient is not initialized. Call initialize() first.")
    context = self.context
    socket = _ext_take_socket(self)
    completed = False
    try:
        await socket.send(pickle.dumps(batch))
        payload = await socket.recv()
        completed = True
        output_batch = pickle.loads(payload)
        sglang_client._materialize_output_batch_file_refs(output_batch)
        self.request_logger.log_finished_request(batch, output_batch)
        return output_batch
    except zmq.error.Again:
        sglang_client.logger.error("Timeout waiting for response from scheduler.")
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
    ctx.setattr(cls, "forward", forward)
    ctx.setattr(cls, "close", _wrap_close(cls.__dict__["close"]))
