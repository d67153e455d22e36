"""The context ring and the lane: segments never overlap what the drafter may still read, another
process reads the rows in place (shared memory on the CPU, CUDA IPC on a GPU), a ring from
elsewhere is refused by its nonce, and the lane carries frames only for the token it issued."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from services.common import lane
from services.common.ring import ContextRing, RingInfo, map_ring

ROOT = Path(__file__).resolve().parents[2]


def test_segments_never_overlap_live_ones():
    """Random allocations and in-order replies against a brute-force occupancy map."""
    ring = ContextRing(97, 3, torch.float32, "cpu")
    rng = random.Random(5)
    live: list[tuple[int, int, int]] = []  # (tag, start, end) in allocation order
    try:
        for tag in range(3000):
            if live and rng.random() < 0.45:
                ring.done(live.pop(0)[0])  # replies come in order
                continue
            n = rng.choice([1, 2, 5, 17, 40, 97])
            start = ring.alloc(n, tag)
            if start is None:
                assert live, f"an empty ring refused {n} rows"
                continue
            assert start >= 0 and start + n <= 97
            assert all(start + n <= a or b <= start for _, a, b in live), (start, n, live)
            live.append((tag, start, start + n))
            assert ring.live_rows == sum(b - a for _, a, b in live)
        for tag, _, _ in live:
            ring.done(tag)
        assert ring.live_rows == 0 and ring.alloc(97, 0) == 0
    finally:
        ring.close()


def _child_reads(info: RingInfo, start: int, rows: int) -> list[float]:
    """Map `info` in a fresh interpreter and return the row sums of [start, start + rows)."""
    spec = dataclasses.asdict(info)
    spec["nonce"] = info.nonce.hex()
    if info.cuda is not None:
        spec["cuda"] = [x.hex() if isinstance(x, bytes) else x for x in info.cuda]
    code = f"""
import json, sys, torch
from services.common.ring import RingInfo, map_ring
s = json.loads({json.dumps(json.dumps(spec))})
s["nonce"] = bytes.fromhex(s["nonce"])
if s["cuda"] is not None:
    s["cuda"] = tuple(bytes.fromhex(x) if isinstance(x, str) else x for x in s["cuda"])
view = map_ring(RingInfo(**s))
print(json.dumps(view[{start}:{start + rows}].double().sum(-1).cpu().tolist()))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_another_process_reads_the_rows_in_place(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ring = ContextRing(300, 40, dtype, device)
    try:
        rows = (torch.randn(37, 40, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
        start = ring.alloc(37, 1)
        ring.write(start, rows.to(device))
        ring.publish()
        got = _child_reads(ring.info, start, 37)
        assert got == pytest.approx(rows.double().sum(-1).tolist(), rel=1e-6, abs=1e-6)
    finally:
        ring.close()


def test_a_ring_from_elsewhere_is_refused():
    ring = ContextRing(8, 4, torch.float32, "cpu")
    try:
        forged = dataclasses.replace(ring.info, nonce=bytes(16))
        with pytest.raises(ValueError, match="nonce"):
            map_ring(forged)
        with pytest.raises(ValueError, match="no shared file"):
            map_ring(dataclasses.replace(ring.info, shm_path="/nonexistent/ring"))
        assert torch.equal(map_ring(ring.info), ring.view)
    finally:
        ring.close()
    with pytest.raises(ValueError, match="no shared file"):
        map_ring(ring.info)  # closed: the file is gone


def test_rings_of_dead_verifiers_are_swept():
    """A verifier killed with -9 leaves its ring file; the next ring made on the host removes it
    (and leaves a live process's alone)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    if root is None:
        pytest.skip("no /dev/shm")
    stale, live = root / f"specserve-ring-{dead}-abc123", root / "specserve-ring-1-def456"
    stale.write_bytes(b"x" * 64)
    live.write_bytes(b"x" * 64)  # pid 1 is alive
    try:
        ContextRing(4, 4, torch.float32, "cpu").close()
        assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_lane_sockets_of_dead_drafters_are_swept(tmp_path, monkeypatch):
    """A drafter killed with -9 leaves its lane socket, and each restart names a new one: the
    next drafter's socket path removes the dead ones (a live process's stays)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    monkeypatch.setattr(lane.tempfile, "gettempdir", lambda: str(tmp_path))
    stale = tmp_path / f"specserve-drafter-50053-{dead}.sock"
    live, other = tmp_path / "specserve-drafter-50053-1.sock", tmp_path / "specserve-drafter-x"
    for f in (stale, live, other):
        f.write_bytes(b"")
    path = lane.default_path(50053)
    assert path.startswith(str(tmp_path)) and not stale.exists()
    assert live.exists() and other.exists()


def test_lane_frames_only_for_its_token(tmp_path):
    closed = threading.Event()

    def connect(token: bytes):
        if token != b"good":
            return None
        return (lambda kind, payload: (lane.TREES, payload[::-1], None) if kind == lane.BATCH
                else None), closed.set

    server = lane.LaneServer(str(tmp_path / "l.sock"), connect)
    try:
        client = lane.LaneClient(server.path, b"good", 5.0)
        client.send(lane.RELEASE, b"ignored")
        big = bytes(range(256)) * 1000  # past the one-syscall size
        for payload in (b"abc", big):
            client.send(lane.BATCH, payload)
            assert client.recv(5.0) == (lane.TREES, payload[::-1])
        with pytest.raises(lane.LaneTimeout):
            client.recv(0.05)
        client.close()
        assert closed.wait(5)
        bad = lane.LaneClient(server.path, b"bad", 5.0)
        assert bad.recv(5.0)[0] == lane.ERROR
        with pytest.raises(lane.LaneClosed):
            bad.recv(5.0)
    finally:
        server.close()


def test_a_lane_send_the_peer_does_not_read_times_out(tmp_path):
    """A peer that stops reading (its own send blocked, say) cannot hold the verifier's
    engine thread: the send gives up after the lane's timeout and the lane is dropped."""
    release = threading.Event()

    def connect(token: bytes):
        return (lambda kind, payload: release.wait(10) and None), lambda: None

    server = lane.LaneServer(str(tmp_path / "stuck.sock"), connect)
    try:
        client = lane.LaneClient(server.path, b"any", 0.3)
        client.send(lane.BATCH, b"x")  # the handler now waits: nothing reads the socket
        t0 = time.monotonic()
        with pytest.raises(lane.LaneClosed, match="lane write failed"):
            client.send(lane.BATCH, random.Random(7).randbytes(64 << 20))  # past any buffer
        assert time.monotonic() - t0 < 5  # the timeout, not the handler's 10 s
        client.close()
    finally:
        release.set()
        server.close()
