"""The multimodal_gen HTTP process reuses its ZMQ REQ sockets to the scheduler.

Patch: mg_scheduler_client_reuse
Targets: sglang.multimodal_gen.runtime.scheduler_client:AsyncSchedulerClient.forward,
sglang.multimodal_gen.runtime.scheduler_client:AsyncSchedulerClient.close,
sglang.multimodal_gen.runtime.scheduler_client:AsyncSchedulerClient.initialize
Upstream PR: none (0.5.23 still opens a socket per request)
Retire when: upstream keeps its scheduler sockets across requests

Releases: 0.5.17, 0.5.23 (its `_forward_one`, per replica endpoint, and per-request array folders).

Why: each request connects a new REQ socket (TCP handshake, ZMTP greeting) on a robot control loop's critical path.
How: sglang's request code runs unchanged on a context whose REQ sockets are kept ones: one that completed
its round trip goes back to an idle list per endpoint, others are closed (REQ must alternate send and
receive). On 0.5.23 a kept socket's identity names its own `ipc_array` scratch folder, alive with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import zmq

# Idle sockets kept per client (more concurrent requests still work: extras are closed).
_EXT_MAX_IDLE_SOCKETS = 64
# The kept sockets handed out inside this task's request (None: outside one).
_LEASES: contextvars.ContextVar = contextvars.ContextVar("sglang_ext_scheduler_sockets", default=None)


class _Kept:
    """A connected REQ socket with the scratch folder its identity names (0.5.23; else none)."""

    def __init__(self, context, endpoint: str):
        self.endpoint, self.scratch = endpoint, contextlib.ExitStack()
        self.socket = context.socket(zmq.REQ)
        try:
            from sglang.multimodal_gen.runtime.ipc_array import array_ipc_request  # 0.5.23
        except ImportError:
            identity = None
        else:
            identity = self.scratch.enter_context(array_ipc_request(endpoint))  # None: not a local endpoint
        if identity is not None:
            self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.connect(endpoint)

    def close(self) -> None:
        self.socket.close(linger=0)
        self.scratch.close()  # the folder goes with its socket


class _Lease:
    """What sglang's request code holds as its new REQ socket: a kept socket, taken when it connects."""

    def __init__(self, client):
        self._client, self._options, self.kept, self.completed = client, [], None, False

    def setsockopt(self, option, value) -> None:
        if option == zmq.IDENTITY:
            return  # a kept socket has its own identity (and scratch folder)
        if self.kept is None:
            self._options.append((option, value))
        else:
            self.kept.socket.setsockopt(option, value)

    def connect(self, endpoint: str) -> None:
        self.kept = _take(self._client, endpoint)
        for option, value in self._options:
            self.kept.socket.setsockopt(option, value)

    async def send(self, *args, **kwargs):
        self.completed = False
        return await self.kept.socket.send(*args, **kwargs)

    async def recv(self, *args, **kwargs):
        out = await self.kept.socket.recv(*args, **kwargs)
        self.completed = True
        return out

    def close(self, linger=None) -> None:
        pass  # settled when the request returns (kept) or raises (closed)

    def __getattr__(self, name):
        return getattr(self.kept.socket, name)


class _KeepingContext:
    """The client's context: inside a request its REQ sockets are leases of kept ones."""

    def __init__(self, client, context):
        self._client, self._context = client, context

    def socket(self, kind, *args, **kwargs):
        leases = _LEASES.get()
        if kind != zmq.REQ or leases is None:
            return self._context.socket(kind, *args, **kwargs)
        lease = _Lease(self._client)
        leases.append(lease)
        return lease

    def __getattr__(self, name):  # closed, term, ...
        return getattr(self._context, name)


def _take(client, endpoint: str) -> _Kept:
    idle = client.__dict__.setdefault("_ext_idle_sockets", [])
    for i in range(len(idle) - 1, -1, -1):
        if idle[i].endpoint == endpoint:
            kept = idle.pop(i)
            if not kept.socket.closed:
                return kept
            kept.close()
    return _Kept(client.context._context, endpoint)


def _settle(client, lease: _Lease, keep: bool) -> None:
    if lease.kept is None:
        return
    idle = client.__dict__.setdefault("_ext_idle_sockets", [])
    context = client.context
    if keep and lease.completed and context is not None and not context.closed and len(idle) < _EXT_MAX_IDLE_SOCKETS:
        idle.append(lease.kept)
    else:
        lease.kept.close()


def patch_scheduler_client(ctx, module) -> None:
    cls = module.AsyncSchedulerClient
    # sglang's request method (0.5.23: `_forward_one`, 0.5.17: `forward`), its sockets kept
    name = "_forward_one" if "_forward_one" in cls.__dict__ else "forward"
    request, initialize, close = cls.__dict__[name], cls.__dict__["initialize"], cls.__dict__["close"]

    @functools.wraps(request)
    async def keeping(self, *args, **kwargs):
        leases = []
        token = _LEASES.set(leases)
        ok = False
        try:
            out = await request(self, *args, **kwargs)
            ok = True
            return out
        finally:
            _LEASES.reset(token)
            for lease in leases:
                _settle(self, lease, ok)

    @functools.wraps(initialize)
    def keeping_initialize(self, *args, **kwargs):
        initialize(self, *args, **kwargs)
        self.context = _KeepingContext(self, self.context)

    @functools.wraps(close)
    def closing(self):
        """Closes the idle scheduler sockets, then sglang's close (terminates the context)."""
        for kept in self.__dict__.pop("_ext_idle_sockets", []):
            kept.close()
        return close(self)

    ctx.setattr(cls, name, keeping)
    ctx.setattr(cls, "initialize", keeping_initialize)
    ctx.setattr(cls, "close", closing)
