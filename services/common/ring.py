"""The context ring: verifier → drafter context rows through memory both processes map.

Owns the verifier's ring (`ContextRing`: a buffer of `rows × width` elements after a 64-byte
header holding a random nonce; FIFO segments handed out per draft batch and given back when its
reply arrives) and the drafter's mapping of it (`map_ring`). On CUDA the buffer is a device
allocation shared through torch's CUDA IPC (`UntypedStorage._share_cuda_`); on the CPU it is a
file under /dev/shm mapped shared by both. The wire then carries only (generation, offset,
rows): the drafter reads the rows in place.

Ordering contract: the verifier writes a segment and synchronizes its stream before the batch
that names it is sent; the drafter finishes every read of it before it replies; the verifier
reuses the segment only after that reply (or once the connection is gone: then the drafter's
copy of every request is discarded anyway). No grpc here.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.orphans import remove_orphans
from specserve.models.loader import DTYPES as MODEL_DTYPES

HEADER_BYTES = 64
NONCE_BYTES = 16
DTYPES = MODEL_DTYPES  # what a ring may hold: the models' dtypes
# the drafter's entry error for rows in a ring it does not hold (the verifier then attaches again)
RING_UNKNOWN = "is not attached here"


@dataclass(frozen=True)
class RingInfo:
    """What the drafter needs to map a ring (services/*/convert.py turns it into RingSpec)."""

    generation: int
    rows: int
    width: int
    dtype: str
    nonce: bytes
    shm_path: str | None = None
    cuda: tuple | None = None  # UntypedStorage._share_cuda_() of the buffer

    def __post_init__(self) -> None:
        if self.rows <= 0 or self.width <= 0:
            raise ValueError(f"ring rows and width must be positive, got {self.rows}, "
                             f"{self.width}")
        if self.dtype not in DTYPES:
            raise ValueError(f"ring dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if (self.shm_path is None) == (self.cuda is None):
            raise ValueError("a ring is either a shared file or a CUDA IPC allocation")

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.rows * self.width * DTYPES[self.dtype].itemsize


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _rows_view(buf: torch.Tensor, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The `[rows, width]` view of a uint8 buffer after its header."""
    return buf[HEADER_BYTES:].view(dtype).view(rows, width)


class ContextRing:
    """The verifier's ring; thread-safe (segments are given back on the event loop too)."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        device = torch.device(device)
        self.rows, self.width, self.dtype, self.device = rows, width, dtype, device
        self.generation = secrets.randbits(63)
        nonce = secrets.token_bytes(NONCE_BYTES)
        nbytes = HEADER_BYTES + rows * width * dtype.itemsize
        self._path = None
        if device.type == "cuda":
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            shared = dict(cuda=self._buf.untyped_storage()._share_cuda_())
        else:
            self._path = _shm_path()
            self._path.touch(mode=0o600)  # context features: this user's processes only
            self._buf = torch.from_file(str(self._path), shared=True, size=nbytes,
                                        dtype=torch.uint8)
            shared = dict(shm_path=str(self._path))
        self._buf[:NONCE_BYTES].copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
        self.view = _rows_view(self._buf, rows, width, dtype)  # [rows, width]
        self.info = RingInfo(self.generation, rows, width, _dtype_name(dtype), nonce, **shared)
        self._lock = threading.Condition()
        self._live: deque[list] = deque()  # [tag, start, end, done] in allocation order
        self._head = 0  # next free row

    # ---- segments ----------------------------------------------------------------------------
    def alloc(self, n: int, tag: int) -> int | None:
        """First row of a free segment of `n` rows for batch `tag`; None if none is free now."""
        if not 0 < n <= self.rows:
            return None
        with self._lock:
            start = self._fit(n)
            if start is not None:
                self._live.append([tag, start, start + n, False])
                self._head = start + n
            return start

    def _fit(self, n: int) -> int | None:
        if not self._live:
            return 0
        tail = self._live[0][1]  # the oldest live segment's first row
        if self._live[-1][1] >= tail:  # not wrapped: live [tail, head), free around it
            if self._head + n <= self.rows:
                return self._head
            return 0 if n <= tail else None
        return self._head if self._head + n <= tail else None  # wrapped: free [head, tail)

    def done(self, tag: int) -> None:
        """Batch `tag` was answered: its segments may be reused (FIFO)."""
        with self._lock:
            for seg in self._live:
                if seg[0] == tag:
                    seg[3] = True
            while self._live and self._live[0][3]:
                self._live.popleft()
            self._lock.notify_all()

    def wait_free(self, timeout_s: float) -> bool:
        """Wait until some segment is given back (other threads answer batches)."""
        with self._lock:
            live = len(self._live)
            return self._lock.wait_for(lambda: len(self._live) < live, timeout_s)

    def reset(self) -> None:
        """The connection is gone: every segment is free."""
        with self._lock:
            self._live.clear()
            self._head = 0
            self._lock.notify_all()

    @property
    def live_rows(self) -> int:
        with self._lock:
            return sum(end - start for _, start, end, _ in self._live)

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Copy `rows [n, width]` into the ring at `start` (async on CUDA: `publish` after)."""
        self.view[start : start + rows.shape[0]].copy_(rows, non_blocking=True)

    def publish(self) -> None:
        """Make every write so far visible to the drafter (before its batch is sent)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            self._path = None


def _shm_path() -> Path:
    """A fresh ring file; rings left by verifiers that died without closing are removed."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    remove_orphans(root, "specserve-ring-*-*", 2)
    return root / f"specserve-ring-{os.getpid()}-{secrets.token_hex(6)}"


def map_ring(info: RingInfo) -> torch.Tensor:
    """The drafter's `[rows, width]` view of the verifier's ring. Raises ValueError if it
    cannot be mapped or its header does not carry `info.nonce` (another host's memory)."""
    dtype = DTYPES[info.dtype]
    try:
        if info.cuda is not None:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(*info.cuda)
            buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{info.cuda[0]}")
            buf.set_(storage, 0, (storage.nbytes(),))
        else:
            if not Path(info.shm_path).is_file():
                raise ValueError(f"no shared file {info.shm_path} on this host")
            buf = torch.from_file(info.shm_path, shared=True, size=info.nbytes,
                                  dtype=torch.uint8)
    except (RuntimeError, OSError, AssertionError) as e:
        raise ValueError(f"cannot map the ring: {type(e).__name__}: {e}") from None
    if buf.numel() < info.nbytes:
        raise ValueError(f"the ring has {buf.numel()} bytes, expected {info.nbytes}")
    if bytes(buf[:NONCE_BYTES].cpu().numpy()) != info.nonce:
        raise ValueError("the ring's nonce differs: not the verifier's memory")
    return _rows_view(buf, info.rows, info.width, dtype)
