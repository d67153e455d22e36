"""Fault, fuzz and load checks against the three services as real processes on 127.0.0.1 (CPU,
bounded): what one client or one failing process does never harms the other requests.

- a drafter killed with -9 mid-generation and started again: every in-flight request finishes
  exactly, no step of theirs stalls (no wait for a draft deadline), the verifier logs no
  "Future exception was never retrieved", and new requests speculate again;
- 64 concurrent clients beside a flood of malformed requests (random bytes, bad token ids,
  temperatures, budgets, stop lists): every good request equals the engine, every bad one gets
  INVALID_ARGUMENT (or RESOURCE_EXHAUSTED past the queue), and no KV page stays used.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import grpc
import pytest

from services.common.server import channel
from services.gateway import convert
from specserve.types import SamplingParams
from specserve.v1 import gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.e2e.test_services import ENV, VOCAB, Stack, checkpoints  # noqa: F401 (fixture)
from tests.helpers import hf_greedy_oracle, random_prompts

aio = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(240)
OK_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def stack(checkpoints, tmp_path_factory):  # noqa: F811
    tdir, ddir = map(str, checkpoints)
    s = Stack(tmp_path_factory.mktemp("reliability"), {**ENV, "SPECSERVE_KV_MEMORY_GB": "0.02"})
    cpu = ["--device", "cpu", "--dtype", "float32"]
    try:
        s.start("drafter", ["--model", tdir, "--draft-model", ddir, *cpu, "--drafter-pages",
                            "512"])
        s.start("verifier", ["--model", tdir, "--drafter", s.addr("drafter"), "--draft-model",
                             ddir, *cpu, "--max-draft-tokens", "16", "--default-budget", "8",
                             "--max-waiting", "256", "--keep-context", "on"])
        s.start("gateway", ["--verifier", s.addr("verifier"), "--model", tdir])
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def reference(checkpoints):  # noqa: F811
    """transformers' greedy tokens: the oracle."""
    return hf_greedy_oracle(checkpoints[0])


async def _generate(stub, prompt, max_tokens: int, arrivals: list | None = None,
                    drafter: str = "ngram") -> tuple[list[int], object]:
    req = convert.generate_request_to_pb(prompt, SamplingParams(max_tokens=max_tokens,
                                                                ignore_eos=True), drafter, 8)
    ids, final = [], None
    async for msg in stub.Generate(req, timeout=120):
        event = convert.response_from_pb(msg)
        if isinstance(event, convert.GatewayFinal):
            final = event
        else:
            ids += event[1].token_ids
            if arrivals is not None:
                arrivals.append(time.monotonic())
    return ids, final


async def _pages_back(stack: Stack, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    async with channel(stack.addr("verifier")) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        while True:
            stats = await stub.Stats(verifier_pb2.StatsRequest(), timeout=10)
            if stats.kv_pages_used == stats.kv_pages_reserved == 0:
                return
            assert time.monotonic() < deadline, f"pages still held: {stats}"
            await asyncio.sleep(0.05)


def _bad_requests(rng: random.Random) -> list:
    """(what, a GenerateRequest or raw bytes) that must each be refused alone."""
    good = convert.generate_request_to_pb([5, 6, 7], SamplingParams(max_tokens=4), "ngram", 4)
    out = [("bytes", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))))
           for _ in range(12)]
    for vocab_hit in (VOCAB, VOCAB + 17, 2**40):
        msg = type(good)()
        msg.CopyFrom(good)
        msg.token_ids.ids[:] = [1, vocab_hit, 2]
        out.append(("token out of vocabulary", msg))
    for temperature in (-1.0, float("nan"), float("inf")):
        msg = type(good)()
        msg.CopyFrom(good)
        msg.sampling.temperature = temperature
        out.append((f"temperature {temperature}", msg))
    msg = type(good)()
    msg.CopyFrom(good)
    msg.sampling.max_tokens = 0
    out.append(("max_tokens 0", msg))
    return out


async def _refused(ch, what: str, req) -> grpc.StatusCode:
    if isinstance(req, bytes):
        call = ch.unary_stream("/specserve.v1.Gateway/Generate")(req, timeout=30)
    else:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=30)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in call:
            pass
    assert err.value.code() in OK_CODES, (what, err.value.code(), err.value.details())
    assert "Traceback" not in err.value.details() and "127.0.0.1" not in err.value.details()
    return err.value.code()


@aio
async def test_64_clients_beside_a_flood_of_bad_requests(stack, reference):
    rng = random.Random(23)
    prompts = random_prompts(64, VOCAB - 1, [3, 17, 40, 9, 26, 61, 5, 33], seed=71)
    lengths = [rng.randrange(4, 40) for _ in prompts]
    kinds = ["ngram", "dflash", "none"]
    bad = _bad_requests(rng)
    async with channel(stack.addr("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        good = [_generate(stub, p, n, drafter=kinds[i % 3])
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        tiny = _generate(stub, prompts[0], 12, drafter="ngram")
        flood = [_refused(ch, what, req) for what, req in bad]
        results = await asyncio.gather(*good, tiny, *flood)
    for (ids, final), p, n in zip(results, prompts, lengths, strict=False):
        assert ids == reference(p, n) and final.completion_tokens == n
    assert Counter(results[len(prompts) + 1:])[grpc.StatusCode.INVALID_ARGUMENT] == len(bad)
    await _pages_back(stack)


@aio
async def test_drafter_kill9_and_restart_stalls_no_request(stack, reference):
    prompts = random_prompts(4, VOCAB - 1, [30, 12, 45, 21], seed=5)
    prompts = [p * 3 for p in prompts]
    arrivals: list[list[float]] = [[] for _ in prompts]
    async with channel(stack.addr("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        tasks = [asyncio.ensure_future(_generate(stub, p, 300, arrivals[i], drafter="dflash"))
                 for i, p in enumerate(prompts)]
        while min(len(a) for a in arrivals) < 5:
            await asyncio.sleep(0.01)
        stack.kill("drafter")
        down = time.monotonic()
        await asyncio.to_thread(stack.start, "drafter", port=stack.ports["drafter"])
        up = time.monotonic()  # the drafter was away this long (a process start: seconds)
        results = await asyncio.gather(*tasks)
        t0 = time.monotonic()
        while True:  # new requests speculate again once the verifier has reconnected
            ids, final = await _generate(stub, prompts[0], 40, drafter="dflash")
            if not final.stats.fallbacks or time.monotonic() - t0 > 20:
                break
    for (got, _), p in zip(results, prompts, strict=True):
        assert got == reference(p, 300)
    # every request kept committing while the drafter was away (none waited for it)
    assert all(any(down < t < up for t in times) for times in arrivals), (down, up)
    assert ids == reference(prompts[0], 40) and not final.stats.fallbacks
    assert "never retrieved" not in (stack.tmp / "verifier.log").read_text()
    await _pages_back(stack)
