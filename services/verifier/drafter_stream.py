"""The asyncio side of the verifier's drafter client: ONE long-lived bidi `Draft` stream.

Owns the connection (channel, stub, the stream call, its epoch — bumped on every new stream, so
the engine side knows the drafter's copy of each request is gone), the replies in flight by step
id, the write lock (feeds and steps share the stream), background reconnects (at most one per
`reconnect_s`, so no step waits for one) and batched releases (in the stream, behind what was
written before them).
Each connection first asks `Attach` (offering the verifier's context ring when it has one):
`attachment` says, for the current epoch, whether the drafter mapped the ring and where its
same-host lane is (drafter_link.py uses both). Everything here runs on the server's event loop;
grpc.aio objects never leave it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from services.common.security import NONE, Security
from services.common.server import CHANNEL_OPTIONS, INTERNAL_MESSAGE_BYTES, with_message_limit
from services.common.server import channel as make_channel
from services.verifier import convert
from specserve.v1 import drafter_pb2_grpc

log = logging.getLogger(__name__)
# a restarted drafter is found within about reconnect_s (grpc's own default backoff reaches 120 s)
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                     ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 500)]


class DrafterUnavailable(Exception):
    """No usable stream to the drafter (down, connecting, or the stream broke)."""


class DrafterTimeout(Exception):
    """The drafter did not answer a step within the deadline."""


class _NotReady(Exception):
    """The drafter answered UNAVAILABLE: it is still loading."""


@dataclass(frozen=True)
class Attachment:
    """What `Attach` answered on the connection of `epoch`."""

    epoch: int
    ring_attached: bool
    ring_error: str
    lane_path: str | None
    lane_token: bytes
    max_message_bytes: int  # the largest message the drafter takes (0: unknown)


class DrafterStream:
    def __init__(self, address: str, timeout_s: float, reconnect_s: float,
                 ring=None, same_host: bool = True, security: Security = NONE) -> None:
        self.address, self.timeout_s, self.reconnect_s = address, timeout_s, reconnect_s
        self.security = security  # TLS to the drafter and the token sent to it
        self.ring_info = ring  # RingInfo offered on each connection (None: no ring)
        self.same_host = same_host  # False: ask for nothing (the cross-host path, measured)
        self.attachment: Attachment | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.epoch = 0
        self.closed = False
        self._channel = self._stub = self._call = None
        self._connecting: asyncio.Future | None = None
        self._said_down = False  # the drafter's being unreachable is logged once a time
        self._tasks: set[asyncio.Future] = set()
        self._last_attempt = -float("inf")
        self._pending: dict[int, asyncio.Future] = {}  # step id → its reply
        self._releases: set[str] = set()

    @property
    def connected(self) -> bool:
        return self._call is not None

    async def start(self) -> None:
        """Bind to the running loop and try to connect once (failure: retried in background)."""
        self.loop = asyncio.get_running_loop()
        self._write_lock = asyncio.Lock()
        await self._connect()

    async def close(self) -> None:
        self.closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        if self._call is not None:
            self._drop(self._call, "was closed")
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def exchange(self, step_id: int, epoch: int, batch, release: list[str],
                       timeout_s: float | None = None, stamps: list[int] | None = None):
        """Write `batch` (releasing `release` first, on the drafter), wait for its reply (raises
        DrafterUnavailable /
        DrafterTimeout; a timeout drops the stream: a drafter behind flushes its backlog).
        `stamps` gets the wall clock (ns) when the write was done and when the reply was in."""
        call, timeout_s = self._call, timeout_s or self.timeout_s
        if call is None or epoch != self.epoch:
            self._maybe_reconnect()
            raise DrafterUnavailable("no stream to the drafter")
        reply = self.loop.create_future()
        self._pending[step_id] = reply
        try:
            async with asyncio.timeout(timeout_s):
                async with self._write_lock:  # one write at a time on the stream (feeds, steps)
                    batch.release.extend(release)
                    await call.write(batch)
                if stamps is not None:
                    stamps.append(time.time_ns())
                got = await reply
                if stamps is not None:
                    stamps.append(time.time_ns())
                return got
        except TimeoutError:
            self._drop(call, "missed its deadline")
            raise DrafterTimeout(f"no reply within {timeout_s} s") from None
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            code = e.code().name if isinstance(e, grpc.aio.AioRpcError) else "unusable"
            self._drop(call, f"failed: {code}")
            raise DrafterUnavailable(f"the drafter stream broke ({code})") from None
        finally:
            waiter = self._pending.pop(step_id, None)
            if waiter is not None and waiter.done() and not waiter.cancelled():
                waiter.exception()  # retrieved: a dropped stream's error is not "never retrieved"

    def restart(self, why: str) -> None:
        """Drop the stream and reconnect (its lane broke: start over on a new epoch)."""
        if self._call is not None:
            self._drop(self._call, why)
        self._maybe_reconnect()

    def feed(self, coro) -> None:
        """Run a feed's exchange in the background."""
        self.spawn(coro)

    def queue_release(self, request_id: str) -> None:
        if not self._releases:
            self.spawn(self._flush_releases())
        self._releases.add(request_id)

    def spawn(self, coro) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _maybe_reconnect(self) -> None:
        busy = self._connecting is not None and not self._connecting.done()
        if self.closed or busy or time.monotonic() - self._last_attempt < self.reconnect_s:
            return
        self._connecting = self.spawn(self._connect())

    async def _connect(self) -> bool:
        self._last_attempt = time.monotonic()
        options = with_message_limit(CHANNEL_OPTIONS, INTERNAL_MESSAGE_BYTES)
        channel = make_channel(self.address, self.security, options + RECONNECT_OPTIONS)
        try:
            await asyncio.wait_for(channel.channel_ready(), max(self.timeout_s, 1.0))
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            await channel.close()
            return self._down(f"not reachable ({type(e).__name__})")
        if self.closed:
            await channel.close()
            return False
        stub = drafter_pb2_grpc.DrafterStub(channel)
        try:
            attached = await self._attach(stub)
        except _NotReady:  # still loading its models: try again later
            await channel.close()
            return self._down("not serving yet")
        # The stream lives as long as the connection; each step has its own deadline (timeout_s).
        call = stub.Draft(metadata=self.security.peer_metadata())
        self.epoch += 1  # every request is resent in full on the new stream
        self.attachment = None if attached is None else Attachment(self.epoch, *attached)
        self._channel, self._stub, self._call = channel, stub, call
        self.spawn(self._read(call))
        log.info("drafter stream to %s open", self.address)
        self._said_down = False
        return True

    def _down(self, why: str) -> bool:
        """A failed connection attempt, logged once until the next success: False."""
        if not self._said_down and not self.closed:
            self._said_down = True
            log.warning("drafter at %s %s: steps decode without drafts until it is; trying "
                        "again every %g s", self.address, why, self.reconnect_s)
        return False

    async def _attach(self, stub) -> tuple | None:
        """(ring attached, ring error, lane path, lane token, max message bytes), or None (a
        drafter without `Attach`). Not on one host: no ring offered, the lane not taken."""
        try:
            reply = await stub.Attach(
                convert.attach_to_pb(self.ring_info if self.same_host else None),
                timeout=max(self.timeout_s, 5.0), metadata=self.security.peer_metadata())
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise _NotReady from None
            log.warning("drafter at %s did not attach (%s): context rows go on the stream",
                        self.address, e.code())
            return None
        got = convert.attachment_from_pb(reply)
        if not self.same_host:
            return False, "", None, b"", got[4]
        if self.ring_info is not None and not got[0]:
            log.warning("drafter at %s could not map the context ring: %s", self.address, got[1])
        return got

    async def _read(self, call) -> None:
        try:
            while (reply := await call.read()) is not grpc.aio.EOF:
                waiter = self._pending.get(reply.step_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(reply)  # a late reply to a timed-out step is dropped
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            log.warning("drafter stream to %s ended: %s", self.address,
                        getattr(e, "code", lambda: "cancelled")())
        finally:
            self._drop(call, "ended")

    def _drop(self, call, why: str) -> None:
        """Forget a dead (or abandoned) stream; waiting steps fail at once."""
        if self._call is not call:
            return
        channel, self._channel, self._stub, self._call = self._channel, None, None, None
        call.cancel()
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(DrafterUnavailable(f"the drafter stream {why}"))
        self._pending.clear()
        if channel is not None:
            self.spawn(channel.close())

    async def _flush_releases(self) -> None:
        """The step's releases as one release-only batch on the stream: after any feed or step
        written before it, as the drafter reads the stream in order."""
        await asyncio.sleep(0)  # batch the releases of one step into one message
        ids, self._releases = self._releases, set()
        call = self._call
        if call is None or not ids:
            return  # no drafter: its state went with the connection
        try:
            async with self._write_lock:
                await call.write(convert.release_batch(ids))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            log.debug("release of %d requests failed: %s", len(ids), e)
