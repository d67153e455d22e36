"""What `specserve generate` and `probe` need to reach a gateway: its address (a missing port is
the gateway's default gRPC port, not gRPC's 443), TLS, the token.

grpc is imported lazily (the cli package is part of the grpc-free core's namespace).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

_SCHEME = re.compile(r"(unix|unix-abstract|vsock|dns|ipv4|ipv6):")  # gRPC target syntax: as is


def add_gateway_flags(p) -> None:
    p.add_argument("--gateway", type=gateway_address,
                   default=os.environ.get("SPECSERVE_GATEWAY_ADDR", "127.0.0.1:50051"),
                   help="gateway HOST[:PORT]; a HOST alone means port 50051 [env "
                        "SPECSERVE_GATEWAY_ADDR]")
    p.add_argument("--tls-ca", default=os.environ.get("SPECSERVE_CLIENT_TLS_CA") or None,
                   help="PEM CA of the gateway's certificate: TLS [env SPECSERVE_CLIENT_TLS_CA]")
    p.add_argument("--token", default=os.environ.get("SPECSERVE_CLIENT_TOKEN") or None,
                   help="bearer token the gateway wants [env SPECSERVE_CLIENT_TOKEN]")


def gateway_address(value: str) -> str:
    """HOST → HOST:50051 (also [v6] and a bare IPv6 address); HOST:PORT and gRPC targets with a
    scheme (dns:///…, unix:…) are kept."""
    from services.common.settings import GATEWAY_PORT

    addr = value.strip()
    if not addr:
        raise argparse.ArgumentTypeError("must be HOST[:PORT], got ''")
    if "/" in addr or _SCHEME.match(addr):
        return addr
    if addr.startswith("["):  # [v6] or [v6]:PORT
        host, _, rest = addr.partition("]")
        return addr + f":{GATEWAY_PORT}" if not rest else _with_port(host + "]", rest[1:], value)
    if addr.count(":") > 1:  # a bare IPv6 address
        return f"[{addr}]:{GATEWAY_PORT}"
    host, _, port = addr.partition(":")
    return _with_port(host, port, value) if ":" in addr else f"{addr}:{GATEWAY_PORT}"


def _with_port(host: str, port: str, value: str) -> str:
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"must be HOST[:PORT] with a port in [1, 65535], "
                                         f"got {value!r}")
    return f"{host}:{int(port)}"


def gateway_channel(args):
    """(a blocking channel to the gateway, the call metadata to send)."""
    import grpc

    from services.common.server import CHANNEL_OPTIONS

    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes())
        return grpc.secure_channel(args.gateway, creds, options=CHANNEL_OPTIONS), metadata
    return grpc.insecure_channel(args.gateway, options=CHANNEL_OPTIONS), metadata


def rpc_error_text(error, gateway: str) -> str:
    """`CODE: details` of a failed gateway call; where nothing answered at `gateway`, what to
    start (the details alone name only the refused socket)."""
    name, details = error.code().name, error.details() or ""
    text = f"{name}: {details}"
    if name == "UNAVAILABLE" and "failed to connect" in details:
        text += (f" — no gateway answers at {gateway}; start the services with `specserve up`"
                 " or point --gateway (SPECSERVE_GATEWAY_ADDR) at yours")
    return text
