"""Training data for the demo pair: text every fresh machine has, and in-context copying.

Owns (1) the corpus: the running Python's standard library sources — the top-level `*.py` files
of `sysconfig.get_paths()["stdlib"]`, in name order, whole files until a byte cap; (2) the
byte-level BPE tokenizer trained on it, with `<|endoftext|>` (id 0, the document separator and
EOS) and `<|mask|>` (the last id, DFlash's mask token); (3) seeded batches of fixed-length
sequences: natural slices of the corpus, and "copy" sequences — an optional natural prefix, then
one phrase repeated to the end (a random span of the corpus, or a sentence of random corpus
words such as "Return the value of self." joined by spaces or newlines). The copy sequences are
what teaches the target to continue a repeated phrase ("The cat sat on the mat." repeated).
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOS, MASK = "<|endoftext|>", "<|mask|>"
WORD = re.compile(r"\b[a-z]{2,10}\b")


@dataclass(frozen=True)
class Corpus:
    root: str  # the stdlib directory read
    files: tuple[str, ...]  # file names used, in order
    texts: tuple[str, ...]

    @property
    def num_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for t in self.texts)

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for name, text in zip(self.files, self.texts, strict=True):
            h.update(name.encode() + b"\0" + text.encode("utf-8") + b"\0")
        return h.hexdigest()

    def describe(self) -> dict:
        return {"root": self.root, "num_files": len(self.files), "first": self.files[0],
                "last": self.files[-1], "bytes": self.num_bytes, "sha256": self.sha256}


def stdlib_corpus(cap_bytes: int) -> Corpus:
    """Top-level stdlib `*.py` files sorted by name, whole files, stopping before `cap_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, texts, total = [], [], 0
    for path in sorted(root.glob("*.py")):
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")
        size = len(text.encode("utf-8"))
        if total + size > cap_bytes:
            break
        files.append(path.name)
        texts.append(text)
        total += size
    if not texts:
        raise RuntimeError(f"no stdlib sources under {root} fit in {cap_bytes} bytes")
    return Corpus(str(root), tuple(files), tuple(texts))


def train_tokenizer(corpus: Corpus, vocab_size: int):
    """Byte-level BPE with `vocab_size` ids in all: `<|endoftext|>` = 0, `<|mask|>` = last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, special_tokens=[EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus.texts), trainer)
    tok.add_special_tokens([MASK])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size or tok.token_to_id(EOS) != 0 \
            or tok.token_to_id(MASK) != vocab_size - 1:
        raise RuntimeError("tokenizer training did not produce the expected special ids")
    return tok


def tokenize_corpus(tok, corpus: Corpus) -> np.ndarray:
    """All files as one int32 stream, each file followed by `<|endoftext|>`."""
    eos = tok.token_to_id(EOS)
    out = []
    for enc in tok.encode_batch(list(corpus.texts), add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eos)
    return np.asarray(out, dtype=np.int32)


def corpus_words(corpus: Corpus, top: int = 2000) -> list[str]:
    """The `top` most frequent lowercase words of the corpus (ties by spelling)."""
    counts = Counter(w for t in corpus.texts for w in WORD.findall(t))
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the corpus' token frequencies: the loss of the best context-free model."""
    p = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


class Batches:
    """Seeded batches `[n, seq_len]` int64: natural slices and copy sequences, mixed."""

    def __init__(self, tok, tokens: np.ndarray, words: list[str], seq_len: int,
                 copy_frac: float, seed: int,
                 kinds: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3),
                 max_period: int = 32, prefix: bool = True) -> None:
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens; sequences need {seq_len + 1}")
        self.tok, self.tokens, self.words = tok, tokens, words
        self.seq_len, self.copy_frac, self.kinds = seq_len, copy_frac, kinds
        self.max_period, self.prefix = max_period, prefix
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def natural(self, n: int) -> np.ndarray:
        start = int(self.rng.integers(0, len(self.tokens) - n))
        return self.tokens[start : start + n].astype(np.int64)

    def phrase_text(self) -> str:
        """A sentence of 3–10 random corpus words: "Return the value of self." and the like."""
        words = list(self.rng.choice(self.words, size=int(self.rng.integers(3, 11))))
        words[0] = words[0].capitalize()
        return " ".join(words) + str(self.rng.choice([".", ".", ".", "!", "?", ";", ","]))

    def repeated(self, n: int) -> np.ndarray:
        """`n` tokens of one phrase repeated: a corpus span, random tokens, or a word sentence
        (as text)."""
        kind = self.rng.choice(3, p=self.kinds)
        if kind < 2:
            length = int(self.rng.integers(2, self.max_period + 1))
            span = self.natural(length) if kind == 0 else self.rng.integers(
                1, self.vocab_size - 1, size=length)
            return np.tile(span, n // len(span) + 1)[:n]
        phrase = self.phrase_text()
        sep = str(self.rng.choice([" ", " ", " ", "\n", ""]))
        per = len(self.tok.encode(phrase + sep).ids)
        text = sep.join([phrase] * (n // max(per - 1, 1) + 2))
        ids = np.asarray(self.tok.encode(text).ids[:n], dtype=np.int64)
        return ids if len(ids) == n else np.resize(ids, n)

    def copy(self) -> np.ndarray:
        s = self.seq_len
        prefix = 0 if not self.prefix or self.rng.random() < 0.25 else int(
            self.rng.integers(1, s // 2))
        return np.concatenate([self.natural(prefix), self.repeated(s - prefix)])

    def next(self, n: int) -> torch.Tensor:  # [n, seq_len] int64
        rows = [self.copy() if self.rng.random() < self.copy_frac else self.natural(self.seq_len)
                for _ in range(n)]
        return torch.from_numpy(np.stack(rows))
