"""Chat templates render exactly as transformers' `apply_chat_template` renders them (the
oracle): the demo pair's, a ChatML template with loop controls, `tojson`, special tokens and
`raise_exception`, a list of named templates, and a `chat_template.jinja` file; bad messages and
templates fail with clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specserve.chat_template import ChatTemplate, normalize_messages
from specserve.errors import InvalidRequest, ModelError
from tests.helpers import save_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CHATML = (
    "{%- set ns = namespace(first=true) -%}"
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}{{ raise_exception('no tools here') }}{%- endif -%}"
    "{%- if loop.index0 > 40 %}{% break %}{% endif -%}"
    "<|im_start|>{{ m.role }}{% if m.name is defined %} {{ m.name | tojson }}{% endif %}\n"
    "{{ m.content | trim }}<|im_end|>\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "  Be brief. "}, {"role": "user", "content": "多少?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "why\n", "name":
                                                  "ann \"a\""}],
]


def _model_dir(tmp_path: Path, config: dict, jinja: str | None = None) -> Path:
    (tmp_path / "m").mkdir(parents=True)
    root = save_tokenizer(tmp_path / "m")
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if jinja is not None:
        (root / "chat_template.jinja").write_text(jinja)
    return root


def _hf(root: Path, messages, add_generation_prompt: bool) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root)
    return tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("layout", ["string", "named-list", "jinja-file"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_renders_as_transformers(tmp_path, layout, add_generation_prompt):
    tokens = {"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>",
                                            "lstrip": False, "rstrip": False,
                                            "normalized": False, "single_word": False,
                                            "special": True}}
    config = {**tokens, "chat_template": CHATML} if layout == "string" else \
        {**tokens, "chat_template": [{"name": "tool_use", "template": "nope"},
                                     {"name": "default", "template": CHATML}]} \
        if layout == "named-list" else tokens
    root = _model_dir(tmp_path, config, CHATML if layout == "jinja-file" else None)
    template = ChatTemplate.from_dir(root)
    for messages in CONVERSATIONS:
        ours = template.render(normalize_messages(messages), add_generation_prompt)
        assert ours == _hf(root, messages, add_generation_prompt)
        assert ours.startswith("<s><|im_start|>")


def test_the_demo_pair_template_renders_as_transformers(tmp_path):
    root = tmp_path / "demo"
    shutil.copytree(ROOT / "checkpoints" / "demo-target", root,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    template = ChatTemplate.from_dir(root)
    for messages in CONVERSATIONS:
        assert template.render(normalize_messages(messages)) == _hf(root, messages, True)
    assert template.render([{"role": "user", "content": "Hi"}]) == "Q: Hi\nA:"


def test_text_parts_are_joined_and_bad_messages_refused(tmp_path):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert normalize_messages(parts) == [{"role": "user", "content": "a\nb"}]  # as vLLM
    for bad, why in [([], "non-empty list"), ([{"role": "wizard", "content": "x"}], "role"),
                     ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
                     ([{"role": "user", "content": 3}], "string or text parts")]:
        with pytest.raises(InvalidRequest, match=why):
            normalize_messages(bad)
    template = ChatTemplate.from_dir(_model_dir(tmp_path, {"chat_template": CHATML}))
    with pytest.raises(InvalidRequest, match="no tools here"):
        template.render([{"role": "tool", "content": "x"}])


def test_no_template_and_broken_templates(tmp_path):
    assert ChatTemplate.from_dir(_model_dir(tmp_path / "a", {})) is None
    broken = ChatTemplate.from_dir(_model_dir(tmp_path / "b", {"chat_template": "{% for %}"}))
    with pytest.raises(ModelError, match="does not compile"):
        broken.render([{"role": "user", "content": "x"}])
    with pytest.raises(ModelError, match="not a template string"):
        ChatTemplate.from_dir(_model_dir(tmp_path / "c", {"chat_template": 7}))


TOOLS = (  # a template that renders tool calls and their results, as Qwen3's does
    "{%- for m in messages -%}"
    "<{{ m.role }}>{{ m.content }}"
    "{%- if m.reasoning_content %}[think]{{ m.reasoning_content }}{% endif -%}"
    "{%- for c in m.tool_calls or [] %}[call {{ c.id }}] {{ c.function.name }}"
    "({{ c.function.arguments }}){% endfor -%}"
    "{%- if m.tool_call_id is defined %}[result of {{ m.tool_call_id }}]{% endif -%}"
    "{%- endfor %}")


def test_tool_calls_reach_the_template_and_unknown_fields_are_refused(tmp_path):
    """An assistant's tool calls and a tool result's id are rendered as transformers renders
    them (not dropped); fields a response echoes back are taken when empty; anything else is
    refused, naming it."""
    root = _model_dir(tmp_path, {"chat_template": TOOLS})
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None,
                 "reasoning_content": "look it up", "annotations": [], "audio": None},
                {"role": "tool", "content": "4 C", "tool_call_id": "c1"}]
    ours = ChatTemplate.from_dir(root).render(normalize_messages(messages), False)
    assert ours == _hf(root, messages, False) and "[call c1] weather(" in ours
    assert "[result of c1]" in ours and "[think]look it up" in ours
    for bad, why in [({"foo": 1}, r"messages\[0\]\.foo: not supported"),
                     ({"refusal": "no"}, r"messages\[0\]\.refusal: not supported"),
                     ({"tool_calls": "x"}, r"messages\[0\]\.tool_calls must be a list"),
                     ({"name": 3}, r"messages\[0\]\.name must be a str")]:
        with pytest.raises(InvalidRequest, match=why):
            normalize_messages([{"role": "assistant", "content": "x", **bad}])

