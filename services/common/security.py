"""Transport security and caller authentication shared by the three services; off by default.

Owns `Security` (what one process is configured with, from the `SECURITY_FLAGS` every service
takes): TLS on its own port (`tls_cert` / `tls_key`; with `tls_client_ca`, callers must present
a certificate that CA signed: mutual TLS), TLS to the peer it dials (`peer_tls_ca`, presenting
its own certificate as the client's when it has one), a bearer token its callers must send
(`token`: the gateway's clients; between services, the shared secret) and the one it sends to
its peer (`peer_token`), and whether gRPC reflection is served. `TokenAuth` is the server
interceptor (gRPC health stays open: orchestrators probe it); `peer_metadata` is what a client
adds to each call; `bearer_ok` checks an Authorization value (the gRPC interceptor's and the HTTP
API's check). PEM files are read once, at start.
"""

from __future__ import annotations

import argparse
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.settings import Flag, flags_field

HEALTH_PREFIX = "/grpc.health.v1.Health/"
SECURITY_FLAGS = [
    Flag("--tls-cert", "SPECSERVE_TLS_CERT", "", str, "PEM certificate chain of this server"),
    Flag("--tls-key", "SPECSERVE_TLS_KEY", "", str, "PEM private key of this server"),
    Flag("--tls-client-ca", "SPECSERVE_TLS_CLIENT_CA", "", str,
         "PEM CA: callers must present a certificate it signed (mutual TLS)"),
    Flag("--peer-tls-ca", "SPECSERVE_PEER_TLS_CA", "", str,
         "PEM CA of the peer this service dials: TLS to it (our own cert as the client's)"),
    Flag("--auth-token", "SPECSERVE_AUTH_TOKEN", "", str,
         "callers must send 'authorization: Bearer TOKEN' ('' = no check)"),
    Flag("--peer-token", "SPECSERVE_PEER_TOKEN", "", str,
         "the bearer token this service sends to the peer it dials"),
    Flag("--reflection", "SPECSERVE_REFLECTION", "on", str, "gRPC reflection: on | off"),
]


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class Security:
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    peer_tls_ca: str | None = None
    token: str | None = None
    peer_token: str | None = None
    reflection: bool = True

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs the server's --tls-cert/--tls-key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "peer_tls_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no such file {path}")

    @classmethod
    def from_args(cls, args) -> Security:
        """From the parsed SECURITY_FLAGS ('' = unset). Raises ValueError."""
        if args.reflection not in ("on", "off"):
            raise ValueError(f"--reflection must be on or off, got {args.reflection!r}")
        return cls(args.tls_cert or None, args.tls_key or None, args.tls_client_ca or None,
                   getattr(args, "peer_tls_ca", "") or None, args.auth_token or None,
                   getattr(args, "peer_token", "") or None, args.reflection == "on")

    @classmethod
    def from_env(cls, environ=None) -> Security:
        """From the SECURITY_FLAGS' variables alone (os.environ by default). Raises ValueError."""
        env = os.environ if environ is None else environ
        return cls.from_args(argparse.Namespace(
            **{f.dest: env.get(f.env, f.default) for f in SECURITY_FLAGS}))

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS for this server's port (None: plaintext)."""
        if not self.tls_cert:
            return None
        return grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))], root_certificates=_read(
                self.tls_client_ca), require_client_auth=bool(self.tls_client_ca))

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS to the peer (None: plaintext)."""
        if not self.peer_tls_ca:
            return None
        return grpc.ssl_channel_credentials(_read(self.peer_tls_ca), _read(self.tls_key),
                                            _read(self.tls_cert))

    def own_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS to this process's own port (its health check; None: plaintext): trusting its
        client CA, else its peer's CA, else the system's roots; presenting its own certificate,
        which its mutual TLS admits when that CA signed it."""
        if not self.tls_cert:
            return None
        return grpc.ssl_channel_credentials(_read(self.tls_client_ca or self.peer_tls_ca),
                                            _read(self.tls_key), _read(self.tls_cert))

    def peer_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.peer_token}"),) if self.peer_token else ()

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenAuth(self.token)] if self.token else []


NONE = Security()


def bearer_ok(authorization: str | bytes, want: bytes) -> bool:
    """Whether an Authorization value carries the bearer token `want`: the scheme "Bearer" in any
    case (RFC 7235: auth schemes are case-insensitive), one or more spaces, then the token, which
    is compared exactly and in constant time (hmac.compare_digest); an empty `want` matches
    nothing."""
    if isinstance(authorization, str):
        authorization = authorization.encode()
    scheme, _, token = authorization.partition(b" ")
    same = hmac.compare_digest(token.lstrip(b" "), want)
    return same and bool(want) and scheme.lower() == b"bearer"


class TokenAuth(grpc.aio.ServerInterceptor):
    """Every RPC but gRPC health needs 'authorization: Bearer <token>' (UNAUTHENTICATED); the
    scheme in any case (`bearer_ok`)."""

    def __init__(self, token: str) -> None:
        self._want = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if bearer_ok(sent, self._want):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _denied(handler) if handler is not None else None


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with its behavior replaced by an UNAUTHENTICATED abort."""
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def deny_stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        yield  # an async generator, as a streaming handler's behavior is

    kind = (f"{'stream' if handler.request_streaming else 'unary'}_"
            f"{'stream' if handler.response_streaming else 'unary'}")
    return handler._replace(**{kind: deny_stream if handler.response_streaming else deny})


PEER_FLAGS = ("--peer-tls-ca", "--peer-token")  # what a service that dials a peer takes


def security_field(dials: bool = True):
    """A config's `security` field, set by SECURITY_FLAGS ('' = unset); a service that dials
    nobody (the drafter) takes no `PEER_FLAGS`."""
    flags = [f for f in SECURITY_FLAGS if dials or f.name not in PEER_FLAGS]
    return flags_field(flags, Security.from_args, NONE)
