"""Several verifier replicas behind one gateway: which one takes the next request.

Each replica (an address of the comma-separated `--verifier` list) has its own
long-lived channel. `follow` checks every replica's gRPC health and `Stats` each period: a
replica is *healthy* while it reports SERVING, and its load is the latest `Stats` (running +
waiting requests, KV pages used / total). `pick` takes the healthy replica with the least load:
requests this gateway has open on it or its queue, whichever is more (the queue counts other
gateways' requests; the open count is current between polls), then the KV fill, then the one
picked longest ago. A replica whose call fails UNAVAILABLE is marked down at once (`mark_down`):
that request fails with UNAVAILABLE, new ones go elsewhere until its health check passes again.
While no replica is healthy (before the first check, or all down) a request still goes to the
least loaded, whose call then fails fast with UNAVAILABLE if it is really down. The gateway is
SERVING while at least one replica is.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specserve.v1 import verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)
VERIFIER_SERVICE = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
SERVING = health_pb2.HealthCheckResponse.ServingStatus.Value("SERVING")


@dataclass(eq=False)
class Replica:
    address: str
    channel: grpc.aio.Channel
    stub: verifier_pb2_grpc.VerifierStub = field(init=False)
    healthy: bool = False
    open: int = 0  # this gateway's calls in flight on it
    queue: int = 0  # running + waiting requests at its last Stats
    kv_fill: float = 0.0  # KV pages used / total at its last Stats
    max_model_len: int | None = None  # its longest prompt + max_tokens (None: no Stats yet)
    last_pick: int = -1

    def __post_init__(self) -> None:
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)

    def load(self) -> tuple[int, float, int]:
        return max(self.open, self.queue), self.kv_fill, self.last_pick


def parse_addresses(raw: str | Sequence[str]) -> tuple[str, ...]:
    """HOST:PORT addresses from a comma-separated string or a list of them (ValueError)."""
    items = raw.split(",") if isinstance(raw, str) else [a for r in raw for a in r.split(",")]
    out = tuple(a.strip() for a in items if a.strip())
    if not out:
        raise ValueError("at least one verifier address is needed")
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"verifier must be HOST:PORT, got {a!r}")
    if len(set(out)) != len(out):
        raise ValueError(f"a verifier address is given twice: {', '.join(out)}")
    return out


class Replicas:
    def __init__(self, channels: dict[str, grpc.aio.Channel]) -> None:
        self.replicas = [Replica(a, c) for a, c in channels.items()]
        self._picks = itertools.count()

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt + max_tokens any replica takes (None: none has told yet)."""
        return max((r.max_model_len for r in self.replicas if r.max_model_len), default=None)

    def pick(self) -> Replica:
        """The least-loaded healthy replica (none healthy: the least loaded); counts the
        request as open on it (`release`)."""
        healthy = [r for r in self.replicas if r.healthy] or self.replicas
        best = min(healthy, key=Replica.load)
        best.open += 1
        best.last_pick = next(self._picks)
        return best

    def release(self, replica: Replica) -> None:
        replica.open -= 1

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            log.warning("verifier at %s: %s; no new requests go there until it is healthy",
                        replica.address, why)
        replica.healthy = False

    async def poll(self, replica: Replica, timeout_s: float) -> bool:
        """One health check and Stats of `replica`; True if it changed healthy/unhealthy."""
        was = replica.healthy
        try:
            reply = await health_pb2_grpc.HealthStub(replica.channel).Check(
                health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE), timeout=timeout_s)
            replica.healthy = reply.status == SERVING
        except grpc.aio.AioRpcError as e:
            replica.healthy = False
            why = f"{e.code().name}: {e.details()}"
        else:
            why = "SERVING" if replica.healthy else "not serving"
        if replica.healthy:
            await self._load(replica, timeout_s)
        if replica.healthy != was:
            log.log(logging.INFO if replica.healthy else logging.WARNING, "verifier at %s: %s",
                    replica.address, why)
        return replica.healthy != was

    @staticmethod
    async def _load(replica: Replica, timeout_s: float) -> None:
        """Its queue and KV fill from Stats (kept as they were when Stats fails: health alone
        decides whether it takes requests)."""
        try:
            s = await replica.stub.Stats(verifier_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("verifier at %s: Stats failed: %s", replica.address, e.code().name)
            return
        replica.queue = s.active_requests + s.waiting_requests
        replica.kv_fill = s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0
        replica.max_model_len = s.max_model_len or None

    async def follow(self, period_s: float, timeout_s: float,
                     on_change: Callable[[bool], object] | None = None) -> None:
        """Poll every replica each `period_s` until cancelled; `on_change(any_healthy)` hears
        each change of the gateway's own serving state."""
        serving = None
        while True:
            await asyncio.gather(*(self.poll(r, timeout_s) for r in self.replicas))
            if self.any_healthy != serving:
                serving = self.any_healthy
                if on_change is not None:
                    await _maybe_await(on_change(serving))
            await asyncio.sleep(period_s)

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas))


async def _maybe_await(value) -> None:
    if asyncio.iscoroutine(value):
        await value
