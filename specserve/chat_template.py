"""A checkpoint's chat template: messages → prompt text, rendered the way transformers'
`apply_chat_template` renders it (a sandboxed jinja2 environment with trim_blocks and
lstrip_blocks, loop controls, the `tojson` filter, `raise_exception` and `strftime_now`, and
the tokenizer's special tokens as variables).

The template comes from `chat_template.jinja` beside the tokenizer, else `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates: "default" is taken).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from specserve.errors import InvalidRequest, ModelError
from specserve.json_values import one_of

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                      "cls_token", "mask_token")
ROLES = ("system", "developer", "user", "assistant", "tool")


def _raise(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the jinja2 template
    special_tokens: tuple[tuple[str, str], ...] = ()  # ("eos_token", "<|im_end|>"), …

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The checkpoint's template, None when it has none. Raises ModelError if malformed."""
        root = Path(model_dir)
        config_path = root / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.exists() else {}
        except json.JSONDecodeError as e:
            raise ModelError(f"{config_path}: not JSON ({e})") from None
        source = (root / "chat_template.jinja").read_text(encoding="utf-8") \
            if (root / "chat_template.jinja").exists() else config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str) or not source.strip():
            raise ModelError(f"{config_path}: chat_template is not a template string")
        tokens = tuple((k, t) for k in SPECIAL_TOKEN_KEYS
                       if (t := _token_text(config.get(k))) is not None)
        return cls(source, tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text. Raises InvalidRequest for messages the template refuses."""
        import jinja2

        try:
            return _compiled(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                tools=None, documents=None, **dict(self.special_tokens))
        except jinja2.exceptions.TemplateError as e:
            raise InvalidRequest(f"the chat template refused the messages: {e}") from None


_CACHE: dict[str, object] = {}


def _compiled(source: str):
    """The jinja2 template of `source` (compiled once per process)."""
    if source not in _CACHE:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            _CACHE[source] = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ModelError(f"the chat template does not compile: {e}") from None
    return _CACHE[source]


# what a message may carry besides role and content, passed to the template as transformers
# passes it (a template that knows tool calls renders them)
_PASSED = {"name": str, "tool_call_id": str, "tool_calls": list, "reasoning_content": str}
# fields a client echoes back from a response's message: taken only when empty
_EMPTY = {"refusal": (None,), "annotations": (None, []), "audio": (None,),
          "function_call": (None,)}


def normalize_messages(messages) -> list[dict]:
    """OpenAI chat messages → [{"role", "content": str, …}, ...] (text parts joined by newlines,
    as vLLM does; `_PASSED` fields kept). Raises InvalidRequest for anything else: a field
    that would change the prompt is never dropped."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidRequest(f"messages[{i}]: a message is an object with a role in "
                                 f"{list(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
            content = "\n".join(p["text"] for p in content)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or text parts")
        out.append({"role": m["role"], "content": content, **_passed(m, i)})
    return out


def _passed(message: dict, i: int) -> dict:
    """The message's `_PASSED` fields; InvalidRequest for one of another type, or any other
    field that is not `_EMPTY`."""
    kept = {}
    for key, value in message.items():
        empty = _EMPTY.get(key, (None,) if key in _PASSED else ())
        if key in ("role", "content") or one_of(value, empty):
            continue
        if key not in _PASSED:
            raise InvalidRequest(f"messages[{i}].{key[:40]}: not supported by specserve")
        if not isinstance(value, _PASSED[key]):
            raise InvalidRequest(f"messages[{i}].{key} must be a {_PASSED[key].__name__}")
        kept[key] = value
    return kept
