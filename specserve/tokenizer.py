"""Text <-> token ids: the tokenizer wrapper, streaming detokenization and stop-string matching.

This module owns everything the engine needs to turn a checkpoint's `tokenizer.json` into ids and
generated ids back into streamed text: loading the tokenizer and its EOS ids from a model
directory, decoding generated tokens incrementally without ever emitting half a UTF-8 character,
and holding back text that might turn out to be the start of a stop string. It uses the HF
`tokenizers` library only (never transformers).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from specserve.errors import InvalidRequest, ModelError

REPLACEMENT_CHAR = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's table), inverted: char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(moved)}}


_BYTE_OF = _byte_level_alphabet()
_PROMPT_CONTEXT = 5  # prompt tokens decoded as left context before the first generated token
_MAX_PENDING = 4  # held-back tokens after which we look for a token boundary to cut the window at
_MAX_CUT_SCAN = 8  # candidate boundaries examined per push when cutting


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A loaded `tokenizers.Tokenizer` plus the EOS ids the checkpoint declares."""

    backend: tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.backend, tokenizers.Tokenizer):
            raise ValueError(f"backend must be a tokenizers.Tokenizer, got {type(self.backend)}")
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"eos_token_ids must be a tuple, got {self.eos_token_ids!r}")
        for t in self.eos_token_ids:
            if not _is_int(t) or not 0 <= t < self.vocab_size:
                raise ValueError(f"eos token id {t!r} is outside the vocabulary")

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load `tokenizer.json` and the EOS ids of the optional config files in `model_dir`."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"tokenizer file not found: {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for unparsable files
            raise ModelError(f"cannot parse tokenizer file {path}: {e}") from e
        return cls(backend, _collect_eos_ids(Path(model_dir), backend))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequest(f"text to encode must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Decode `ids`; an id outside the vocabulary raises InvalidRequest."""
        ids = self.check_ids(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a byte-level BPE token may hold part of a UTF-8 character,
        which its decoded text shows as U+FFFD)."""
        piece = self.backend.id_to_token(self.check_ids([token_id])[0])
        if self._byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return self.decode([token_id]).encode()

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The special tokens' ids (those `skip_special_tokens` leaves out of the text)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items()
                         if t.special)

    @functools.cached_property
    def _byte_level(self) -> bool:
        return '"ByteLevel"' in json.dumps(json.loads(self.backend.to_str()).get("decoder"))

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        """Return `ids` as a list of ints, raising InvalidRequest if one is not a valid token id."""
        out = list(ids)
        plain = set(map(type, out)) == {int}  # protobuf's ids: every check below in C loops
        if out and (
            (not plain and not all(_is_int(i) for i in out))
            or min(out) < 0 or max(out) >= self.vocab_size
        ):
            bad = next(i for i in out if not _is_int(i) or not 0 <= i < self.vocab_size)
            raise InvalidRequest(f"token id {bad!r} is not in the vocabulary of {self.vocab_size}")
        return out if plain else [int(i) for i in out]


def _is_int(x: object) -> bool:
    return hasattr(x, "__index__") and not isinstance(x, bool)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelError(f"{path} must hold a JSON object")
    return data


def _collect_eos_ids(root: Path, backend: tokenizers.Tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and tokenizer_config.json, in that order."""
    found: list[int] = []
    vocab = backend.get_vocab_size(with_added_tokens=True)
    for name in ("generation_config.json", "config.json"):
        path = root / name
        value = (_read_json(path) or {}).get("eos_token_id")
        values = value if isinstance(value, list) else [] if value is None else [value]
        for t in values:
            if not _is_int(t) or not 0 <= t < vocab:
                raise ModelError(f"{path}: eos_token_id {t!r} is not in the vocabulary")
            found.append(int(t))
    path = root / "tokenizer_config.json"
    token = (_read_json(path) or {}).get("eos_token")
    if isinstance(token, dict):  # a serialized AddedToken
        token = token.get("content")
    if token is not None:
        tid = backend.token_to_id(token) if isinstance(token, str) else None
        if tid is None:
            raise ModelError(f"{path}: eos_token {token!r} is not in the vocabulary")
        found.append(tid)
    return tuple(dict.fromkeys(found))


class IncrementalDetokenizer:
    """Turns generated ids, pushed in any chunks, into text deltas that are never half a character.

    It decodes a small window of tokens: left context (the last prompt tokens, later the tokens
    before the previous emission point) plus the tokens not yet fully emitted, and emits what the
    window's text gained. Text ending in U+FFFD (a multi-byte character split across byte-level
    tokens) is held back until the character completes; `flush` releases it. For byte-level BPE,
    the deltas plus `flush()` concatenate to `tokenizer.decode(all generated ids)`. Each push costs
    O(window), where the window is the tokens since the last-but-one emission point.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = tokenizer.check_ids(prompt_ids[-_PROMPT_CONTEXT:])  # the window
        text = self._decode(self._ids)
        while text.endswith(REPLACEMENT_CHAR):  # a prompt ending inside a character: its
            self._ids.pop()  # bytes are not context (the output's are decoded as they come)
            text = self._decode(self._ids)
        self._read = len(self._ids)  # window index after the last clean (fully emitted) point
        self._done = len(text)  # window chars emitted or used as context

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the newly completed text (possibly empty)."""
        new = self._tok.check_ids(token_ids)
        if not new:
            return ""
        self._ids.extend(new)
        text = self._decode(self._ids)
        if not text.endswith(REPLACEMENT_CHAR):  # ends on a whole character: emit and slide
            delta = text[self._done :]
            self._slide(text)
            return delta
        stable = text.rstrip(REPLACEMENT_CHAR)  # whatever the tail becomes, this prefix stays
        delta = stable[self._done :]
        self._done = max(self._done, len(stable))
        if len(self._ids) - self._read > _MAX_PENDING:
            delta += self._cut(text)
        return delta

    def flush(self) -> str:
        """Release held-back text (a genuinely invalid byte sequence comes out as U+FFFD)."""
        text = self._decode(self._ids)
        delta = text[self._done :]
        self._slide(text)
        return delta

    def _slide(self, text: str) -> None:
        """`text` (the whole window's) is emitted; the tokens since the last clean point stay."""
        if self._read:
            del self._ids[: self._read]
            text = self._decode(self._ids)
        self._read = len(self._ids)
        self._done = len(text)

    def _cut(self, text: str) -> str:
        """Bound the window while the text keeps ending in U+FFFD (e.g. lone continuation bytes).

        A token boundary is safe to cut at when decoding both sides separately gives the same text
        as decoding them together: no character straddles it. The text before it is then final
        (U+FFFD included) and is returned; the window restarts at the boundary.
        """
        n = len(self._ids)
        for cut in range(n - 1, max(self._read, n - 1 - _MAX_CUT_SCAN), -1):
            head = self._decode(self._ids[:cut])
            if head + self._decode(self._ids[cut:]) != text:
                continue
            delta = head[self._done :]
            del self._ids[:cut]
            self._read = 0
            self._done = max(self._done - len(head), 0)
            return delta
        return ""


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back what could start one.

    A stop fires as soon as a stop string is complete: among matches, the one that ends first wins
    (the longest if several end together), so the result does not depend on how the text was split
    into deltas. The stop string itself is emitted only with `include` (vLLM's
    include_stop_str_in_output).
    """

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        if isinstance(stop, str):
            raise InvalidRequest("stop must be a sequence of strings, not a single string")
        stops = tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop strings must be non-empty strings, got {s!r}")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""
        self._stopped = False
        self._include = include

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string completed)."""
        if self._stopped:
            return "", True
        buf = self._held + delta
        match = self._first_match(buf)
        if match is not None:
            self._held = ""
            self._stopped = True
            return buf[:match[1] if self._include else match[0]], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release the held-back text when generation ends without a stop."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, int] | None:
        """(start, end) of the match that ends first (longest on ties), or None."""
        best: tuple[int, int] | None = None
        for s in self._stops:
            start = buf.find(s)
            if start >= 0:
                key = (start + len(s), start)
                best = key if best is None else min(best, key)
        return None if best is None else (best[1], best[0])

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self._stops), default=0)
        for k in range(min(len(buf), longest - 1), 0, -1):
            tail = buf[len(buf) - k :]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
