"""Adaptive speculation through the verifier service: the drafter's path log-probs cross the
wire (Tree.scores), each step's event says what was chosen and why, the final stats count the
choices, the Prometheus counter has them — and the tokens are the in-process engine's."""

from __future__ import annotations

import urllib.request

import numpy as np
import pytest

from services.common.server import channel
from services.verifier.server import serve
from specserve.spec.metrics import reason_kind
from specserve.v1 import drafter_pb2, verifier_pb2, verifier_pb2_grpc
from tests.services.test_verifier_drafter import FakeDrafter, _start_fake
from tests.services.test_verifier_service import (
    NGRAM,
    REPETITIVE,
    _config,
    _free_port,
    _generate,
    _tokens,
    aio,
)

pytestmark = pytest.mark.timeout(90)


class ScoredDrafter(FakeDrafter):
    """The fake's n-gram trees, each node's path scored as if the drafter were sure of it."""

    def _tree(self, e, fail: bool) -> drafter_pb2.Tree:
        tree = super()._tree(e, fail)
        tree.scores.extend((np.log(0.9) * np.asarray(tree.depths, dtype=np.float64)).tolist())
        return tree


@aio
async def test_adaptive_choices_travel_with_the_steps(target, expected):
    fake = ScoredDrafter()
    fake_server, fake_port = await _start_fake(fake)
    metrics_port = _free_port()
    server, port = await serve(_config(target, drafter=f"127.0.0.1:{fake_port}", adaptive="on",
                                       metrics_port=metrics_port, warmup="on"))
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            events = await _generate(stub, REPETITIVE, 48, drafter=NGRAM, budget=16)
            stats = await stub.Stats(verifier_pb2.StatsRequest())
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=5).read().decode()
    finally:
        await server.stop(0)
        await fake_server.stop(0)
    assert _tokens(events) == expected(REPETITIVE, 48) and not fake.inconsistent
    steps = events[1:]
    shaped = [e for e in steps if e.shape]  # an empty draft (no n-gram match yet) has none
    assert len(shaped) >= len(steps) // 2
    assert all(e.shape in ("tree", "chain", "off") and e.why for e in shaped)
    assert all(e.tree_size <= 16 and e.budget == 16 for e in steps)
    spec = [e for e in shaped if e.shape != "off"]
    assert spec and sum(e.accepted_depth for e in spec) > 0  # a repetitive text: trees pay
    final = events[-1].final.stats
    assert sum(final.shapes.values()) == len(shaped) and final.steps == len(steps)
    assert 'specserve_adaptive_choices_total{shape="' in body
    reasons = {reason_kind(e.why) for e in shaped}  # each why has a kind, the metric counts it
    assert "other" not in reasons and reasons & {"decided", "held", "explore"}
    for kind in reasons:
        assert f'specserve_adaptive_reasons_total{{reason="{kind}"}}' in body
    # the cost model the choices were made by: plain decoding's step and the trees', measured
    assert any(k.startswith("verify n=1 rows=1 ") for k in stats.cost_ms)
    assert any(k.startswith("verify n=1 rows=") and not k.startswith("verify n=1 rows=1 ")
               for k in stats.cost_ms)
    assert all(v > 0 for v in stats.cost_ms.values())
