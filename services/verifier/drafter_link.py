"""How the verifier's engine thread reaches the drafter for one epoch: the gRPC stream or the lane.

Owns the two transports behind one engine-thread interface — `start` / `wait` (a step's batch
out, its reply waited for with the deadline; several may be in flight), `feed` (a prefill
chunk's batch, its reply handled whenever it arrives), `release`, `make_room` (wait until the
ring gives a segment back) — and
the context ring's segment accounting: a batch's segments are given back when its reply is in
(the drafter has read them) or its connection is gone.

`GrpcLink` runs the stream's coroutines on the event loop and waits. `LaneLink` (same host,
after `Attach`) writes frames on a Unix socket from the engine thread itself and reads the
replies there too: a step is two system calls each way on each side, no event loop, no thread
hop; feed replies that arrive first are dispatched while it waits for its own. A lane that
breaks or times out is dropped (`broken`), and the connection restarts on a new epoch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable

from services.common import lane
from services.common.ring import ContextRing
from services.verifier import convert
from services.verifier.drafter_stream import DrafterStream, DrafterTimeout, DrafterUnavailable

FEED_DEADLINE = 10  # a prefill feed's deadline, in draft deadlines (timeout_s)
# on_done({failed request id: the drafter's error}, or None when the whole feed failed)
FeedDone = Callable[[dict[str, str] | None], None]


def _failed_ids(reply) -> dict[str, str]:
    return {rid: tree for rid, tree in convert.trees_from_pb(reply).items()
            if isinstance(tree, str)}


class GrpcLink:
    """Steps on the gRPC stream (its event loop does the I/O; the engine thread waits)."""

    kind = "grpc"
    broken = False

    def __init__(self, stream: DrafterStream, timeout_s: float) -> None:
        self.stream, self.timeout_s = stream, timeout_s
        self.ring: ContextRing | None = None  # set per epoch by the client
        self.epoch = 0

    def start(self, step_id: int, epoch: int, batch, release: list[str], stamps: list[int]):
        """Send a step's batch; `wait` on what this returns for its reply."""
        future = asyncio.run_coroutine_threadsafe(
            self.stream.exchange(step_id, epoch, batch, release, stamps=stamps),
            self.stream.loop)
        return step_id, future

    def wait(self, started, stamps: list[int]):
        step_id, future = started
        try:
            return future.result(self.timeout_s + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise DrafterTimeout(f"no reply within {self.timeout_s} s") from None
        finally:
            if self.ring is not None:
                self.ring.done(step_id)

    def feed(self, step_id: int, epoch: int, batch, release: list[str], ids: list[str],
             on_done: FeedDone) -> None:
        async def run():
            try:  # a prefill chunk's rows take longer than a step's draft
                reply = await self.stream.exchange(step_id, epoch, batch, release,
                                                   FEED_DEADLINE * self.timeout_s)
                on_done(_failed_ids(reply))
            except Exception:  # noqa: BLE001 — any failure: the next draft resends everything
                on_done(None)
            finally:
                if self.ring is not None:
                    self.ring.done(step_id)

        self.stream.loop.call_soon_threadsafe(lambda: self.stream.feed(run()))

    def release(self, request_id: str) -> None:
        self.stream.loop.call_soon_threadsafe(self.stream.queue_release, request_id)

    def make_room(self, timeout_s: float) -> bool:
        return self.ring is not None and self.ring.wait_free(timeout_s)

    def close(self) -> None:
        pass


class LaneLink:
    """Steps as frames on the drafter's lane, written and read by the engine thread."""

    kind = "lane"

    def __init__(self, client: lane.LaneClient, epoch: int, ring: ContextRing | None,
                 timeout_s: float) -> None:
        self.client, self.epoch, self.ring, self.timeout_s = client, epoch, ring, timeout_s
        self.broken = False
        self._feeds: dict[int, tuple[list[str], FeedDone]] = {}
        self._replies: dict[int, object] = {}  # step replies read before their `wait`

    def start(self, step_id: int, epoch: int, batch, release: list[str], stamps: list[int]):
        """Send a step's batch; `wait(step_id)` for its reply."""
        try:
            if release:
                self.client.send(lane.RELEASE, convert.release_bytes(release))
            self.client.send(lane.BATCH, batch.SerializeToString())
            stamps.append(time.time_ns())
        except lane.LaneClosed as e:
            self._break()
            raise DrafterUnavailable(f"the drafter's lane broke: {e}") from None
        return step_id

    def wait(self, step_id: int, stamps: list[int]):
        try:
            deadline = time.monotonic() + self.timeout_s
            while step_id not in self._replies:
                self._read(max(deadline - time.monotonic(), 1e-3))
            stamps.append(time.time_ns())
            return self._replies.pop(step_id)
        except lane.LaneTimeout:
            self._break()
            raise DrafterTimeout(f"no reply within {self.timeout_s} s") from None
        except lane.LaneClosed as e:
            self._break()
            raise DrafterUnavailable(f"the drafter's lane broke: {e}") from None
        finally:
            if self.ring is not None:
                self.ring.done(step_id)

    def feed(self, step_id: int, epoch: int, batch, release: list[str], ids: list[str],
             on_done: FeedDone) -> None:
        try:
            if release:
                self.client.send(lane.RELEASE, convert.release_bytes(release))
            self.client.send(lane.BATCH, batch.SerializeToString())
            self._feeds[step_id] = (ids, on_done)
            self.poll()
        except (lane.LaneClosed, lane.LaneTimeout):
            self._break()
            on_done(None)

    def release(self, request_id: str) -> None:
        try:
            self.client.send(lane.RELEASE, convert.release_bytes([request_id]))
        except lane.LaneClosed:
            self._break()

    def poll(self) -> None:
        """Handle the feed replies that are already in."""
        while self._feeds and not self.broken and self.client.ready():
            self._read(self.timeout_s)

    def make_room(self, timeout_s: float) -> bool:
        if not self._feeds:
            return False  # nothing in flight can give a segment back
        try:
            self._read(timeout_s)
            return True
        except (lane.LaneClosed, lane.LaneTimeout):
            self._break()
            return False

    def _read(self, timeout_s: float):
        kind, payload = self.client.recv(timeout_s)
        if kind != lane.TREES:
            raise lane.LaneClosed(f"the drafter sent frame kind {kind}: {payload[:200]!r}")
        reply = convert.tree_batch_from_bytes(payload)
        if self.ring is not None:  # the drafter has read its rows
            self.ring.done(reply.step_id)
        feed = self._feeds.pop(reply.step_id, None)
        if feed is not None:
            feed[1](_failed_ids(reply))
        else:
            self._replies[reply.step_id] = reply

    def _break(self) -> None:
        self.broken = True
        for _, on_done in self._feeds.values():
            on_done(None)
        self._feeds.clear()
        self._replies.clear()
        if self.ring is not None:
            self.ring.reset()
        self.client.close()

    def close(self) -> None:
        if not self.broken:
            self._break()
