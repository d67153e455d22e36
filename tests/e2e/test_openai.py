"""The OpenAI HTTP front against the three real services, through the real `openai` package
and `curl -N`: greedy completions (whole and streamed) give the in-process engine's tokens, chat
renders the checkpoint's template as transformers does, each response carries its speculative
stats and trace id, and a client that drops the stream frees the request's KV pages."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import time

import openai
import pytest

from services.common.server import channel
from specserve.types import SamplingParams
from specserve.v1 import verifier_pb2, verifier_pb2_grpc
from tests.e2e.test_services import (  # noqa: F401 (fixtures)
    ENV,
    NEW,
    Stack,
    checkpoints,
    expected,
    prompts,
    tokenizer,
)

pytestmark = pytest.mark.timeout(180)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def api(checkpoints, tmp_path_factory):  # noqa: F811
    """(the stack, the HTTP port, the gateway's model dir: the tokenizer + a chat template)."""
    tdir, ddir = map(str, checkpoints)
    tmp = tmp_path_factory.mktemp("openai-stack")
    gdir = tmp / "gateway-model"
    gdir.mkdir()
    shutil.copy(checkpoints[0] / "tokenizer.json", gdir)
    (gdir / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    s = Stack(tmp, {**ENV, "SPECSERVE_TRACE_DIR": str(tmp / "traces"),
                    "OTEL_BSP_SCHEDULE_DELAY": "100"})
    cpu = ["--device", "cpu", "--dtype", "float32"]
    try:
        s.start("drafter", ["--model", tdir, "--draft-model", ddir, *cpu])
        s.start("verifier", ["--model", tdir, "--drafter", s.addr("drafter"), "--draft-model",
                             ddir, *cpu, "--max-draft-tokens", "32", "--default-budget", "8"])
        s.start("gateway", ["--verifier", s.addr("verifier"), "--model", str(gdir),
                            "--served-model-name", MODEL, "--http-port-file",
                            str(tmp / "http.port")])
        yield s, int((tmp / "http.port").read_text()), gdir
    finally:
        s.close()


def _client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{api[1]}/v1", api_key="unused",
                         max_retries=0, timeout=60)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True, "budget": 8}}


def test_completions_whole_and_streamed_equal_the_engine(api, prompts, expected,  # noqa: F811
                                                         tokenizer):  # noqa: F811
    client = _client(api)
    for i in (0, 4):  # token ids, then text
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompts[i], max_tokens=NEW, **GREEDY)
        whole = raw.parse()
        assert whole.choices[0].text == tokenizer.decode(expected[i])
        assert whole.choices[0].finish_reason == "length" and whole.model == MODEL
        assert whole.usage.completion_tokens == NEW
        assert whole.usage.prompt_tokens == len(tokenizer.encode(prompts[i])
                                                if isinstance(prompts[i], str) else prompts[i])
        spec = whole.model_extra["speculative_decoding"]
        assert spec["steps"] > 0 and spec["mean_acceptance_length"] >= 1
        assert sum(spec["acceptance_length_histogram"].values()) == spec["steps"]
        assert len(raw.headers["x-specserve-trace-id"]) == 32
        two = client.completions.with_raw_response.create(  # a trace per choice: both named
            model=MODEL, prompt=prompts[i], max_tokens=2, n=2, **GREEDY).headers
        ids = two["x-specserve-trace-id"].split(",")
        assert len(ids) == len(set(ids)) == 2 and all(len(t) == 32 for t in ids)
        chunks = list(client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=NEW, stream=True,
            stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishing) == 1 and "speculative_decoding" in finishing[0].model_extra
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW


