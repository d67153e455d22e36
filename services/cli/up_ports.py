"""Which ports `specserve up` gives each service: the gRPC ports (--ports BASE and the
per-service overrides, else each service's SPECSERVE_*_PORT), the Prometheus ports
(--metrics-ports) and the OpenAI HTTP API's (--http-port) — the defaults moved together with
--ports, so two stacks with different --ports share none —, and every port a plan binds.
"""

from __future__ import annotations

import argparse
import os

from services.cli import usage
from services.common.settings import GATEWAY_METRICS_PORT, GATEWAY_PORT, HTTP_PORT

SERVICES = ("drafter", "verifier", "gateway")  # the start order of `up`
OFFSET = {"gateway": 0, "verifier": 1, "drafter": 2}  # ports from a base: --ports, --metrics-ports


def base_port(value: str) -> int:
    n = usage.port(value)
    if n > 65533:
        raise argparse.ArgumentTypeError(f"must leave room for BASE+2 (at most 65533), got {n}")
    return n


def http_port(value: str) -> str:
    http = str(value).strip().lower()
    if http != "off" and not (http.isdigit() and int(http) <= 65535):
        raise argparse.ArgumentTypeError(f"must be a port number or off, got {value!r}")
    return http


def http_port_of(args) -> str:
    """--http-port, else SPECSERVE_GATEWAY_HTTP_PORT, else 8000 moved with --ports (so two
    `up`s with different --ports do not share it)."""
    if args.http_port is not None:
        return args.http_port
    if (env := os.environ.get("SPECSERVE_GATEWAY_HTTP_PORT")) is not None:
        try:
            return http_port(env)
        except argparse.ArgumentTypeError as e:
            raise usage.UsageError(f"SPECSERVE_GATEWAY_HTTP_PORT: {e}") from None
    port = HTTP_PORT + args.ports - GATEWAY_PORT
    if not 1 <= port <= 65535:
        raise usage.UsageError(f"--ports {args.ports} moves the HTTP API's port ({port}) out "
                               "of range; give --http-port PORT (off = none)")
    return str(port)


def service_ports(args) -> dict[str, int]:
    """Each service's port: --NAME-port, else --ports BASE + offset, else the service's
    SPECSERVE_NAME_PORT, else 50051 + offset (`args.ports` is set to the base used)."""
    env = {n: os.environ.get(f"SPECSERVE_{n.upper()}_PORT") for n in SERVICES}
    base = args.ports if args.ports is not None else GATEWAY_PORT
    ports = {}
    for n in SERVICES:
        given = getattr(args, f"{n}_port")
        if given is None and args.ports is None and env[n] is not None:
            try:
                given = usage.port(env[n])
            except argparse.ArgumentTypeError as e:
                raise usage.UsageError(f"SPECSERVE_{n.upper()}_PORT: {e}") from None
        ports[n] = given or base + OFFSET[n]
    args.ports = base
    return ports


def metrics_ports(args) -> dict[str, int]:
    """Each service's Prometheus port (0 = none): --metrics-ports, else the service's
    SPECSERVE_*_METRICS_PORT, else its default moved with --ports (so two `up`s with different
    --ports do not share one)."""
    base = args.metrics_ports
    if base is not None and base != 0 and not 1 <= base <= 65533:
        raise usage.UsageError(f"--metrics-ports must be 0 or in [1, 65533], got {base}")
    env = {n: os.environ.get(f"SPECSERVE_{n.upper()}_METRICS_PORT") for n in SERVICES}
    if base is None:
        base = GATEWAY_METRICS_PORT + args.ports - GATEWAY_PORT
        if not 1 <= base <= 65533 and None in env.values():
            raise usage.UsageError(f"--ports {args.ports} moves the metrics ports ({base}.."
                                   f"{base + 2}) out of range; give --metrics-ports BASE (0 = "
                                   "none)")
        if not all(v is None or v.strip().isdigit() for v in env.values()):
            raise usage.UsageError(f"SPECSERVE_*_METRICS_PORT must be port numbers, got {env}")
        return {n: int(env[n]) if env[n] is not None else base + OFFSET[n] for n in SERVICES}
    return {n: base and base + OFFSET[n] for n in SERVICES}


def all_ports(args, plan) -> list[int]:
    """Every port `up` will bind: each service's gRPC and /metrics, the HTTP API's."""
    ports = [int(addr.rsplit(":", 1)[1]) for _n, addr, _f in plan]
    ports += [int(f[f.index("--metrics-port") + 1]) for _n, _a, f in plan]
    if str(args.http_port).lower() not in ("off", "0"):
        ports.append(int(args.http_port))
    return [p for p in ports if p]
