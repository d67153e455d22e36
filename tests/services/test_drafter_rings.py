"""The drafter's context rings (services/drafter/attach.py): a ring whose verifier exited (its
shared file is gone) is dropped at the next attach, and past MAX_RINGS the least recently READ
one goes — never one a live verifier keeps using, however many verifiers attached since. The
verifier is told of a ring the drafter does not hold (`RING_UNKNOWN`) and attaches again
(tests/services/test_verifier_drafter.py)."""

from __future__ import annotations

import pytest
import torch

from services.common.ring import RING_UNKNOWN, ContextRing
from services.drafter import attach as attach_mod
from services.drafter.attach import Attachments
from services.drafter.convert import _ring_rows
from services.drafter.steps import BatchRunner
from services.verifier import convert as vconvert
from specserve.errors import InvalidRequest
from specserve.v1 import drafter_pb2 as pb


def _attach(att: Attachments, ring: ContextRing) -> bool:
    return att.attach(vconvert.attach_to_pb(ring.info)).ring_attached


def _read(att: Attachments, ring: ContextRing, rows: int = 2) -> torch.Tensor:
    ref = pb.ContextRef(generation=ring.info.generation, offset=1, rows=rows)
    return _ring_rows(ref, att.runner.rings)


def test_a_ring_in_use_outlives_many_attaches_and_a_dead_ones_go(monkeypatch):
    monkeypatch.setattr(attach_mod, "MAX_RINGS", 3)
    att = Attachments(BatchRunner(), lambda: None, lane_path=None)
    live = ContextRing(11, 5, torch.float32, "cpu")
    rows = torch.arange(55, dtype=torch.float32).view(11, 5) * 0.37 - 3.1
    live.write(0, rows)
    others = []
    try:
        assert _attach(att, live)
        for _ in range(7):  # seven more verifiers attach, one after the other
            other = ContextRing(7, 5, torch.float32, "cpu")
            others.append(other)
            assert _attach(att, other)
            _read(att, live)  # the first verifier keeps drafting
            assert live.info.generation in att.runner.rings
            assert len(att.runner.rings) <= 3
        held = set(att.runner.rings)
        assert held == {live.info.generation, *(o.info.generation for o in others[-2:])}
        others[-1].close()  # that verifier exits: its shared file is removed
        fresh = ContextRing(7, 5, torch.float32, "cpu")
        others.append(fresh)
        assert _attach(att, fresh)
        assert others[-2].info.generation not in att.runner.rings  # dropped: file gone
        assert {live.info.generation, fresh.info.generation} <= set(att.runner.rings)
        with pytest.raises(InvalidRequest, match=f"context ring .* {RING_UNKNOWN}"):
            _read(att, others[0])  # evicted long ago: the verifier is told
        assert torch.equal(_read(att, live), rows[1:3])  # the live verifier's rows, in place
    finally:
        for r in [live, *others]:
            r.close()
