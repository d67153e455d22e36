"""Tests for specserve.tokenizer: loading, incremental detokenization, stop strings."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from specserve.errors import InvalidRequest, ModelError
from specserve.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

FFFD = "\ufffd"
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|pad|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!",
    "Speculative decoding drafts several tokens and verifies them with one forward pass.",
    "In 1969, 3 astronauts flew 384,400 km; the mission lasted 8 days, 3 hours and 18 minutes.",
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n",
    "for (int i = 0; i < n; ++i) { sum += v[i] * w[i]; }  // dot product\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 21 GROUP BY name ORDER BY 2 DESC;",
    '{"model": "specserve", "max_tokens": 128, "stop": ["\\n\\n", "</s>"]}',
    "我们今天学习中文。这是一个用于测试分词器的句子，包含标点符号。",
    "大型语言模型的推理速度取决于内存带宽和批处理大小。推测解码可以加速生成。",
    "日本語のテキストも少し入れておきます。東京は日本の首都です。",
    "한국어 문장도 조금 있습니다. 서울은 대한민국의 수도입니다.",
    "Emoji time 😀😃😄 🎉🎊 👍🏽 🚀 ❤️ 🇫🇷 — done! 🤖 says hi 👋",
    "Café, naïve, résumé, façade, jalapeño, Ångström, Straße, smørrebrød, Dvořák, Łódź.",
    "Tiếng Việt có nhiều dấu: người, được, những, trường, nghiêng.",
    "Ελληνικά: καλημέρα κόσμε. Русский: привет, мир! עברית: שלום עולם. العربية: مرحبا",
    "Math: ∑ᵢ xᵢ² ≤ ∞, α → β, ∀ε>0 ∃δ>0, √2 ≈ 1.414, π ≈ 3.14159, ½ + ¼ = ¾.",
]
CHAR_POOL = list("abc xyz ,.!\n") + list("中文语言模型日本語한국어") + list("éèñüßøåçł")
CHAR_POOL += ["😀", "🎉", "👍🏽", "🚀", "🤖", "∑", "√", "α", "€", "\u200d"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=437,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    hf.train_from_iterator(CORPUS * 3, trainer)
    root = tmp_path_factory.mktemp("bytelevel")
    hf.save(str(root / "tokenizer.json"))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    return root


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by the ByteLevel pre-tokenizer."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)  # 188 printable bytes map to themselves
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_id(tok: Tokenizer, b: int) -> int:
    tid = tok.token_to_id(_bytes_to_unicode()[b])
    assert tid is not None
    return tid


def _random_split(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.choice([0, 1, 1, 1, 2, 3, 5, 11])
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def _stream(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.push(c) for c in chunks] + [detok.flush()]


# ---------------------------------------------------------------- loading


def test_from_dir_round_trips_text(tok: Tokenizer) -> None:
    assert 300 <= tok.vocab_size <= 500
    assert tok.eos_token_ids == (1, 0)  # generation_config.json's list, in order
    assert tok.token_to_id("<|im_end|>") == 1
    assert tok.token_to_id("definitely-not-a-token") is None
    for text in CORPUS + ["unseen wörds 🦀 混合 text\t\n  spaces"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == 1 and tok.decode(ids) == "hi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_matches_transformers(model_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    rng = random.Random(7)
    for _ in range(25):
        text = "".join(rng.choice(CHAR_POOL) for _ in range(rng.randint(1, 47)))
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, clean_up_tokenization_spaces=False)


def test_missing_or_bad_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot parse"):
        Tokenizer.from_dir(tmp_path)


def _copy_tokenizer(src: Path, dst: Path, **configs: object) -> Path:
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    for name, content in configs.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (dst / f"{name}.json").write_text(text)
    return dst


def test_eos_ids_merged_from_all_configs(model_dir: Path, tmp_path: Path) -> None:
    root = _copy_tokenizer(
        model_dir,
        tmp_path,
        generation_config={"eos_token_id": 2, "bos_token_id": None},
        config={"eos_token_id": [2, 1]},
        tokenizer_config={"eos_token": {"content": "<|endoftext|>", "special": True}},
    )
    assert Tokenizer.from_dir(root).eos_token_ids == (2, 1, 0)
    (root / "config.json").unlink()
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert Tokenizer.from_dir(root).eos_token_ids == (2, 1)
    (root / "generation_config.json").unlink()
    (root / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(root).eos_token_ids == ()


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ({"generation_config": {"eos_token_id": 100000}}, "eos_token_id 100000"),
        ({"config": {"eos_token_id": [0, "x"]}}, "eos_token_id 'x'"),
        ({"tokenizer_config": {"eos_token": "</s>"}}, "eos_token '</s>'"),
        ({"generation_config": "[1, 2"}, "cannot parse"),
        ({"config": "[1, 2]"}, "JSON object"),
    ],
)
def test_bad_eos_configs(model_dir: Path, tmp_path: Path, configs: dict, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        Tokenizer.from_dir(_copy_tokenizer(model_dir, tmp_path, **configs))


def test_bad_ids_and_text_are_invalid_requests(tok: Tokenizer) -> None:
    for ids in ([0, tok.vocab_size], [-1], [3, 2.5], [True]):
        with pytest.raises(InvalidRequest):
            tok.decode(ids)
    with pytest.raises(InvalidRequest):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        IncrementalDetokenizer(tok).push([tok.vocab_size + 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer(tok.backend, (tok.vocab_size,))


def test_check_ids_names_the_first_bad_id_whatever_the_element_types(tok: Tokenizer) -> None:
    import numpy as np

    v = tok.vocab_size
    assert tok.check_ids((5, 0, v - 1)) == [5, 0, v - 1] and tok.check_ids([]) == []
    got = tok.check_ids(np.array([7, 3], dtype=np.int64))  # numpy ints become ints
    assert got == [7, 3] and {type(i) for i in got} == {int}
    for ids, bad in (([1, v, -2], v), ([4, -2, v], -2), ([1, True], True), ([2, 2.0], 2.0),
                     ([np.int32(3), v + 1], v + 1)):
        with pytest.raises(InvalidRequest, match=f"token id {bad!r} is not in the vocabulary"):
            tok.check_ids(ids)


# ---------------------------------------------------------------- incremental detokenization


def test_random_token_sequences_match_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    clean_trials = 0
    for trial in range(400):
        gen = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 73))]
        prompt = tok.encode(rng.choice(CORPUS)) if trial % 2 else []
        skip = trial % 3 == 0
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = _stream(detok, _random_split(rng, gen))
        full = tok.decode(gen, skip_special_tokens=skip)
        assert "".join(deltas) == full
        if FFFD not in full:
            clean_trials += 1
            assert not any(FFFD in d for d in deltas)
    assert clean_trials >= 5  # the no-U+FFFD property was exercised, not vacuous


def test_multibyte_text_streams_without_replacement_chars(tok: Tokenizer) -> None:
    rng = random.Random(99)
    held_back = 0
    for _ in range(300):
        text = "".join(rng.choice(CHAR_POOL) for _ in range(rng.randint(1, 41)))
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, tok.encode(rng.choice(CORPUS)))
        chunks = _random_split(rng, ids)
        deltas = [detok.push(c) for c in chunks]
        held_back += sum(1 for c, d in zip(chunks, deltas, strict=True) if c and not d)
        deltas.append(detok.flush())
        assert "".join(deltas) == text
        assert not any(FFFD in d for d in deltas)
    assert held_back > 0  # some pushes really ended inside a character


def test_split_character_is_held_until_complete(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    raw = "a🚀".encode()
    assert detok.push([_byte_id(tok, raw[0]), _byte_id(tok, raw[1])]) == "a"
    assert detok.push([_byte_id(tok, raw[2])]) == ""
    assert detok.push([_byte_id(tok, raw[3])]) == ""
    assert detok.push([_byte_id(tok, raw[4])]) == "🚀"
    assert detok.flush() == ""


def test_flush_emits_replacement_for_truly_broken_bytes(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("ok ")) == "ok "
    assert detok.push([_byte_id(tok, 0xE4), _byte_id(tok, 0xB8)]) == ""
    assert detok.flush() == FFFD
    assert detok.push(tok.encode(" then")) == " then"


def test_a_prompt_ending_inside_a_character_is_not_the_outputs_context(tok: Tokenizer) -> None:
    """The prompt's last tokens are the first bytes of "日", the output's first the last byte:
    the deltas are the decode of the output ids alone (its lone byte a U+FFFD), never a text
    that drops the character (the prompt's U+FFFD counted as emitted)."""
    raw = "日".encode()
    prompt = tok.encode("see ") + [_byte_id(tok, b) for b in raw[:2]]
    for out in ([_byte_id(tok, raw[2])] + tok.encode(" x y"), [_byte_id(tok, raw[2])]):
        for chunks in ([out], [[t] for t in out]):
            got = "".join(_stream(IncrementalDetokenizer(tok, prompt), chunks))
            assert got == tok.decode(out) and got.startswith(FFFD), (chunks, got)


def test_first_generated_token_keeps_leading_space(tok: Tokenizer) -> None:
    prompt = tok.encode("Speculative decoding drafts")
    gen = tok.encode(" several tokens")
    assert tok.backend.id_to_token(gen[0]).startswith("Ġ")
    detok = IncrementalDetokenizer(tok, prompt)
    first = detok.push(gen[:1])
    assert first.startswith(" ") and len(first) > 1
    assert first + detok.push(gen[1:]) + detok.flush() == " several tokens"


def test_prompt_context_restores_metaspace_leading_space(tmp_path: Path) -> None:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=311, show_progress=False)
    hf.train_from_iterator(CORPUS[:7] * 3, trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    prompt = tok.encode("The quick brown fox jumps")
    gen = tok.encode("The quick brown fox jumps over the lazy dog")[len(prompt) :]
    assert tok.decode(gen).startswith("over")  # decoded alone, the space is lost
    with_context = IncrementalDetokenizer(tok, prompt)
    assert "".join(_stream(with_context, [[t] for t in gen])) == " over the lazy dog"
    without = IncrementalDetokenizer(tok)
    assert "".join(_stream(without, [[t] for t in gen])) == tok.decode(gen)


def _spy(tok: Tokenizer) -> tuple[Tokenizer, list[int]]:
    lengths: list[int] = []

    class Spy(Tokenizer):
        def decode(self, ids, skip_special_tokens=False):  # type: ignore[no-untyped-def]
            lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    return Spy(tok.backend, tok.eos_token_ids), lengths


def test_window_stays_small_for_long_generations(tok: Tokenizer) -> None:
    spy, lengths = _spy(tok)
    gen = tok.encode(" ".join(CORPUS) * 4)
    detok = IncrementalDetokenizer(spy, tok.encode("prompt"))
    assert "".join(_stream(detok, [[t] for t in gen])) == tok.decode(gen)
    assert len(gen) > 1000 and max(lengths) <= 12


def test_window_stays_small_for_endless_invalid_bytes(tok: Tokenizer) -> None:
    spy, lengths = _spy(tok)
    rng = random.Random(5)
    bad = [_byte_id(tok, rng.choice([0x80, 0x9F, 0xBF, 0xE4, 0xF0])) for _ in range(1501)]
    detok = IncrementalDetokenizer(spy)
    deltas = _stream(detok, [[t] for t in bad])
    full = tok.decode(bad)
    assert "".join(deltas) == full and len(full) > 900
    assert max(lengths) <= 16
    assert len(deltas[-1]) <= 3  # emitted as it went, not all held for the flush


# ---------------------------------------------------------------- stop strings


def _feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    out = []
    for d in deltas:
        text, stopped = matcher.feed(d)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_string_spanning_deltas() -> None:
    m = StopStringMatcher(["</answer>"])
    assert m.feed("The answer is 42.</an") == ("The answer is 42.", False)
    assert m.feed("sw") == ("", False)
    assert m.feed("er> trailing") == ("", True)
    assert m.stopped and m.feed("more") == ("", True) and m.flush() == ""


@pytest.mark.parametrize("cut", [1, 3, 5, 8, 13])
def test_include_keeps_the_stop_string_and_nothing_after_it(cut) -> None:
    """With `include` (include_stop_str_in_output) the text ends with the stop string that
    ended it — the one ending first, longest on ties — however the deltas split it."""
    text = "one ab two abcd three"
    deltas = [text[i:i + cut] for i in range(0, len(text), cut)]
    assert _feed_all(StopStringMatcher(["abcd", "two a"], include=True), deltas) == \
        ("one ab two a", True)
    assert _feed_all(StopStringMatcher(["abcd", "two a"]), deltas) == ("one ab ", True)
    assert _feed_all(StopStringMatcher(["abc", "abcd", "d th"], include=True), deltas) == \
        ("one ab two abc", True)


def test_partial_match_is_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P!") == ("", True)
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("OW and ST") == ("STOW and ", False)
    assert m.feed("ay") == ("STay", False)
    assert m.flush() == "" and not m.stopped


def test_multiple_stop_strings_first_completed_wins() -> None:
    m = StopStringMatcher(["\n\n", "User:", "\n\n"])
    assert m.feed("Hi there.\nUs") == ("Hi there.\n", False)
    assert m.feed("er: next") == ("", True)
    assert StopStringMatcher(["abcd", "bc"]).feed("xabcd") == ("xa", True)
    assert StopStringMatcher(["bcd", "abcd"]).feed("xabcd") == ("x", True)


def test_stop_at_very_start() -> None:
    m = StopStringMatcher(["<|end|>", "##"])
    assert m.feed("##") == ("", True)
    m = StopStringMatcher(["<|end|>"])
    assert m.feed("<|e") == ("", False)
    assert m.feed("nd|>") == ("", True)


def test_flush_releases_held_text() -> None:
    m = StopStringMatcher(["<|end|>"])
    assert m.feed("tail <|en") == ("tail ", False)
    assert m.flush() == "<|en"
    assert m.flush() == ""
    assert StopStringMatcher([]).feed("anything <|") == ("anything <|", False)


def test_stop_result_independent_of_split() -> None:
    rng = random.Random(2024)
    stops = ["ab", "bcb", "cabca", "😀😀"]
    for _ in range(500):
        text = "".join(rng.choice("abc😀") for _ in range(rng.randint(0, 23)))
        whole = _feed_all(StopStringMatcher(stops), [text])
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _feed_all(StopStringMatcher(stops), pieces) == whole
        if not whole[1]:
            assert whole[0] == text and not any(s in text for s in stops)


@pytest.mark.parametrize("stop", [[""], ["ok", ""], "STOP", [None]])
def test_invalid_stop_strings(stop: object) -> None:
    with pytest.raises(InvalidRequest):
        StopStringMatcher(stop)  # type: ignore[arg-type]
