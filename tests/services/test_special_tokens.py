"""A text prompt gets the tokenizer's special tokens (a Llama-style BOS), as transformers'
`tokenizer(text)` and vLLM's completions add them; a chat prompt does not (its template writes
its own); `add_special_tokens: false` turns them off — on HTTP completions and chat, /tokenize,
the gateway's gRPC `Generate` (the ids the verifier is sent) and the in-process engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from services.common.server import channel
from services.gateway import convert
from services.gateway.openai_api import parse
from services.gateway.prompt_encoder import PromptEncoder
from specserve.chat_template import ChatTemplate
from specserve.tokenizer import Tokenizer
from specserve.types import SamplingParams
from specserve.v1 import gateway_pb2_grpc
from tests.helpers import make_checkpoint, save_tokenizer
from tests.services.test_gateway_service import FakeVerifier, running_gateway, start_verifier
from tests.services.test_tokenize_api import _call

TEXT = "the cat sat on the mat"
TEMPLATE = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory) -> Path:
    """A byte-level tokenizer whose post-processor puts "<s>" before every text, as Llama's."""
    root = save_tokenizer(tmp_path_factory.mktemp("bos-model"))
    hf = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    hf.add_special_tokens(["<s>"])
    bos = hf.token_to_id("<s>")
    hf.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)])
    hf.save(str(root / "tokenizer.json"))
    return root


def _ids(root: Path, text: str = TEXT, special: bool = False) -> list[int]:
    hf = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    return hf.encode(text, add_special_tokens=special).ids


def test_the_fixture_adds_a_bos(bos_dir):
    plain, with_bos = _ids(bos_dir), _ids(bos_dir, special=True)
    assert with_bos[1:] == plain and with_bos[0] == Tokenizer.from_dir(bos_dir).token_to_id("<s>")


def test_completions_add_special_tokens_and_chat_does_not():
    def add(body, chat=False):
        prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": TEXT}
        return parse({"model": "m", **prompt, **body}, chat, "m", TEMPLATE).requests[0] \
            .add_special_tokens

    assert add({}) is True and add({"add_special_tokens": False}) is False
    assert add({}, chat=True) is False and add({"add_special_tokens": True}, chat=True) is True


class _Front:
    def __init__(self, root: Path) -> None:
        self.tokenizer = Tokenizer.from_dir(root)
        self.prompts = PromptEncoder(self.tokenizer, None)
        self.metrics = None


@pytest.mark.asyncio
async def test_tokenize_gives_the_ids_with_the_bos(bos_dir):
    front = _Front(bos_dir)
    status, body = await _call("POST", "/tokenize", {"prompt": TEXT}, front=front)
    assert status == 200 and body["tokens"] == _ids(bos_dir, special=True)
    status, body = await _call("POST", "/tokenize", {"prompt": TEXT, "add_special_tokens": False},
                               front=front)
    assert status == 200 and body["tokens"] == _ids(bos_dir)


@pytest.mark.asyncio
async def test_the_verifier_is_sent_the_bos_unless_the_request_says_not(bos_dir, tmp_path):
    fake = FakeVerifier()
    server, port, _ = await start_verifier(fake)
    try:
        async with running_gateway(tmp_path, model=str(bos_dir),
                                   verifier=f"127.0.0.1:{port}") as (address, _):
            for prompt, add in ((TEXT, None), (TEXT, False), (_ids(bos_dir)[:3], None)):
                async with channel(address) as ch:  # token ids: sent as they are
                    msgs = gateway_pb2_grpc.GatewayStub(ch).Generate(
                        convert.generate_request_to_pb(prompt, SamplingParams(max_tokens=3),
                                                       add_special_tokens=add), timeout=20)
                    assert [m async for m in msgs][-1].final.usage.completion_tokens == 3
    finally:
        await server.stop(None)
    sent = [list(r.prompt_ids) for r in fake.requests]
    assert sent == [_ids(bos_dir, special=True), _ids(bos_dir), _ids(bos_dir)[:3]]


def test_the_engine_generates_from_a_text_as_transformers_does(bos_dir, tmp_path, make_engine):
    """Greedy from a text prompt: the engine's tokens are transformers' generate() from
    `tokenizer(text)` (BOS included) on the same Llama checkpoint."""
    from transformers import PreTrainedTokenizerFast

    root = tmp_path / "llama-bos"
    _, model = make_checkpoint(root, "llama-linear-tied", vocab_size=320)
    (root / "tokenizer.json").write_bytes((bos_dir / "tokenizer.json").read_bytes())
    inputs = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"))(
        TEXT, return_tensors="pt")
    want = model.generate(**inputs, max_new_tokens=7, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    engine = make_engine(root)
    got = engine.generate([TEXT], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert inputs["input_ids"][0, 0] == Tokenizer.from_dir(root).token_to_id("<s>")
    assert got == want
