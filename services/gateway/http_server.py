"""uvicorn serving an ASGI app inside the caller's running event loop (the gateway's, beside its
gRPC server): bound before it starts (port 0 resolves at once), TLS / mutual TLS from the same
`Security` as the gRPC port, no signal handlers of its own (the gateway owns SIGINT/SIGTERM),
and a graceful stop that lets in-flight responses finish for `grace_s`. Then the app's
`state.grace_over()`, if it has one (the OpenAI front's), ends the requests still running so
that they answer (503, a stream's error event); uvicorn cancels what is left `ANSWER_S` later,
and `stop` returns once those requests have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn

from services.common.security import Security

ANSWER_S = 2.0  # after the grace: how long the requests still running have to answer


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the gateway's handlers stay in place
        yield


class HttpListener:
    def __init__(self, app, host: str, port: int, security: Security, grace_s: float,
                 log_level: str = "warning") -> None:
        self._sock = socket.create_server((host, port), family=_family(host))
        self.port = self._sock.getsockname()[1]
        self._grace_s = max(grace_s, 0.0)
        self._grace_over = getattr(getattr(app, "state", None), "grace_over", None)
        config = uvicorn.Config(
            app, log_level=log_level.lower(), access_log=False, lifespan="off",
            timeout_graceful_shutdown=self._grace_s + ANSWER_S, ssl_certfile=security.tls_cert,
            ssl_keyfile=security.tls_key, ssl_ca_certs=security.tls_client_ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if security.tls_client_ca else ssl.CERT_NONE)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Serve until `stop`; returns the bound port once accepting."""
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]),
                                         name="gateway-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP listener stopped during startup")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let open responses finish (up to the grace), end the rest, close."""
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        done, _ = await asyncio.wait({self._task}, timeout=self._grace_s)
        if not done and self._grace_over is not None:
            self._grace_over()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if left := set(self._server.server_state.tasks):  # cancelled, not yet ended
            await asyncio.wait(left, timeout=ANSWER_S)
        self._sock.close()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
