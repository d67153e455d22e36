"""The HTTP API's `/tokenize`, `/detokenize` and `/v1/models/{id}` (in process, through the
front's ASGI app): the ids a completion's prompt or a chat's messages become — the ones a
generation sends — their text back, and 400 / 404 errors naming the field."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_http import OpenAIFront
from services.gateway.prompt_encoder import PromptEncoder
from specserve.chat_template import ChatTemplate
from specserve.demo import default_pair
from specserve.tokenizer import Tokenizer

TARGET, _ = default_pair()
pytestmark = [pytest.mark.asyncio,
              pytest.mark.skipif(TARGET is None, reason="the demo pair is not checked out")]


class Front:
    """What OpenAIFront uses of the pipeline for these routes: the tokenizer and its encoder
    (`worker`: with its worker process, which takes a long prompt and a large body's decode)."""

    def __init__(self, worker: bool = False) -> None:
        self.tokenizer = Tokenizer.from_dir(TARGET)
        self.prompts = PromptEncoder(self.tokenizer, TARGET if worker else None)
        self.metrics = None


async def _call(method: str, path: str, body=None, front=None) -> tuple[int, dict]:
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "headers": [(b"content-type", b"application/json")], "server": ("127.0.0.1", 80)}
    inbox, status, out = [{"type": "http.request", "body": raw, "more_body": False}], [], []

    async def receive():
        return inbox.pop(0)

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        else:
            out.append(message.get("body", b""))

    front = OpenAIFront(front or Front(), "demo-target", ChatTemplate.from_dir(TARGET))
    await front.app()(scope, receive, send)
    return status[0], json.loads(b"".join(out))


async def test_tokenize_gives_the_ids_a_generation_sends():
    tok = Tokenizer.from_dir(TARGET)
    status, body = await _call("POST", "/tokenize", {"prompt": "The cat sat on the mat.",
                                                      "return_token_strs": True})
    ids = tok.encode("The cat sat on the mat.")
    assert status == 200 and body == {"count": len(ids), "tokens": ids,
                                      "token_strs": [tok.decode([i]) for i in ids]}
    messages = [{"role": "user", "content": "Hi"}]
    status, body = await _call("POST", "/tokenize", {"messages": messages})
    text = ChatTemplate.from_dir(TARGET).render(messages, add_generation_prompt=True)
    assert status == 200 and body["tokens"] == tok.encode(text)
    status, body = await _call("POST", "/detokenize", {"tokens": ids, "model": "demo-target"})
    assert status == 200 and body == {"prompt": "The cat sat on the mat."}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": []}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "truncate": 3}, 400, "truncate"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
])
async def test_bad_bodies_name_their_field(path, body, status, param):
    got, answer = await _call("POST", path, body)
    assert got == status and answer["error"]["param"] == param


async def test_one_model_by_its_id():
    status, body = await _call("GET", "/v1/models/demo-target")
    assert status == 200 and body["id"] == "demo-target" and body["object"] == "model"
    status, body = await _call("GET", "/v1/models/gpt-4o")
    assert status == 404 and body["error"]["code"] == "model_not_found"



async def test_large_bodies_take_the_same_answers_off_the_event_loop():
    """Bodies over OFF_LOOP_BYTES are parsed in a thread and /detokenize's decode runs in the
    prompt worker process: the same text, the same 400 (its error crosses back whole)."""
    from services.gateway.openai_fields import OFF_LOOP_BYTES

    tok, front = Tokenizer.from_dir(TARGET), Front(worker=True)
    text = "The cat sat on the mat, and then it slept. " * (OFF_LOOP_BYTES // 40)
    try:
        status, got = await _call("POST", "/tokenize", {"prompt": text,
                                                        "return_token_strs": True}, front)
        ids = tok.encode(text)
        assert status == 200 and got["tokens"] == ids and got["count"] == len(ids) > 4096
        assert got["token_strs"][:9] == [tok.decode([i]) for i in ids[:9]]
        status, back = await _call("POST", "/detokenize", {"tokens": ids}, front)
        assert status == 200 and back == {"prompt": tok.decode(ids)}
        status, err = await _call("POST", "/detokenize", {"tokens": ids + [-3]}, front)
        assert status == 400 and err["error"]["param"] == "tokens"
        assert front.prompts._pool is not None  # the worker process did the long ones
    finally:
        front.prompts.close()
