"""Context rows on the drafter wire: written into the batch in place and read back exactly, and
the verifier's kept rows (for resends) merged without copying a long prompt's chunks again."""

from __future__ import annotations

import pytest
import torch

from services.common.convert import tensor_from_pb, tensor_to_pb
from services.verifier import convert
from services.verifier.context_rows import MAX_CHUNKS
from services.verifier.drafter_client import RemoteDrafter
from specserve.drafters.base import DraftRequest
from specserve.v1 import drafter_pb2


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


def test_kept_rows_merge_the_newer_half_only():
    """A prompt's big chunks stay the very tensors kept (no copy per MAX_CHUNKS decode steps);
    every row is still there, in order; a single pending chunk goes out without a copy."""
    client = RemoteDrafter("127.0.0.1:1", target_layer_ids=(1,))  # not started: no stream
    client.set_kind("r", "dflash")
    st = client.entries.states["r"]
    gen = torch.Generator().manual_seed(0)
    prompt = [torch.randn(50, 8, generator=gen) for _ in range(3)]
    start = 0
    for chunk in prompt:
        start += chunk.shape[0]
        assert "r" in client.entries.absorb_all([DraftRequest("r", 1, start, 0, 0, chunk)], None)
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
