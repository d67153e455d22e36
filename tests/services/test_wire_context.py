"""Context rows on the drafter wire: written into the batch in place and read back exactly (a
malformed Tensor message is an InvalidRequest, nothing else), and the verifier's kept rows (for
resends) merged without copying a long prompt's chunks again."""

from __future__ import annotations

import random

import pytest
import torch

from services.common.convert import MAX_TENSOR_RANK, tensor_from_pb, tensor_to_pb
from services.drafter import convert as drafter_convert
from services.verifier import convert
from services.verifier.context_rows import MAX_CHUNKS
from services.verifier.drafter_client import RemoteDrafter
from specserve.drafters.base import DraftRequest
from specserve.errors import InvalidRequest
from specserve.v1 import common_pb2, drafter_pb2

ITEM = {"float32": 4, "bfloat16": 2, "float16": 2}
DIMS = [0, 1, 2, 3, 7, 13, -1, -6, 2**31, 2**32 + 5, 2**62, 2**63 - 1, -2**63]
CHECKS = ("unsupported tensor dtype", "rank", "negative dimension", "too large", "whole number",
          "elements, its data holds")


def test_context_rows_in_place_round_trip_exactly():
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows = (torch.randn(37, 24, generator=gen) * 3).to(dtype)  # [rows, taps · hidden]
        batch = convert.draft_batch(5)
        req = DraftRequest("a", 11, 37, 16, 7, rows)
        convert.add_draft_entry(batch, req, "dflash", rows, [4, 9], {"traceparent": "x"})
        convert.add_draft_entry(batch, DraftRequest("b", 2, 3, 0, 0), None, None, [])
        wire = drafter_pb2.DraftBatch.FromString(batch.SerializeToString())
        assert wire.step_id == 5 and [e.request_id for e in wire.entries] == ["a", "b"]
        a, b = wire.entries
        assert (a.bonus_token, a.start, a.budget, a.max_depth, list(a.new_history)) == (
            11, 37, 16, 7, [4, 9]) and dict(a.trace_context) == {"traceparent": "x"}
        assert a.context == tensor_to_pb(rows) and not b.HasField("context")
        got = tensor_from_pb(a.context)
        assert got.dtype == dtype and torch.equal(got, rows)
        got[0, 0] = 0  # the host copy is the caller's own (writable)


def test_a_chain_ask_crosses_the_wire():
    """`DraftRequest.chain` (adaptive's held chains) reaches the drafter's request as sent."""
    batch = convert.draft_batch(1)
    for rid, chain in (("c", True), ("t", False)):
        convert.add_draft_entry(batch, DraftRequest(rid, 3, 40, 7, 9, chain=chain), None, None,
                                [3])
    wire = drafter_pb2.DraftBatch.FromString(batch.SerializeToString())
    got = [drafter_convert.entry_from_pb(e, torch.device("cpu"), torch.float32).request
           for e in wire.entries]
    assert [(r.request_id, r.budget, r.chain) for r in got] == [("c", 7, True), ("t", 7, False)]


def _random_tensor_msg(rng: random.Random) -> common_pb2.Tensor:
    """A Tensor message that is sometimes well formed: a dtype known or not, a rank up to twice
    the bound, dimensions small, negative or huge, data of the right length or not."""
    dtype = rng.choice([*ITEM, "float64", "int8", "", "Float32", "bfloat16 "])
    rank = rng.choice([0, 1, 2, 2, 3, rng.randrange(2 * MAX_TENSOR_RANK + 1)])
    shape = [rng.choice(DIMS) if rng.random() < 0.3 else rng.randrange(1, 9) for _ in range(rank)]
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * ITEM.get(dtype, 4) if 0 <= numel <= 4096 and rng.random() < 0.6 else \
        rng.randrange(0, 300)
    nbytes += rng.choice([0, 0, 0, 1, -1]) if nbytes else 0
    return common_pb2.Tensor(data=rng.randbytes(nbytes), dtype=dtype, shape=shape)


def test_malformed_tensors_are_invalid_requests_only():
    rng, decoded, rejected = random.Random(20240611), 0, []
    for _ in range(3000):
        msg = _random_tensor_msg(rng)
        try:
            got = tensor_from_pb(msg)
        except InvalidRequest as e:
            rejected += [c for c in CHECKS if c in str(e)]
            assert "Error" not in str(e) and "<class" not in str(e)
            continue
        decoded += 1
        assert list(got.shape) == list(msg.shape) and len(msg.shape) <= MAX_TENSOR_RANK
        assert tensor_to_pb(got) == msg  # the very bytes, dtype and shape
    assert decoded + len(rejected) == 3000  # each rejection named one check
    assert decoded > 200 and all(rejected.count(c) > 20 for c in CHECKS)


def test_kept_rows_merge_the_newer_half_only():
    """A prompt's big chunks stay the very tensors kept (no copy per MAX_CHUNKS decode steps);
    every row is still there, in order; a single pending chunk goes out without a copy."""
    client = RemoteDrafter("127.0.0.1:1", target_layer_ids=(1,))  # not started: no stream
    gen = torch.Generator().manual_seed(0)
    prompt = [torch.randn(50, 8, generator=gen) for _ in range(3)]
    start = 0
    for chunk in prompt:  # the first entry names the drafter for good
        start += chunk.shape[0]
        req = DraftRequest("r", 1, start, 0, 0, chunk, kind="dflash" if start == 50 else None)
        assert "r" in client.entries.absorb_all([req], None)
    st = client.entries.states["r"]
    assert st.kind == "dflash"
    assert st.rows_since(100).data_ptr() == prompt[2].data_ptr()  # the last chunk, as is
    decode = [torch.randn(1, 8, generator=gen) for _ in range(3 * MAX_CHUNKS)]
    for row in decode:
        start += 1
        assert "r" in client.entries.absorb_all([DraftRequest("r", 1, start, 0, 0, row)], None)
        assert len(st.chunks) <= MAX_CHUNKS
    assert [c.data_ptr() for c in st.chunks[:3]] == [c.data_ptr() for c in prompt]
    assert st.num_rows == start == 150 + 3 * MAX_CHUNKS
    assert torch.equal(st.rows_since(0), torch.cat(prompt + decode))
    assert torch.equal(st.rows_since(149), torch.cat([prompt[2][-1:]] + decode))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_context_rows_go_straight_to_the_gpu():
    rows = torch.randn(300, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = tensor_from_pb(tensor_to_pb(rows), "cuda")
    assert got.is_cuda and got.dtype == torch.bfloat16 and torch.equal(got.cpu(), rows)
