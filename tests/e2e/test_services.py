"""The three services as real subprocesses, end to end.

drafter → verifier (--drafter) → gateway (--verifier), each on 127.0.0.1 port 0 with --port-file,
over a tiny random Qwen3 target with a byte-level BPE tokenizer.json (vocab = the model's) and a
DFlash drafter saved by the `dflash` package. Generations streamed through the gateway must be
exactly transformers' greedy tokens and text, in every drafter mode, with 8 concurrent
clients; kill -9 of the drafter mid-generation changes no output and speculation resumes once it
is back; a client cancel or a stop string frees the verifier's KV pages; bad requests fail with
a clear status while the services keep serving; reflection, `specserve generate` and
`specserve up` work against real processes. The processes start once per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from services.common.server import channel, wait_serving
from services.gateway import convert
from specserve.types import FinishReason, SamplingParams
from specserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from tests.helpers import hf_config, hf_greedy_oracle, random_prompts

ROOT = Path(__file__).resolve().parents[2]
VOCAB, LAYERS, NEW, RPC_S = 320, 4, 48, 60.0
REPETITIVE = [11, 12, 13, 14, 15, 16, 17, 18] * 6
ENV = {**os.environ, "GRPC_VERBOSITY": "ERROR", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "SPECSERVE_KV_MEMORY_GB": "0.05",
       "SPECSERVE_GATEWAY_METRICS_PORT": "0", "SPECSERVE_VERIFIER_METRICS_PORT": "0",
       "SPECSERVE_DRAFTER_METRICS_PORT": "0", "SPECSERVE_GATEWAY_HTTP_PORT": "0"}
aio = pytest.mark.asyncio(loop_scope="module")
pytestmark = pytest.mark.timeout(180)


def _save_tokenizer(root: Path) -> None:
    """A byte-level BPE with exactly VOCAB ids (padded with added tokens if training stops
    short), so every id the model can produce decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.unit.test_tokenizer import CORPUS

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    hf.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(
        vocab_size=VOCAB, show_progress=False, initial_alphabet=alphabet))
    missing = VOCAB - hf.get_vocab_size()
    hf.add_tokens([f"<extra_{i}>" for i in range(missing)])
    assert hf.get_vocab_size() == VOCAB
    hf.save(str(root / "tokenizer.json"))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    import transformers
    from dflash.model import DFlashDraftModel

    tdir, ddir = tmp_path_factory.mktemp("e2e-target"), tmp_path_factory.mktemp("e2e-draft")
    torch.manual_seed(7)
    transformers.Qwen3ForCausalLM(hf_config(
        "qwen3-gqa4-yarn", vocab_size=VOCAB, num_hidden_layers=LAYERS,
        initializer_range=0.2)).save_pretrained(tdir)
    _save_tokenizer(tdir)
    cfg = hf_config("qwen3-gqa4-yarn", vocab_size=VOCAB, num_hidden_layers=2,
                    initializer_range=0.2)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size, cfg.num_target_layers = 16, LAYERS
    cfg.dflash_config = {"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1}
    torch.manual_seed(8)
    DFlashDraftModel(cfg).save_pretrained(ddir)
    return tdir, ddir


@pytest.fixture(scope="session")
def tokenizer(checkpoints):
    from specserve.tokenizer import Tokenizer

    return Tokenizer.from_dir(checkpoints[0])


@pytest.fixture(scope="session")
def prompts() -> list[str | list[int]]:
    ids = [p + p[:9] for p in random_prompts(4, VOCAB - 1, [21, 6, 35, 13], seed=41)]
    texts = ["The quick brown fox", "Speculative decoding drafts several tokens and",
             "我们今天学习", "def fibonacci(n: int) -> list[int]:\n"]
    return [*ids, *texts]


@pytest.fixture(scope="session")
def expected(checkpoints, prompts) -> list[list[int]]:
    """transformers' greedy tokens (the oracle the services must match); text prompts are
    encoded by the served tokenizer."""
    from specserve.tokenizer import Tokenizer

    greedy, tok = hf_greedy_oracle(checkpoints[0]), Tokenizer.from_dir(checkpoints[0])
    return [greedy(tok.encode(p) if isinstance(p, str) else p, NEW) for p in prompts]


class Stack:
    """Service subprocesses; each is up once it has written its port file (after SERVING)."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.tmp, self.procs, self.ports, self.flags = tmp, {}, {}, {}
        self.env = ENV if env is None else env

    def start(self, name: str, flags: list[str] | None = None, port: int = 0) -> None:
        self.flags[name] = flags = self.flags[name] if flags is None else flags
        port_file = self.tmp / f"{name}.port"
        port_file.unlink(missing_ok=True)
        with open(self.tmp / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}", "--host", "127.0.0.1", "--port",
                 str(port), "--port-file", str(port_file), *flags],
                stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        self.procs[name] = proc
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{self.log(name)}"
            assert time.monotonic() < deadline, f"{name} not up in 120 s:\n{self.log(name)}"
            time.sleep(0.05)
        self.ports[name] = int(port_file.read_text())

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-4000:]

    def kill(self, name: str) -> None:
        self.procs[name].kill()  # SIGKILL: no goodbye to anyone
        self.procs[name].wait(10)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def close(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


@pytest.fixture(scope="session")
def stack(checkpoints, tmp_path_factory):
    tdir, ddir = map(str, checkpoints)
    tmp = tmp_path_factory.mktemp("e2e-stack")
    # spans go to JSON-lines files (the demo's local trace store); test_probe reads them
    s = Stack(tmp, {**ENV, "SPECSERVE_TRACE_DIR": str(tmp / "traces"),
                    "OTEL_BSP_SCHEDULE_DELAY": "100"})
    cpu = ["--device", "cpu", "--dtype", "float32"]
    try:
        s.start("drafter", ["--model", tdir, "--draft-model", ddir, *cpu, "--drafter-pages", "512"])
        s.start("verifier", ["--model", tdir, "--drafter", s.addr("drafter"), "--draft-model",
                             ddir, *cpu, "--max-draft-tokens", "32", "--default-budget", "8"])
        s.start("gateway", ["--verifier", s.addr("verifier"), "--model", tdir,
                            "--max-message-mb", "1"])
        yield s
    finally:
        s.close()


@dataclass
class Result:
    text: str
    ids: list[int]
    steps: list[convert.Step]
    final: convert.GatewayFinal


async def _generate(stub, prompt, max_tokens: int = NEW, drafter: str | None = None,
                    budget: int | None = 8, stop: tuple[str, ...] = (), on_chunk=None) -> Result:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop)
    req = convert.generate_request_to_pb(prompt, params, drafter, budget)
    text, steps, final = [], [], None
    async for msg in stub.Generate(req, timeout=RPC_S):
        event = convert.response_from_pb(msg)
        if isinstance(event, convert.GatewayFinal):
            final = event
            continue
        text.append(event[0])
        steps.append(event[1])
        if on_chunk is not None:
            on_chunk()
    assert final is not None
    return Result("".join(text), [t for s in steps for t in s.token_ids], steps, final)


async def _pages_used(stack: Stack) -> int:
    async with channel(stack.addr("verifier")) as ch:
        reply = await verifier_pb2_grpc.VerifierStub(ch).Stats(verifier_pb2.StatsRequest(),
                                                                timeout=10)
    return reply.kv_pages_used


async def _until_pages(stack: Stack, pages: int, within_s: float) -> float:
    t0 = time.monotonic()
    while (used := await _pages_used(stack)) != pages:
        assert time.monotonic() - t0 < within_s, f"{used} KV pages in use, expected {pages}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


@aio
@pytest.mark.parametrize("mode", ["dflash", "ngram", "none"])
async def test_streams_equal_the_engine_with_8_clients(stack, prompts, expected, tokenizer, mode):
    async with channel(stack.addr("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        results = await asyncio.gather(*(_generate(stub, p, drafter=mode) for p in prompts))
    for r, want, prompt in zip(results, expected, prompts, strict=True):
        assert r.ids == want
        assert r.text == tokenizer.decode(want)
        f = r.final
        assert f.finish_reason is FinishReason.LENGTH and f.completion_tokens == NEW
        n_prompt = len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        assert f.prompt_tokens == n_prompt
        assert 0 < f.ttft_s <= f.wall_s
        assert all(len(s.token_ids) <= s.commit_len for s in r.steps)
        steps = [s for s in r.steps[1:] if s.token_ids]  # the first chunk: prefill's token
        assert f.stats.steps == len(steps)
        assert f.stats.committed_tokens == sum(s.commit_len for s in steps) == NEW - 1
        assert not f.stats.fallbacks, f.stats.fallbacks  # the drafter is healthy
    stats = [r.final.stats for r in results]
    if mode == "none":
        assert all(s.commit_len == 1 for r in results for s in r.steps if s.token_ids)
        assert sum(s.draft_tokens for s in stats) == 0
    else:
        assert sum(s.draft_tokens for s in stats) > 0
    assert await _pages_used(stack) == 0


@aio
async def test_stop_string_ends_the_stream_and_frees_the_request(stack, prompts, expected,
                                                                 tokenizer):
    full = tokenizer.decode(expected[4])
    cut = next(i for i in range(len(full) // 3, len(full) - 3)
               if "\ufffd" not in full[i:i + 3] and full.index(full[i:i + 3]) == i)
    async with channel(stack.addr("gateway")) as ch:
        r = await _generate(gateway_pb2_grpc.GatewayStub(ch), prompts[4], drafter="dflash",
                            stop=(full[cut:cut + 3],))
    assert r.text == full[:cut]
    assert r.final.finish_reason is FinishReason.STOP
    assert r.ids == expected[4][: len(r.ids)] and len(r.ids) < NEW
    assert r.final.completion_tokens == len(r.ids)  # up to the token that completed the stop
    assert r.final.stats.committed_tokens >= len(r.ids) - 1  # what the verifier committed
    await _until_pages(stack, 0, within_s=1.0)


@aio
async def test_logprobs_through_the_services_equal_the_engines(stack, checkpoints, prompts):
    """Each token's logprob and its 3 best alternatives, streamed through the three services
    (DFlash steps of several tokens), equal the in-process engine's (which
    tests/unit/test_logprobs.py holds to transformers)."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    engine = Engine(EngineConfig(str(checkpoints[0])))
    engine.add_request("r", prompts[5], params)
    outs = [o for _ in range(NEW) if engine.has_unfinished for o in engine.step()]
    want = [(t, lp) for o in outs for t, lp in zip(o.new_token_ids, o.logprobs, strict=True)]
    async with channel(stack.addr("gateway")) as ch:
        req = convert.generate_request_to_pb(prompts[5], params, "dflash", 8)
        chunks = [m.chunk async for m in gateway_pb2_grpc.GatewayStub(ch).Generate(
            req, timeout=RPC_S) if m.WhichOneof("event") == "chunk"]
    got = [(t, lp) for c in chunks for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
    assert [t for t, _ in got] == [t for t, _ in want] and len(got) == NEW
    prompt_lps = outs[0].prompt_logprobs  # the first chunk's, the same as the engine's
    assert len(chunks[0].prompt_logprobs) == len(prompt_lps) > 0
    assert all(abs(g.logprob - w.logprob) < 1e-4 and list(g.top_ids) == list(w.top_ids)
               for g, w in zip(chunks[0].prompt_logprobs, prompt_lps, strict=True))
    assert not any(c.prompt_logprobs for c in chunks[1:])
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert abs(g.logprob - w.logprob) < 1e-4 and list(g.top_ids) == list(w.top_ids)
        assert max(abs(a - b) for a, b in zip(g.top_logprobs, w.top_logprobs, strict=True)) < 1e-4


@aio
async def test_client_cancel_frees_the_verifier_pages_within_1s(stack, prompts):
    base = await _pages_used(stack)
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    async with channel(stack.addr("gateway")) as ch:
        call = gateway_pb2_grpc.GatewayStub(ch).Generate(
            convert.generate_request_to_pb(prompts[0], params, "dflash", 8), timeout=RPC_S)
        for _ in range(3):
            assert (await call.read()).WhichOneof("event") == "chunk"
        assert await _pages_used(stack) > base
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await _until_pages(stack, base, within_s=1.0)


BAD_REQUESTS = {
    "empty prompt": (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    # it would travel in every drafter message of the request (a 1 MB one blocked the lane)
    "request id of 100k characters": (dict(text="hi", request_id="r" * 100_000),
                           grpc.StatusCode.INVALID_ARGUMENT, "at most 256 are allowed"),
    "prompt too long": (dict(token_ids=gateway_pb2.TokenIds(ids=[5] * 600)),
                        grpc.StatusCode.INVALID_ARGUMENT, "context"),
    "token out of vocab": (dict(token_ids=gateway_pb2.TokenIds(ids=[5, VOCAB + 3])),
                           grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    "max_tokens 0": (dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)),
                     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    "negative temperature": (dict(text="hi", sampling=common_pb2.SamplingParams(
        max_tokens=4, temperature=-1.0)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "top_p 0": (dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=4, top_p=0.0)),
                grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "unknown drafter": (dict(text="hi", spec=common_pb2.SpecOptions(drafter=42)),
                        grpc.StatusCode.INVALID_ARGUMENT, "unknown drafter kind 42"),
    "message over 1 MiB": (dict(text="x" * (2 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                           "larger than max"),
}


@aio
async def test_bad_requests_fail_clearly_and_the_services_keep_serving(stack, prompts, expected):
    async with channel(stack.addr("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        for case, (fields, code, words) in BAD_REQUESTS.items():
            fields.setdefault("sampling", common_pb2.SamplingParams(max_tokens=4))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(gateway_pb2.GenerateRequest(**fields),
                                             timeout=RPC_S):
                    pass
            assert err.value.code() == code, case
            assert words in err.value.details(), (case, err.value.details())
        r = await _generate(stub, prompts[1], max_tokens=8)
    assert r.ids == expected[1][:8] and stack.alive()


def test_health_and_reflection_list_the_services(stack):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    for name in ("gateway", "verifier", "drafter"):
        service = f"specserve.v1.{name.capitalize()}"
        asyncio.run(wait_serving(stack.addr(name), service, timeout_s=10))
        with grpc.insecure_channel(stack.addr(name)) as ch:
            db = ProtoReflectionDescriptorDatabase(ch)
            listed = set(db.get_services())
            assert {service, "grpc.health.v1.Health",
                    "grpc.reflection.v1alpha.ServerReflection"} <= listed, listed
            assert db.FindFileContainingSymbol(service).package == "specserve.v1"


def test_the_cpu_services_take_turns_on_half_the_cores_each(stack):
    """--threads auto on the CPU: the drafter takes half the cores, the verifier half for steps
    that only verify and all of them for steps that carry prompt tokens (its log says so)."""
    cores = len(os.sched_getaffinity(0))
    half = max(1, cores // 2)
    logs = {n: (stack.tmp / f"{n}.log").read_text(errors="replace") for n in ("drafter",
                                                                               "verifier")}
    assert f"torch CPU threads: {half} (--threads auto)" in logs["drafter"]
    extra = f", {cores} for steps that carry prompt tokens" if half < cores else ""
    assert f"torch CPU threads: {half}{extra} (--threads auto)" in logs["verifier"]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=timeout)


def test_cli_generate(stack, prompts, expected, tokenizer):
    ids = ",".join(map(str, prompts[0]))
    out = _cli("generate", "--gateway", stack.addr("gateway"), "--token-ids", ids,
               "--max-tokens", "16", "--ignore-eos", "--drafter", "ngram", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["token_ids"] == expected[0][:16] and data["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": len(prompts[0]), "completion_tokens": 16}
    assert data["stats"]["steps"] > 0 and data["text"] == tokenizer.decode(expected[0][:16])
    assert len(data["trace_id"]) == 32 and int(data["trace_id"], 16)  # spans are exported
    steps = data["steps"]  # one per verifier step: the prompt's token, then the spec steps
    assert len(steps) == data["stats"]["steps"] + 1 and steps[0]["ms"] is None
    assert sum(s["tokens"] for s in steps) == 16 and all(s["ms"] > 0 for s in steps[1:])
    assert sum(s["tree_size"] for s in steps) == data["stats"]["draft_tokens"]
    assert sum(s["accepted_depth"] for s in steps) == data["stats"]["accepted_tokens"]
    assert {s["shape"] for s in steps} == {""}  # the verifier is not adaptive here
    out = _cli("generate", "--gateway", stack.addr("gateway"), "--prompt", prompts[4],
               "--max-tokens", "8", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == tokenizer.decode(expected[4][:8])
    for words in ("8 tokens", "TTFT", "mean commit_len", "steps", "fallbacks", "finish: length",
                  "[trace "):
        assert words in out.stderr, out.stderr
    out = _cli("generate", "--gateway", stack.addr("gateway"), "--token-ids", f"1,{VOCAB + 9}")
    assert out.returncode == 2 and "INVALID_ARGUMENT" in out.stderr and "vocabulary" in out.stderr


# ---- the drafter dies and comes back (these change the stack: they run last) ----------------
@aio
async def test_drafter_kill9_mid_generation_changes_no_output(stack, prompts, expected):
    started = asyncio.Event()
    seen = Counter()

    def on_chunk():
        seen["chunks"] += 1
        if seen["chunks"] >= 2 * len(prompts):
            started.set()

    async with channel(stack.addr("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        tasks = [asyncio.ensure_future(_generate(stub, p, drafter="dflash", on_chunk=on_chunk))
                 for p in prompts]
        await asyncio.wait_for(started.wait(), RPC_S)
        stack.kill("drafter")
        results = await asyncio.gather(*tasks)
    assert [r.ids for r in results] == expected
    assert all(r.final.finish_reason is FinishReason.LENGTH for r in results)
    fallbacks = sum((Counter(r.final.stats.fallbacks) for r in results), Counter())
    assert sum(fallbacks.values()) > 0, "every request had finished before the kill"
    assert stack.procs["verifier"].poll() is None and stack.procs["gateway"].poll() is None


@aio
async def test_speculation_resumes_after_the_drafter_restarts(stack, expected):
    if stack.procs["drafter"].poll() is None:  # run alone: kill it here
        stack.kill("drafter")
    async with channel(stack.addr("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        down = await _generate(stub, REPETITIVE, max_tokens=24, drafter="ngram")
        assert down.final.stats.fallbacks and all(s.commit_len == 1 for s in down.steps)
        await asyncio.to_thread(stack.start, "drafter", port=stack.ports["drafter"])
        t0 = time.monotonic()
        while True:  # the verifier reconnects in the background
            up = await _generate(stub, REPETITIVE, max_tokens=24, drafter="ngram")
            if not up.final.stats.fallbacks or time.monotonic() - t0 > 20:
                break
            await asyncio.sleep(0.2)
    assert up.ids == down.ids
    assert not up.final.stats.fallbacks
    assert max(up.final.stats.commit_len_hist) > 1 and up.final.stats.mean_commit_len > 1


@aio
async def test_gateway_survives_the_verifier_dying(stack, prompts, expected):
    async with channel(stack.addr("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        call = stub.Generate(convert.generate_request_to_pb(
            prompts[0], SamplingParams(max_tokens=400, ignore_eos=True)), timeout=RPC_S)
        await call.read()
        stack.kill("verifier")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(stub, prompts[1], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stack.procs["gateway"].poll() is None
        await asyncio.to_thread(stack.start, "verifier", port=stack.ports["verifier"])
        r = await _generate(stub, prompts[1], max_tokens=8)
    assert r.ids == expected[1][:8]


@aio
async def test_gateway_sigterm_drains_in_flight_requests(stack, prompts, expected):
    started, chunks = asyncio.Event(), Counter()

    def on_chunk():
        chunks["n"] += 1
        started.set()

    async with channel(stack.addr("gateway")) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        task = asyncio.ensure_future(_generate(stub, prompts[2], on_chunk=on_chunk))
        await asyncio.wait_for(started.wait(), RPC_S)
        stack.procs["gateway"].terminate()
        at_sigterm = chunks["n"]
        r = await task
        assert await asyncio.to_thread(stack.procs["gateway"].wait, 10) == 0
    assert r.ids == expected[2] and r.final.finish_reason is FinishReason.LENGTH
    assert at_sigterm < len(r.steps)  # chunks kept coming after SIGTERM
    await asyncio.to_thread(stack.start, "gateway", port=stack.ports["gateway"])


# ---- specserve up ---------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_up_restarts_a_dead_drafter_and_stops_on_sigterm(checkpoints, expected, prompts):
    tdir, ddir = map(str, checkpoints)
    g, v, d = _free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--model", tdir, "--draft-model", ddir,
         "--device", "cpu", "--gateway-port", str(g), "--verifier-port", str(v),
         "--drafter-port", str(d)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT)
    lines, pids = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "(pid " in line:
                pids.append(int(line.rsplit("(pid ", 1)[1].rstrip(")\n")))
            if line.startswith("specserve up: ready") or proc.poll() is not None:
                break
        assert len(pids) == 3, "".join(lines)
        assert any(line.startswith("[drafter ] specserve drafter listening") for line in lines)

        async def one():
            async with channel(f"127.0.0.1:{g}") as ch:
                return await _generate(gateway_pb2_grpc.GatewayStub(ch), prompts[0],
                                       max_tokens=8)

        assert asyncio.run(one()).ids == expected[0][:8]
        os.kill(pids[0], signal.SIGKILL)  # the drafter dies: up starts it again, alone
        for line in proc.stdout:
            lines.append(line)
            if "drafter SERVING again" in line or proc.poll() is not None:
                break
        assert "specserve up: drafter exited with code -9\n" in lines, "".join(lines)
        assert "specserve up: drafter SERVING again (pid " in lines[-1], "".join(lines)
        pids.append(int(lines[-1].rsplit("(pid ", 1)[1].rstrip(")\n")))
        assert all(os.kill(pid, 0) is None for pid in pids[1:])  # the others kept serving
        assert asyncio.run(one()).ids == expected[0][:8]
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
        assert "specserve up: stopping" in rest
        for pid in pids:  # every service was stopped and reaped, the dead drafter too
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        for pid in [*pids, proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


def test_up_exits_nonzero_when_a_service_dies(tmp_path):
    g, v, d = _free_ports(3)
    broken = tmp_path / "broken"  # a config.json `up` accepts, no model a service can load
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    out = _cli("up", "--model", str(broken), "--device", "cpu", "--gateway-port",
               str(g), "--verifier-port", str(v), "--drafter-port", str(d), timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "exited with code" in out.stderr
    missing = _cli("up", "--model", str(tmp_path / "missing"), "--gateway-port", str(g),
                   timeout=60)  # no model directory at all: refused before anything starts
    assert missing.returncode == 2 and "is not a model directory" in missing.stderr
    assert "SERVING" not in missing.stdout
