"""grpc.aio server bootstrap shared by gateway, verifier and drafter.

Every service gets: deliberate message-size limits, keepalive that the peers' pings respect,
gRPC health (SERVING once ready) and reflection (unless switched off), TLS and a bearer-token
check when configured (services/common/security.py), a graceful stop that drains in-flight RPCs
for `grace_s` before cancelling them, and `MalformedRequests`: a request that does not parse as
its message ends its RPC with INVALID_ARGUMENT. A port in use is an error (OSError), never
shared: gRPC's SO_REUSEPORT is off; `check_bindable` tells before a service is started.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import socket
from collections.abc import Callable, Sequence

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.security import NONE, Security

MiB = 1 << 20
# Tensors cross the drafter stream (context features); 64 MiB bounds one step's message.
MAX_MESSAGE_BYTES = 64 * MiB
# The verifier ↔ drafter stream carries context rows inline when the two are not on one host (a
# prefill chunk's fc-projected rows, or a resend of a request's kept rows: hidden × 2 B per
# token, 1 GiB at 128k tokens of a 4096-wide drafter), so that internal link gets a larger bound.
INTERNAL_MESSAGE_BYTES = 1024 * MiB

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),  # on by default: a second server would silently share the port
]
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Requests that do not parse as their message (a corrupt wire format, invalid UTF-8 in a
    string field) end the RPC with INVALID_ARGUMENT "malformed request: not a valid
    specserve.v1.X"; grpc alone answers UNKNOWN, naming the parser's exception.

    The method's deserializer returns MALFORMED instead of raising, and its behavior aborts on
    it: before the call for a unary request, at that message for a request stream. Unknown
    methods and handlers that are not async (none here) are left as they are.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        kind = (f"{'stream' if handler.request_streaming else 'unary'}_"
                f"{'stream' if handler.response_streaming else 'unary'}")
        behavior = getattr(handler, kind)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler
        deserialize = handler.request_deserializer
        name = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
        message = f"malformed request: not a valid {name.full_name}" if name else \
            "malformed request"
        return handler._replace(request_deserializer=_lenient(deserialize),
                                **{kind: _aborting(behavior, handler, message)})


MALFORMED = object()  # what a request that did not parse becomes


def _lenient(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError:
            return MALFORMED

    return parse


def _aborting(behavior, handler: grpc.RpcMethodHandler, message: str):
    """`behavior` as a coroutine that aborts with INVALID_ARGUMENT `message` on MALFORMED."""

    async def call(request, context):
        if handler.request_streaming:
            request = _checked(request, context, message)
        elif request is MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        if not handler.response_streaming or inspect.iscoroutinefunction(behavior):
            return await behavior(request, context)
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:  # as grpc writes an async generator's responses
                await context.write(response)

    return call


async def _checked(requests, context, message: str):
    async for request in requests:
        if request is MALFORMED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        yield request


def with_message_limit(options: list[tuple], limit: int) -> list[tuple]:
    """`options` with both message-size limits set to `limit` bytes."""
    return [(k, limit if "message_length" in k else v) for k, v in options]


def channel(address: str, security: Security = NONE,
            options: list[tuple] | None = None) -> grpc.aio.Channel:
    """An aio channel to a peer with the shared limits and keepalive (`options` instead); TLS
    when `security` names the peer's CA."""
    return _dial(address, security.channel_credentials(),
                 CHANNEL_OPTIONS if options is None else options)


def _dial(address: str, creds: grpc.ChannelCredentials | None, options) -> grpc.aio.Channel:
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


async def start_server(
    adders: Sequence[tuple[Callable, object]],
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    security: Security = NONE,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a server with the given `(add_XServicer_to_server, servicer)` pairs (TLS, a
    bearer-token check and reflection as `security` says).

    Returns the server, the bound port (useful with port 0) and its health servicer (NOT_SERVING
    until the caller says the service is ready with `mark_serving`). Raises OSError when the
    port cannot be bound.
    """
    options = [(k, max_message_bytes if "message_length" in k else v) for k, v in SERVER_OPTIONS]
    server = grpc.aio.server(options=options,
                             interceptors=[*security.interceptors(), MalformedRequests()])
    for add, servicer in adders:
        add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if security.reflection:
        names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)
    creds = security.server_credentials()
    check_bindable(host, port)  # the reason in our words, before gRPC logs its own
    try:
        bound = server.add_secure_port(f"{host}:{port}", creds) if creds else \
            server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # "Failed to bind to address ..." (older grpc returned 0)
        bound = 0
    if bound == 0:
        raise OSError(f"could not bind {host}:{port} (in use?)")
    await server.start()
    for name in service_names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, bound, health_servicer


def bind_problem(host: str, port: int) -> str | None:
    """Why HOST:PORT cannot be bound here — held by another socket, no address of this machine,
    not an address at all — or None."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        return f"the host is not an address: {e}"
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else \
                "not an address of this machine" if e.errno == errno.EADDRNOTAVAIL else \
                e.strerror or str(e)
    return None


def check_bindable(host: str, port: int) -> None:
    """Raise OSError "could not bind HOST:PORT (why)" when `bind_problem` finds one."""
    if (why := bind_problem(host, port)) is not None:
        raise OSError(f"could not bind {host}:{port} ({why})")


async def mark_serving(health_servicer: health.aio.HealthServicer, names: Sequence[str]) -> None:
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def wait_serving(address: str, service: str = "", timeout_s: float = 60.0,
                       own: Security = NONE) -> None:
    """Block until `address` reports SERVING for `service` (raises TimeoutError). `own`: the
    security the server there was started with (under TLS it is dialed as it would dial itself:
    `Security.own_credentials`)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    async with _dial(address, own.own_credentials(), CHANNEL_OPTIONS) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                         timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s} s")
            await asyncio.sleep(0.1)
