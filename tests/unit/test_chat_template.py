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
