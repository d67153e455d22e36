"""The verifier's drafter client against a scripted drafter (FakeDrafter: n-gram trees, checks
that history and context continue what it holds) over real gRPC: an unreachable drafter means
root-only steps; entry errors, a restart (context resent from 0) and rows not kept cost
speculation, never correctness."""

from __future__ import annotations

import logging

import grpc
import pytest

from services.common.convert import tensor_from_pb
from services.common.server import channel
from services.verifier.server import serve
from specserve.drafters.ngram import ngram_tree
from specserve.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.services.test_verifier_service import (
    DFLASH,
    HIDDEN,
    NGRAM,
    NONE,
    REPETITIVE,
    RPC_S,
    TAPS,
    _config,
    _free_port,
    _generate,
    _read_all,
    _request,
    _tokens,
    aio,
)

pytestmark = pytest.mark.timeout(60)


class FakeDrafter(drafter_pb2_grpc.DrafterServicer):
    """N-gram trees from the history it accumulates; checks that history and context continue
    what it holds (an error tree otherwise); the first `fail_first` batches error every entry
    after applying it (partial state the verifier must release)."""

    def __init__(self, fail_first: int = 0) -> None:
        self.history: dict[str, list[int]] = {}
        self.rows: dict[str, int] = {}
        self.fail_first, self.batches, self.inconsistent, self.fresh = fail_first, 0, [], 0
        self.feeds = 0
        self.kinds: dict[str, set[int]] = {}  # request id → the drafter kinds its entries named

    async def Draft(self, request_iterator, context):
        async for batch in request_iterator:
            for rid in batch.release:  # released before the batch's entries
                self.history.pop(rid, None)
                self.rows.pop(rid, None)
            if not batch.entries:
                yield drafter_pb2.TreeBatch(step_id=batch.step_id)
                continue
            self.batches += 1
            trees = [self._tree(e, self.batches <= self.fail_first) for e in batch.entries]
            yield drafter_pb2.TreeBatch(step_id=batch.step_id, trees=trees)

    def _tree(self, e, fail: bool) -> drafter_pb2.Tree:
        history = self.history.setdefault(e.request_id, [])
        self.kinds.setdefault(e.request_id, set()).add(e.drafter)
        feed = e.budget == 0 and not e.new_history  # prefill context only: no root yet
        self.fresh += not history and not feed
        history.extend(e.new_history)
        problem = None if feed or len(history) == e.start + 1 else \
            f"history {len(history)}@{e.start}"
        self.feeds += feed
        if e.drafter == DFLASH:
            n = tensor_from_pb(e.context).shape[0] if e.HasField("context") else 0
            held = self.rows.setdefault(e.request_id, 0)
            if held + n != e.start or (n and e.context.shape[1] != len(TAPS) * HIDDEN):
                problem = problem or f"context [{e.start - n}, {e.start}) after {held}"
            self.rows[e.request_id] = held + n
        if problem or fail:
            self.inconsistent += [problem] if problem else []
            return drafter_pb2.Tree(request_id=e.request_id, error=problem or "injected")
        tree = ngram_tree(history, e.budget, max_depth=max(1, min(15, e.max_depth)))
        return drafter_pb2.Tree(request_id=e.request_id, token_ids=tree.token_ids.tolist(),
                                parents=tree.parents.tolist(), depths=tree.depths.tolist())


async def _start_fake(fake: FakeDrafter, port: int = 0):
    server = grpc.aio.server()
    drafter_pb2_grpc.add_DrafterServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port



@aio
async def test_unreachable_drafter_means_root_only_steps(target, expected, caplog):
    """... and the operator is told, once (a wrong address decoded plainly in silence)."""
    address = f"127.0.0.1:{_free_port()}"
    caplog.set_level(logging.WARNING, "services.verifier.drafter_stream")
    server, port = await serve(_config(target, drafter=address, drafter_timeout_s=0.5))
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            events = await _generate(stub, REPETITIVE, 30)
            stats = await stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
    finally:
        await server.stop(0)
    assert _tokens(events) == expected(REPETITIVE, 30)
    steps = events[1:]
    assert all(e.commit_len == 1 and e.budget == 8 and "drafter_error" in e.fallback
               for e in steps)
    final = events[-1].final.stats
    assert sum(final.fallbacks.values()) == final.steps == len(steps)
    assert not stats.drafter_connected and sum(stats.fallbacks.values()) == len(steps)
    said = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert len(said) == 1 and address in said[0], said
    from services.verifier.__main__ import build_parser, config_from_args

    with pytest.raises(ValueError, match="--drafter must be HOST:PORT"):
        config_from_args(build_parser().parse_args(["--model", str(target), "--drafter", "h:x"]))


