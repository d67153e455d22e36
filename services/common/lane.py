"""The lane: verifier ↔ drafter messages on one host as frames on a Unix socket.

Owns the framing (a kind byte, a 4-byte length, the serialized protobuf message), the blocking
client the verifier's engine thread uses (`LaneClient`) and the drafter's accept loop
(`LaneServer`: one thread per connection, no event loop). The messages are the drafter API's
own (DraftBatch, TreeBatch, ReleaseRequest): the lane replaces grpc's HTTP/2 stream and the
event-loop hops around it, not the schema. A connection opens with a HELLO frame carrying the
token the drafter handed out in `Attach`. No grpc here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from services.common.orphans import remove_orphans

log = logging.getLogger(__name__)

HELLO, BATCH, RELEASE, TREES, ERROR = 1, 2, 3, 4, 5
_HEAD = struct.Struct("<BI")
MAX_FRAME_BYTES = 1 << 31


class LaneClosed(Exception):
    """The lane's peer went away (or the frame was malformed)."""


class LaneTimeout(Exception):
    """No frame within the deadline."""


def default_path(port: int) -> str:
    """Where a drafter on `port` listens unless told otherwise (`--lane PATH`); the sockets
    of drafters that died without removing theirs are removed."""
    root = Path(tempfile.gettempdir())
    remove_orphans(root, "specserve-drafter-*-*.sock", 3)
    return str(root / f"specserve-drafter-{port}-{os.getpid()}.sock")


def _recv_exact(sock: socket.socket, n: int) -> memoryview:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LaneClosed("the lane's peer closed it")
        got += k
    return view


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    head = _HEAD.pack(kind, len(payload))
    if len(payload) < (1 << 16):  # one system call for a step's small frame
        sock.sendall(head + payload)
    else:
        sock.sendall(head)
        sock.sendall(payload)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, n = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if n > MAX_FRAME_BYTES:
        raise LaneClosed(f"frame of {n} bytes")
    return kind, bytes(_recv_exact(sock, n)) if n else b""


class LaneClient:
    """The verifier's end (one thread uses it: the engine thread). A send that cannot finish
    within `timeout_s` (the peer not reading: say both ends sending a frame larger than the
    socket's buffer) raises LaneClosed, so the lane is dropped instead of held forever."""

    def __init__(self, path: str, token: bytes, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect(path)
            send_frame(self.sock, HELLO, token)
        except OSError as e:
            self.sock.close()
            raise LaneClosed(f"cannot open the lane {path}: {e}") from None

    def send(self, kind: int, payload: bytes) -> None:
        try:
            self.sock.settimeout(self.timeout_s)
            send_frame(self.sock, kind, payload)
        except OSError as e:
            raise LaneClosed(f"lane write failed: {e}") from None

    def ready(self) -> bool:
        """A frame (or the peer's close) can be read without waiting."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def recv(self, timeout_s: float) -> tuple[int, bytes]:
        try:
            self.sock.settimeout(timeout_s)
            return recv_frame(self.sock)
        except TimeoutError:
            raise LaneTimeout(f"no frame within {timeout_s} s") from None
        except OSError as e:
            raise LaneClosed(f"lane read failed: {e}") from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


# handler(kind, payload) -> None, or a reply frame (kind, payload, then: a callable run once it
# is sent, or None); `closed()` runs when the lane ends
Handler = Callable[[int, bytes], tuple[int, bytes, Callable[[], None] | None] | None]


class LaneServer:
    """The drafter's listening socket; `connect(token)` gives the handler of a new lane (None:
    a token it never issued, and the connection is closed)."""

    def __init__(self, path: str, connect: Callable[[bytes], tuple[Handler, Callable] | None]
                 ) -> None:
        self.path, self._connect = path, connect
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="lane-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="lane", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        closed = None
        try:
            kind, token = recv_frame(conn)
            got = self._connect(token) if kind == HELLO else None
            if got is None:
                send_frame(conn, ERROR, b"unknown lane token")
                return
            handler, closed = got
            while True:
                reply = handler(*recv_frame(conn))
                if reply is not None:
                    send_frame(conn, reply[0], reply[1])
                    if reply[2] is not None:
                        reply[2]()
        except (LaneClosed, OSError):
            pass
        except Exception:  # a handler bug ends this lane only; the verifier falls back
            log.exception("lane handler failed")
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            if closed is not None:
                closed()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
