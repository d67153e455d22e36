"""The verifier service over real gRPC (loopback, port 0) with a tiny random target.

Streamed tokens must equal the in-process engine's greedy output whatever the drafter does (none,
unreachable, a fake n-gram drafter that errors first, one restarted mid-generation); bad requests
map to status codes without hurting the server; a cancelled stream frees its KV pages at once; a
request that fails inside the engine fails alone (its own status, the others' streams intact);
`--admission-window-ms` prefills a burst in one step.
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

from services.common.server import channel
from services.verifier.server import VerifierConfig, serve
from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.errors import InvalidRequest
from specserve.types import SamplingParams
from specserve.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.helpers import random_prompts

VOCAB, HIDDEN, MAX_POS = 211, 96, 512
TAPS = (0, 2)
RPC_S = 30.0
DFLASH, NGRAM, NONE = (common_pb2.DRAFTER_KIND_DFLASH, common_pb2.DRAFTER_KIND_NGRAM,
                       common_pb2.DRAFTER_KIND_NONE)
REPETITIVE = [5, 6, 7, 8, 9] * 4
aio = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(60)


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
    ([1] * MAX_POS, None, {}, f"context length is 512 tokens. However, the prompt has "
                              f"{MAX_POS} tokens"),
    ([4, 9, 2], common_pb2.SamplingParams(max_tokens=MAX_POS - 2), {},
     "context length is 512 tokens. However, you requested 513 tokens (3 in the prompt, 510 "
     "in max_tokens)"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, stop=["ab", "c"] * 8 + ["d"]), {},
     "17 stop strings; at most 16 are allowed"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, stop=["é" * 2100, "xyz" * 33]), {},
     "stop strings of 4299 bytes (UTF-8); at most 4096"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, stop=["q" * 4097]), {},
     "at least 4097 bytes"),
    ([1, 2, VOCAB + 5], None, {}, "out of vocabulary"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=0), {}, "max_tokens must be an integer in [1, "),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, temperature=-1), {}, "temperature"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=4, top_p=0.0), {}, "top_p must be in"),
    ([1, 2], None, {"budget": -1}, "budget must be >= 0"),
    ([1, 2], None, {"rid": "v" * 300}, "request id of 300 characters; at most 256"),
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
async def test_the_page_gauges_hold_the_pool_before_the_first_request(target):
    server, port = await serve(_config(target))
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stats = await verifier_pb2_grpc.VerifierStub(ch).Stats(verifier_pb2.StatsRequest(),
                                                                   timeout=RPC_S)
        value = server.metrics.registry.get_sample_value
        assert stats.kv_pages_free == stats.kv_pages_total > 0
        assert stats.max_model_len == MAX_POS  # what the gateway refuses longer prompts by
        assert value("specserve_kv_pages_free") == stats.kv_pages_free  # was 0 until a step
        assert value("specserve_kv_pages_used") == 0
    finally:
        await server.stop(0)


@aio
async def test_request_larger_than_the_pool_is_invalid_argument(target):
    """It can never run here: RESOURCE_EXHAUSTED (HTTP 429) would tell the client to retry.
    What a request needs is its tokens (plain decoding: no scratch)."""
    server, port = await serve(_config(target, kv_memory_gb=0.001))
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            pool = (await stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)
                    ).kv_pages_total * 16
            assert pool < MAX_POS - 8  # a request that fits the context, not the pool
            prompt = [1 + i % 200 for i in range(pool)]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(stub, prompt, 8)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "KV pages" in err.value.details() and "can never run" in err.value.details()
            assert f"({pool + 8} tokens + 0 scratch)" in err.value.details()
            assert len(_tokens(await _generate(stub, prompt[:pool - 8], 8))) == 8  # exactly fits
    finally:
        await server.stop(0)


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
    commit = Engine.commit_tokens

    def failing_commit(engine, seq, tokens):  # the doomed request fails after its first token
        if seq.request_id == "doomed" and seq.output_ids:
            raise error
        return commit(engine, seq, tokens)

    monkeypatch.setattr(Engine, "commit_tokens", failing_commit)
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


@pytest.mark.parametrize("asked, drafter, kind, budget, capped", [
    (100, True, common_pb2.DRAFTER_KIND_NGRAM, 16, True),  # over --max-draft-tokens: capped
    (16, True, common_pb2.DRAFTER_KIND_NGRAM, 16, False),  # at it: as asked
    (None, True, common_pb2.DRAFTER_KIND_UNSPECIFIED, 8, False),  # the default budget
    (100, False, common_pb2.DRAFTER_KIND_NGRAM, 0, False),  # no drafter: plain decoding
    (100, True, common_pb2.DRAFTER_KIND_NONE, 0, False),  # asked for none
])
def test_a_budget_over_max_draft_tokens_is_capped_and_says_so(asked, drafter, kind, budget,
                                                              capped):
    from services.verifier.convert import SpecLimits, generate_args_from_pb

    spec = common_pb2.SpecOptions(drafter=kind)
    if asked is not None:
        spec.budget = asked
    msg = verifier_pb2.VerifyRequest(prompt_ids=[1, 2], spec=spec,
                                     sampling=common_pb2.SamplingParams(max_tokens=4))
    args = generate_args_from_pb(msg, SpecLimits(8, 16, drafter), "r")
    assert (args.budget, args.asked_budget, args.capped) == (budget, 8 if asked is None else
                                                             asked, capped)


@aio
@pytest.mark.parametrize("window_ms, steps", [(400.0, 2), (0.0, None)])
async def test_the_admission_window_prefills_a_burst_in_one_step(target, expected, window_ms,
                                                                 steps):
    """Three requests sent 40 ms apart to an idle verifier, 2 tokens each: with a 400 ms
    window they are prefilled together and decode together (2 steps); without one the first
    runs alone first (more steps). Tokens equal the engine's either way."""
    server, port = await serve(_config(target, admission_window_ms=window_ms))
    prompts = random_prompts(3, VOCAB, [7, 11, 6], seed=21)
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            stub = verifier_pb2_grpc.VerifierStub(ch)
            before = (await stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)).steps

            async def later(i, prompt):
                await asyncio.sleep(0.04 * i)
                return await _generate(stub, prompt, 2, drafter=NONE)

            streams = await asyncio.gather(*(later(i, p) for i, p in enumerate(prompts)))
            after = (await stub.Stats(verifier_pb2.StatsRequest(), timeout=RPC_S)).steps
    finally:
        await server.stop(0)
    assert [_tokens(s) for s in streams] == [expected(p, 2) for p in prompts]
    if steps is not None:
        assert after - before == steps
    else:
        assert after - before > 2


