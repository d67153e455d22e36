"""What `specserve generate` and `probe` need to reach a gateway: its address, TLS, the token.

grpc is imported lazily (the cli package is part of the grpc-free core's namespace).
"""

from __future__ import annotations

import os
from pathlib import Path


def add_gateway_flags(p) -> None:
    p.add_argument("--gateway", default=os.environ.get("SPECSERVE_GATEWAY_ADDR",
                                                       "127.0.0.1:50051"),
                   help="gateway HOST:PORT [env SPECSERVE_GATEWAY_ADDR]")
    p.add_argument("--tls-ca", default=os.environ.get("SPECSERVE_CLIENT_TLS_CA") or None,
                   help="PEM CA of the gateway's certificate: TLS [env SPECSERVE_CLIENT_TLS_CA]")
    p.add_argument("--token", default=os.environ.get("SPECSERVE_CLIENT_TOKEN") or None,
                   help="bearer token the gateway wants [env SPECSERVE_CLIENT_TOKEN]")


def gateway_channel(args):
    """(a blocking channel to the gateway, the call metadata to send)."""
    import grpc

    from services.common.server import CHANNEL_OPTIONS

    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    if args.tls_ca:
        creds = grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes())
        return grpc.secure_channel(args.gateway, creds, options=CHANNEL_OPTIONS), metadata
    return grpc.insecure_channel(args.gateway, options=CHANNEL_OPTIONS), metadata