@aio
async def test_fake_drafter_speculates_after_entry_errors(target, expected):
    fake = FakeDrafter(fail_first=2)
    fake_server, fake_port = await _start_fake(fake)
    server, port = await serve(_config(target, drafter=f"127.0.0.1:{fake_port}"))
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            events = await _generate(stub, REPETITIVE, 60, drafter=NGRAM)
            clamped = await _generate(stub, REPETITIVE, 10, drafter=NGRAM, budget=100)
            plain = await _generate(stub, REPETITIVE, 10, drafter=NONE)
            stats = await stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
    finally:
        await server.stop(0)
        await fake_server.stop(0)
    assert _tokens(events) == expected(REPETITIVE, 60)
    assert [e.fallback for e in events[1:3]] == ["drafter_entry_error: injected"] * 2
    assert max(e.commit_len for e in events[3:]) > 1 and not fake.inconsistent
    final = events[-1].final.stats
    assert final.accepted_tokens > 0 and final.mean_commit_len > 1
    assert final.fallbacks == {"drafter_entry_error": 2}  # by kind; the reason is on the step
    assert all(e.budget == 16 for e in clamped[1:])
    assert all(e.budget == 0 and not e.fallback for e in plain)
    assert _tokens(plain) == _tokens(clamped) == expected(REPETITIVE, 10)
    # server-wide, by kind: no request's own reason leaks into Stats
    assert stats.drafter_connected and dict(stats.fallbacks) == {"drafter_entry_error": 2}


@aio
async def test_drafter_restart_resends_context_and_speculation_resumes(target, expected):
    fake = FakeDrafter()
    fake_server, fake_port = await _start_fake(fake)
    server, port = await serve(_config(target, drafter=f"127.0.0.1:{fake_port}",
                                       tap_layers=TAPS, kv_memory_gb=0.01))
    restarted = FakeDrafter()
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            prompts = [REPETITIVE, [11, 12, 13] * 5]
            calls = [stub.Generate(_request(p, 400, drafter=DFLASH), timeout=RPC_S)
                     for p in prompts]
            before = [[await c.read() for _ in range(10)] for c in calls]
            await fake_server.stop(0)  # mid-generation: steps fall back
            fake_server, _ = await _start_fake(restarted, fake_port)
            rest = [await _read_all(c) for c in calls]
            stats = await stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
    finally:
        await server.stop(0)
        await fake_server.stop(0)
    for prompt, head, tail in zip(prompts, before, rest, strict=True):
        assert _tokens(head + tail) == expected(prompt, 400)
        assert max(e.commit_len for e in head[1:]) > 1
        down = [i for i, e in enumerate(tail) if e.fallback]
        assert down and all("drafter_error" in tail[i].fallback for i in down)
        assert max(e.commit_len for e in tail[down[-1] + 1:]) > 1  # speculating again
    assert not fake.inconsistent and not restarted.inconsistent
    assert fake.feeds >= 2  # each prompt's context went ahead of its first draft (prefill feed)
    assert restarted.fresh == 2 and restarted.batches > 0  # both resent in full, from 0
    assert stats.drafter_connected


@aio
async def test_rows_not_kept_turn_requests_in_flight_to_the_ngram_drafter(target, expected):
    """keep_context off: after a drafter restart the requests in flight, whose DFlash context
    is gone, go on with n-gram trees (their history resent from 0) and still finish equal to
    the oracle; a new request speculates with DFlash."""
    fake = FakeDrafter()
    fake_server, fake_port = await _start_fake(fake)
    server, port = await serve(_config(target, drafter=f"127.0.0.1:{fake_port}",
                                       tap_layers=TAPS, kv_memory_gb=0.01, keep_context="off"))
    restarted = FakeDrafter()
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            call = stub.Generate(_request(REPETITIVE, 300, rid="inflight", drafter=DFLASH),
                                timeout=RPC_S)
            head = [await call.read() for _ in range(8)]
            await fake_server.stop(0)
            fake_server, _ = await _start_fake(restarted, fake_port)
            tail = await _read_all(call)
            fresh = await _generate(stub, [21, 22, 23, 24] * 6, 60, drafter=DFLASH)
    finally:
        await server.stop(0)
        await fake_server.stop(0)
    assert _tokens(head + tail) == expected(REPETITIVE, 300)
    assert max(e.commit_len for e in head[1:]) > 1
    assert not any(e.fallback.startswith("drafter_context_lost") for e in tail)
    assert max(e.commit_len for e in tail[-20:]) > 1  # n-gram trees accepted to the end
    assert restarted.kinds["inflight"] == {NGRAM} and restarted.fresh >= 1
    assert _tokens(fresh) == expected([21, 22, 23, 24] * 6, 60)
    assert max(e.commit_len for e in fresh[1:]) > 1 and not any(e.fallback for e in fresh[1:])
    assert not restarted.inconsistent