def test_chat_renders_the_template_as_transformers(api, checkpoints):  # noqa: F811
    from transformers import AutoTokenizer

    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Speculative decoding drafts"}]
    prompt = AutoTokenizer.from_pretrained(api[2]).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    engine = Engine(EngineConfig(str(checkpoints[0])))
    (want,) = engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))
    client = _client(api)
    reply = client.chat.completions.create(model=MODEL, messages=messages,
                                           max_completion_tokens=20, **GREEDY)
    assert reply.choices[0].message.content == engine.tokenizer.decode(want)
    assert reply.choices[0].message.role == "assistant" and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    streamed = client.chat.completions.create(model=MODEL, messages=messages,
                                              max_completion_tokens=20, stream=True, **GREEDY)
    deltas = [c.choices[0].delta for c in streamed]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == reply.choices[0].message.content
    two = client.chat.completions.create(model=MODEL, messages=messages, n=2,
                                         max_completion_tokens=20, **GREEDY)
    assert [c.message.content for c in two.choices] == [reply.choices[0].message.content] * 2
    assert two.usage.prompt_tokens == reply.usage.prompt_tokens  # the prompt counted once
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", n=2, best_of=3)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=messages)


def test_logprobs_and_echo_equal_the_engines(api, checkpoints, prompts):  # noqa: F811
    """Through the openai client: each generated token's logprob and best alternatives, and
    with `echo` and max_tokens 0 the prompt's (the first one null), equal the in-process
    engine's (tests/unit/test_logprobs.py holds those to transformers)."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    engine = Engine(EngineConfig(str(checkpoints[0])))
    engine.add_request("r", prompts[4], SamplingParams(max_tokens=12, ignore_eos=True,
                                                       logprobs=2, prompt_logprobs=2))
    outs = [o for _ in range(20) if engine.has_unfinished for o in engine.step()]
    gen = [t for o in outs for t in o.logprobs]
    client = _client(api)
    whole = client.completions.create(model=MODEL, prompt=prompts[4], max_tokens=12, logprobs=2,
                                      **GREEDY).choices[0].logprobs
    assert whole.token_logprobs == pytest.approx([t.logprob for t in gen], abs=1e-4)
    for token, lp, top in zip(whole.tokens, whole.token_logprobs, whole.top_logprobs,
                              strict=True):  # greedy: the chosen token is the best
        assert 1 <= len(top) <= 2 and top[token] == lp == max(top.values())  # (keyed by text)
    scored = client.completions.create(model=MODEL, prompt=prompts[4], max_tokens=0, echo=True,
                                       logprobs=2, **GREEDY)
    choice = scored.choices[0]
    assert choice.text == prompts[4] and scored.usage.completion_tokens == 0
    want = [None, *(t.logprob for t in outs[0].prompt_logprobs)]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    assert "".join(choice.logprobs.tokens) == prompts[4]


def test_curl_streams_sse(api, prompts, expected, tokenizer):  # noqa: F811
    if shutil.which("curl") is None:
        pytest.fail("curl is needed for this test (the README's example uses it)")
    body = {"model": MODEL, "prompt": prompts[4], "max_tokens": 16, "stream": True,
            "temperature": 0, "ignore_eos": True}
    out = subprocess.run(
        ["curl", "-sN", f"http://127.0.0.1:{api[1]}/v1/completions", "-H",
         "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line.removeprefix("data: ") for line in out.split("\n\n") if line]
    assert events[-1] == "[DONE]" and all(line.startswith("data: ")
                                          for line in out.strip().split("\n\n"))
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(expected[4][:16])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _stats(stack: Stack) -> verifier_pb2.StatsReply:
    import asyncio

    async def ask():
        async with channel(stack.addr("verifier")) as ch:
            return await verifier_pb2_grpc.VerifierStub(ch).Stats(verifier_pb2.StatsRequest(),
                                                                   timeout=10)
    return asyncio.run(ask())


def test_dropping_the_stream_frees_the_pages(api, prompts):  # noqa: F811
    stack, port, _ = api
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": prompts[1], "max_tokens": 400, "stream": True,
         "ignore_eos": True}), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    assert _stats(stack).kv_pages_used > 0  # the request holds pages while it streams
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 10
    while (s := _stats(stack)).kv_pages_used or s.active_requests:
        assert time.monotonic() < deadline, f"{s.kv_pages_used} pages still used"
        time.sleep(0.05)
    assert stack.alive()  # and they still serve
    assert _client(api).completions.create(model=MODEL, prompt="ok",
                                           max_tokens=2).usage.completion_tokens == 2
