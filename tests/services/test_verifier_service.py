"""The verifier service over real gRPC (loopback, port 0) with a tiny random target.

Streamed tokens must equal the in-process engine's greedy output whatever the drafter does (none,
unreachable, a fake n-gram drafter that errors first, one restarted mid-generation); bad requests
map to status codes without hurting the server; a cancelled stream frees its KV pages at once; a
request that fails inside the engine fails alone (its own status, the others' streams intact).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.convert import tensor_from_pb
from services.common.server import channel
from services.verifier.server import VerifierConfig, serve
from specserve.config import EngineConfig
from specserve.drafters.ngram import ngram_tree
from specserve.engine.engine import Engine
from specserve.errors import InvalidRequest
from specserve.types import SamplingParams
from specserve.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.helpers import make_checkpoint, random_prompts

VOCAB, HIDDEN, MAX_POS = 211, 96, 512
TAPS = (0, 2)
RPC_S = 30.0
DFLASH, NGRAM, NONE = (common_pb2.DRAFTER_KIND_DFLASH, common_pb2.DRAFTER_KIND_NGRAM,
                       common_pb2.DRAFTER_KIND_NONE)
REPETITIVE = [5, 6, 7, 8, 9] * 4
aio = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("verifier-svc"), "qwen3-gqa1-tied")
    return path


@pytest.fixture(scope="module")
def expected(target):
    """Greedy output of the in-process engine (no speculation): the oracle."""
    engine, done = Engine(EngineConfig(str(target))), {}

    def greedy(prompt: list[int], n: int) -> list[int]:  # a greedy prefix is its own answer
        if len(done.get(tuple(prompt), ())) < n:
            done[tuple(prompt)] = engine.generate([prompt], _params(n))[0]
        return done[tuple(prompt)][:n]

    return greedy


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _config(target, **kw) -> VerifierConfig:
    kw = {"port": 0, "device": "cpu", "dtype": "float32", "kv_memory_gb": 0.0015,
          "max_draft_tokens": 16, "default_budget": 8, "grace_s": 0.5, **kw}
    return VerifierConfig(model=str(target), **kw)


def _request(prompt, max_tokens=24, rid="", sampling=None, **spec):
    sampling = sampling or common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return verifier_pb2.VerifyRequest(request_id=rid, prompt_ids=prompt, sampling=sampling,
                                      spec=common_pb2.SpecOptions(**spec))


async def _generate(stub, prompt, max_tokens=24, **spec) -> list[verifier_pb2.VerifyEvent]:
    return [e async for e in stub.Generate(_request(prompt, max_tokens, **spec), timeout=RPC_S)]


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


async def _read_all(call) -> list[verifier_pb2.VerifyEvent]:
    events = []
    while (event := await call.read()) is not grpc.aio.EOF:
        events.append(event)
    return events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeDrafter(drafter_pb2_grpc.DrafterServicer):
    """N-gram trees from the history it accumulates; checks that history and context continue
    what it holds (an error tree otherwise); the first `fail_first` batches error every entry
    after applying it (partial state the verifier must release)."""

    def __init__(self, fail_first: int = 0) -> None:
        self.history: dict[str, list[int]] = {}
        self.rows: dict[str, int] = {}
        self.fail_first, self.batches, self.inconsistent, self.fresh = fail_first, 0, [], 0
        self.feeds = 0

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


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def plain(target):
    server, port = await serve(_config(target))
    async with channel(f"127.0.0.1:{port}") as ch:
        yield SimpleNamespace(stub=verifier_pb2_grpc.VerifierStub(ch), channel=ch)
    await server.stop(0)


@aio
async def test_streams_equal_engine_generate(plain, expected):
    health = health_pb2_grpc.HealthStub(plain.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(service="specserve.v1.Verifier"),
                               timeout=RPC_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    prompts = random_prompts(4, VOCAB, [5, 9, 13, 20], seed=3)
    streams = await asyncio.gather(*[_generate(plain.stub, p, 24) for p in prompts])
    for prompt, events in zip(prompts, streams, strict=True):
        assert _tokens(events) == expected(prompt, 24)
        final = events[-1].final
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), 24)
        assert all(not e.HasField("final") for e in events[:-1])
        assert all(e.budget == 0 and e.tree_size == 0 and not e.fallback for e in events)
        assert final.stats.steps == len(events) - 1  # every decode step; prefill's token aside
        assert final.stats.phases.verify_s > 0 and final.stats.phases.other_s >= 0


@aio
@pytest.mark.parametrize("prompt,sampling,spec,message", [
    ([], None, {}, "prompt is empty"),
    ([1] * MAX_POS, None, {}, "the model's context is 512"),
    ([4, 9, 2], common_pb2.SamplingParams(max_tokens=MAX_POS - 2), {},
     "prompt has 3 tokens and max_tokens is 510; the model's context is 512 tokens"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, stop=["ab", "c"] * 8 + ["d"]), {},
     "17 stop strings; at most 16 are allowed"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, stop=["é" * 2100, "xyz" * 33]), {},
     "stop strings of 4299 bytes (UTF-8); at most 4096"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, stop=["q" * 4097]), {},
     "at least 4097 bytes"),
    ([1, 2, VOCAB + 5], None, {}, "out of vocabulary"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=0), {}, "max_tokens must be a positive"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, temperature=-1), {}, "temperature"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, top_p=0.0), {}, "top_p must be in"),
    ([1, 2], None, {"budget": -1}, "budget must be >= 0"),
])
async def test_bad_requests_are_invalid_argument(plain, expected, prompt, sampling, spec,
                                                 message):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in plain.stub.Generate(_request(prompt, sampling=sampling, **spec),
                                           timeout=RPC_S):
            pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert _tokens(await _generate(plain.stub, [3, 4, 5], 8)) == expected([3, 4, 5], 8)


@aio
async def test_request_larger_than_the_pool_is_resource_exhausted(plain):
    stats = await plain.stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
    assert stats.kv_pages_total < (MAX_POS + 17) // 16  # so a full-context request cannot fit
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _generate(plain.stub, [1, 2, 3], MAX_POS - 3)  # fits the context, not the pool
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV pages" in err.value.details()


async def _pages_back_within_1s(stub, used: int) -> None:
    deadline = time.monotonic() + 1.0
    while True:
        now = await stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
        if now.kv_pages_used == used and now.active_requests == 0:
            return
        assert time.monotonic() < deadline, f"pages still used: {now}"
        await asyncio.sleep(0.02)


@aio
async def test_cancel_or_deadline_mid_stream_frees_pages(plain):
    before = await plain.stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
    call = plain.stub.Generate(_request([7, 8, 9], 400), timeout=RPC_S)
    seen = [await call.read() for _ in range(3)]
    during = await plain.stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
    call.cancel()
    assert all(e.token_ids for e in seen) and during.kv_pages_used > before.kv_pages_used
    await _pages_back_within_1s(plain.stub, before.kv_pages_used)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # 450 steps take far longer than 0.2 s
        [e async for e in plain.stub.Generate(_request([7, 8, 9], 450), timeout=0.2)]
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _pages_back_within_1s(plain.stub, before.kv_pages_used)


def test_main_writes_port_file_and_drains_on_sigterm(target, tmp_path):
    port_file = tmp_path / "verifier.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.verifier", "--model", str(target), "--port", "0",
         "--device", "cpu", "--kv-memory-gb", "0.01", "--port-file", str(port_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "GRPC_VERBOSITY": "ERROR", "SPECSERVE_GRACE_S": "0.2"})
    try:
        deadline = time.monotonic() + 45
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        port = int(port_file.read_text())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert f"specserve verifier listening on 127.0.0.1:{port}" in out


@aio
async def test_unreachable_drafter_means_root_only_steps(target, expected):
    server, port = await serve(_config(target, drafter=f"127.0.0.1:{_free_port()}",
                                       drafter_timeout_s=0.5))
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
    assert final.fallbacks["drafter_entry_error: injected"] == 2
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
async def test_rows_not_kept_end_speculation_for_requests_in_flight_only(target, expected):
    """keep_context off: after a drafter restart the requests in flight verify root-only trees
    (drafter_context_lost) and still finish equal to the oracle; a new request speculates."""
    fake = FakeDrafter()
    fake_server, fake_port = await _start_fake(fake)
    server, port = await serve(_config(target, drafter=f"127.0.0.1:{fake_port}",
                                       tap_layers=TAPS, kv_memory_gb=0.01, keep_context="off"))
    restarted = FakeDrafter()
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            call = stub.Generate(_request(REPETITIVE, 300, drafter=DFLASH), timeout=RPC_S)
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
    lost = [e for e in tail if e.fallback.startswith("drafter_context_lost")]
    assert lost and all(e.commit_len == 1 for e in tail[-len(lost):])
    assert _tokens(fresh) == expected([21, 22, 23, 24] * 6, 60)
    assert max(e.commit_len for e in fresh[1:]) > 1 and not any(e.fallback for e in fresh[1:])
    assert not restarted.inconsistent

VICTIMS = random_prompts(8, VOCAB, [5, 17, 9, 26, 3, 12, 30, 7], seed=13)


def _victim_calls(stub):
    return [_generate(stub, p, 6 + 3 * i) for i, p in enumerate(VICTIMS)]


def _check_victims(streams, expected) -> None:
    for i, (prompt, events) in enumerate(zip(VICTIMS, streams, strict=True)):
        assert _tokens(events) == expected(prompt, 6 + 3 * i)
        assert events[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH


async def _read_all_or_error(call) -> tuple[list, grpc.aio.AioRpcError | None]:
    events = []
    try:
        while (event := await call.read()) is not grpc.aio.EOF:
            events.append(event)
    except grpc.aio.AioRpcError as e:
        return events, e
    return events, None


@aio
@pytest.mark.parametrize("temperature", [1e-38, 1e-44])  # 1e-44: this tiny model overflows too
async def test_tiny_temperature_is_greedy_beside_victims(plain, expected, temperature):
    tiny = common_pb2.SamplingParams(max_tokens=20, temperature=temperature, ignore_eos=True)
    tiny_events, *streams = await asyncio.gather(
        _generate(plain.stub, [4, 9, 2, 7], sampling=tiny), *_victim_calls(plain.stub))
    assert _tokens(tiny_events) == expected([4, 9, 2, 7], 20)
    _check_victims(streams, expected)
    await _pages_back_within_1s(plain.stub, 0)


@aio
@pytest.mark.parametrize("error,code", [
    (RuntimeError("probability tensor contains either inf, nan or element < 0"),
     grpc.StatusCode.INTERNAL),
    (InvalidRequest("bad sampling state"), grpc.StatusCode.INVALID_ARGUMENT),
])
async def test_a_request_failing_in_the_engine_fails_alone(plain, expected, monkeypatch, error,
                                                           code):
    commit = Engine._commit

    def failing_commit(engine, seq, tokens):  # the doomed request fails after its first token
        if seq.request_id == "doomed" and seq.output_ids:
            raise error
        return commit(engine, seq, tokens)

    monkeypatch.setattr(Engine, "_commit", failing_commit)
    doomed = plain.stub.Generate(_request([8, 3, 5, 1, 6], 30, rid="doomed"), timeout=RPC_S)
    seen, *streams = await asyncio.gather(_read_all_or_error(doomed), *_victim_calls(plain.stub))
    events, err = seen
    assert _tokens(events) == expected([8, 3, 5, 1, 6], 1) and err is not None
    assert err.code() == code
    assert err.details() == f"request 'doomed' failed: {type(error).__name__}: {error}"
    _check_victims(streams, expected)
    await _pages_back_within_1s(plain.stub, 0)


@aio
async def test_full_queue_is_resource_exhausted_and_stats_show_reservations(target, expected):
    """max_num_seqs 1, max_waiting 2: with one request running and two waiting the next is
    RESOURCE_EXHAUSTED with a clear message; the others finish exact; Stats count what running
    requests reserved apart from what they use."""
    server, port = await serve(_config(target, max_num_seqs=1, max_waiting=2,
                                       kv_memory_gb=0.01))
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11], [12, 13, 14, 15, 16]]
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            long = stub.Generate(_request(prompts[0], 480), timeout=RPC_S)
            first = await long.read()  # running: the next two wait behind it
            queued = [asyncio.ensure_future(_generate(stub, p, 30)) for p in prompts[1:]]
            deadline = time.monotonic() + 10
            while True:
                stats = await stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
                if stats.waiting_requests == 2 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.005)
            assert stats.waiting_requests == 2 and stats.active_requests == 1
            assert 0 < stats.kv_pages_used <= stats.kv_pages_reserved <= stats.kv_pages_total
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(stub, [1, 2, 3], 5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue is full" in err.value.details()
            rest = [[first, *await _read_all(long)], *await asyncio.gather(*queued)]
    finally:
        await server.stop(0)
    for p, events, n in zip(prompts, rest, (480, 30, 30), strict=True):
        assert _tokens(events) == expected(p, n)


@aio
async def test_unset_sampling_takes_the_models_generation_config(target, tmp_path, expected):
    """A request that leaves temperature / top_k / top_p unset samples as the checkpoint's
    generation_config.json says (do_sample); one that says temperature 0 stays greedy."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(target, model)
    (model / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.9, "top_k": 7, "top_p": 0.97}')
    prompt = [31, 7, 99, 12, 64]
    engine = Engine(EngineConfig(str(model)))
    want = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.9, top_k=7,
                                                    top_p=0.97, seed=3, ignore_eos=True))[0]
    server, port = await serve(_config(model))
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            unset = common_pb2.SamplingParams(max_tokens=20, seed=3, ignore_eos=True)
            sampled = await _generate_with(stub, prompt, unset)
            greedy = await _generate_with(stub, prompt, common_pb2.SamplingParams(
                max_tokens=20, temperature=0.0, ignore_eos=True))
    finally:
        await server.stop(0)
    assert _tokens(sampled) == want != expected(prompt, 20)
    assert _tokens(greedy) == expected(prompt, 20)


async def _generate_with(stub, prompt, sampling):
    req = verifier_pb2.VerifyRequest(prompt_ids=prompt, sampling=sampling,
                                     spec=common_pb2.SpecOptions(budget=0))
    return [e async for e in stub.Generate(req, timeout=RPC_S)]