@aio
async def test_warm_up_runs_on_the_thread_that_serves(target, expected, monkeypatch):
    """What the warm-up leaves per thread (torch's cuDNN attention plans) must be the serving
    steps': the warm-up runs on the engine thread, and a thread-local value it sets is seen
    by every step of a request served after it."""
    import threading

    import services.verifier.server as server_mod
    from specserve.engine.engine import Engine

    want = expected(REPETITIVE, 12)  # the oracle's steps before the spy
    local, seen, real_warm, real_step = threading.local(), [], server_mod.warm_up_engine, \
        Engine.step

    def warm(engine, rows):
        local.plans = "built"
        return real_warm(engine, rows)

    def step(self):
        seen.append((threading.current_thread().name, getattr(local, "plans", None)))
        return real_step(self)

    monkeypatch.setattr(server_mod, "warm_up_engine", warm)
    monkeypatch.setattr(Engine, "step", step)
    server, port = await serve(_config(target, warmup="on"))
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            events = await _generate(verifier_pb2_grpc.VerifierStub(ch), REPETITIVE, 12)
    finally:
        await server.stop(0)
    assert _tokens(events) == want
    assert len(seen) >= 12 and set(seen) == {("specserve-engine", "built")}


@aio
async def test_a_failed_warm_up_fails_the_start_and_ends_the_engine_thread(target, monkeypatch):
    import threading

    import services.verifier.server as server_mod

    def engines() -> int:
        return sum(t.name == "specserve-engine" and t.is_alive() for t in threading.enumerate())

    def warm(engine, rows):
        raise RuntimeError("no room for the warm-up")

    before = engines()
    monkeypatch.setattr(server_mod, "warm_up_engine", warm)
    with pytest.raises(RuntimeError, match="no room for the warm-up"):
        await serve(_config(target, warmup="on"))
    assert engines() == before
