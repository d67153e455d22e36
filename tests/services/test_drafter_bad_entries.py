"""Malformed Draft entries over a real drafter stream (loopback, port 0): each fails alone.

A batch mixing good entries with malformed context tensors, out-of-ring context references and
an entry whose decoding raises something unexpected answers every entry — trees for the good
ones, an error naming the problem for each bad one (no Python class names, no internals) — and
the stream goes on with the next batch.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import pytest_asyncio
import torch

from services.common.server import channel
from services.drafter import convert
from services.drafter.core import DrafterCore
from services.drafter.server import DrafterConfig, serve
from specserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from tests.services.test_drafter_service import (  # noqa: F401 (checkpoints: a fixture)
    PAGE,
    PAGES,
    RPC_S,
    WIDTH,
    _close,
    _dflash,
    _entry,
    _step,
    checkpoints,
)

RING_GEN, RING_ROWS = 7, 53
INTERNALS = re.compile(r"[A-Z]\w*(Error|Exception)|Traceback|<class|\.py\b")
aio = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def svc(checkpoints):  # noqa: F811 (the imported fixture)
    core = DrafterCore(dflash=_dflash(checkpoints))
    config = DrafterConfig(port=0, device="cpu", dtype="float32", page_size=PAGE,
                           num_pages=PAGES, lane="off")
    server, port = await serve(config, core=core)
    ring = torch.randn(RING_ROWS, WIDTH, generator=torch.Generator().manual_seed(5))
    server.attachments.runner.rings[RING_GEN] = ring  # as `Attach` would map it
    async with channel(f"127.0.0.1:{port}") as ch:
        yield SimpleNamespace(core=core, ring=ring, stub=drafter_pb2_grpc.DrafterStub(ch))
    await server.stop(0)


def _bad_tensor(rid: str, data: bytes, dtype: str, shape: list[int]) -> drafter_pb2.DraftEntry:
    msg = _entry(rid, 4, 3)
    msg.context.CopyFrom(common_pb2.Tensor(data=data, dtype=dtype, shape=shape))
    return msg


def _ref(rid: str, start: int, generation: int, offset: int, rows: int):
    msg = _entry(rid, 9, start)
    msg.context_ref.CopyFrom(drafter_pb2.ContextRef(generation=generation, offset=offset,
                                                    rows=rows))
    return msg


BAD_TENSORS = {  # request id → (data, dtype, shape, what its error must say)
    "neg-dims": (b"\0" * (5 * WIDTH * 4), "float32", [-5, -WIDTH], "negative dimension"),
    "odd-bytes": (b"\0" * (2 * WIDTH * 2 + 1), "bfloat16", [2, WIDTH],
                  "not a whole number of bfloat16 elements"),
    "overflow": (b"", "float32", [2**33, 2**31], "[8589934592, 2147483648] is too large"),
    "disagree": (b"\0" * (4 * WIDTH * 4), "float32", [3, WIDTH], f"shape [3, {WIDTH}] needs"),
    "dtype": (b"\0" * 8, "float64", [1], "unsupported tensor dtype 'float64'"),
    "rank": (b"\0" * (3 * WIDTH * 2), "float16", [1] * 37 + [3, WIDTH], "rank 39 is over 8"),
}
BAD_REFS = {  # request id → (generation, offset, rows, what its error must say)
    "ref-gen": (2**64 - 1, 0, 4, f"ring {2**64 - 1} is not attached"),
    "ref-neg-offset": (RING_GEN, -3, 4, "outside the ring's 53"),
    "ref-neg-rows": (RING_GEN, 10, -2**63, "outside the ring's 53"),
    "ref-huge-rows": (RING_GEN, 10, 2**63 - 1, "outside the ring's 53"),
    "ref-huge-offset": (RING_GEN, 2**63 - 1, 1, "outside the ring's 53"),
    "ref-past-end": (RING_GEN, 50, 4, "rows [50, 54) are outside"),
}


@aio
async def test_malformed_entries_fail_alone_and_the_stream_goes_on(svc):
    g = torch.Generator().manual_seed(11)
    ctx = torch.randn(6, WIDTH, generator=g)
    good = [_entry("good", 17, 6, ctx), _ref("good-ref", 23, RING_GEN, 13, 23)]
    bad = [_bad_tensor(rid, *case[:3]) for rid, case in BAD_TENSORS.items()]
    bad += [_ref(rid, 4, *case[:3]) for rid, case in BAD_REFS.items()]
    call = svc.stub.Draft(timeout=RPC_S)
    reply = await _step(call, 31, [good[0], *bad[:7], good[1], *bad[7:]])
    trees = {t.request_id: t for t in reply.trees}
    for rid in ("good", "good-ref"):
        assert trees[rid].error == "" and len(trees[rid].token_ids) == 8
    for rid, case in {**BAD_TENSORS, **BAD_REFS}.items():
        error = trees[rid].error
        assert error.startswith("INVALID_ARGUMENT:") and case[-1] in error, (rid, error)
        assert not INTERNALS.search(error), (rid, error)
        assert len(trees[rid].token_ids) == 0 and svc.core.dflash.cache.length(rid) == 0
    assert svc.core.dflash.cache.length("good-ref") == 23
    ring_rows = svc.ring[13:36].clone()
    reply = await _step(call, 32, [
        _entry("good", 5, 9, torch.randn(3, WIDTH, generator=g)),
        _entry("neg-dims", 2, 4, torch.randn(4, WIDTH, generator=g)),  # now well formed
        _ref("good-ref", 24, RING_GEN, 40, 1)])
    assert [t.error for t in reply.trees] == ["", "", ""]
    assert all(len(t.token_ids) == 8 for t in reply.trees)
    assert torch.equal(svc.ring[13:36], ring_rows)  # read in place, never written
    await _close(call)


@aio
async def test_an_unexpected_decode_failure_fails_its_entry_only(svc, monkeypatch):
    real = convert.tensor_from_pb

    def flaky(msg, device=None):
        if list(msg.shape) == [5, WIDTH]:
            raise RuntimeError("CUDA out of memory at /src/alloc.cpp:77")
        return real(msg, device)

    monkeypatch.setattr(convert, "tensor_from_pb", flaky)
    g = torch.Generator().manual_seed(12)
    call = svc.stub.Draft(timeout=RPC_S)
    reply = await _step(call, 40, [_entry("u-ok", 8, 2, torch.randn(2, WIDTH, generator=g)),
                                   _entry("u-oom", 8, 5, torch.randn(5, WIDTH, generator=g))])
    ok, oom = reply.trees
    assert ok.error == "" and len(ok.token_ids) == 8
    assert oom.error == "INTERNAL: the entry of request 'u-oom' could not be decoded"
    reply = await _step(call, 41, [_entry("u-oom", 1, 4, torch.randn(4, WIDTH, generator=g))])
    assert reply.trees[0].error == "" and len(reply.trees[0].token_ids) == 8
    await _close(call)
