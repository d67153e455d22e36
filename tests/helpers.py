"""Tiny random checkpoints for the tests, written by transformers (the oracle) itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specserve.drafters.ngram import NgramDrafter
from specserve.spec.tree import DraftTree

# name -> (transformers config class name, kwargs). GQA ratios 1, 4, 7; head_dim 64 and 128;
# tied and untied embeddings; default, YaRN, linear and llama3 RoPE.
CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen3-gqa1-tied": ("Qwen3", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                      tie_word_embeddings=True)),
    "qwen3-gqa4-yarn": ("Qwen3", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 64})),
    "qwen3-gqa7-hd128": ("Qwen3", dict(num_attention_heads=7, num_key_value_heads=1,
                                       head_dim=128)),
    "llama-gqa4-llama3": ("Llama", dict(num_attention_heads=4, num_key_value_heads=1,
                                        head_dim=32, rope_scaling={
                                            "rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 32})),
    "llama-linear-tied": ("Llama", dict(num_attention_heads=4, num_key_value_heads=4,
                                        head_dim=16, tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # biases: Llama's attention_bias biases o_proj too, mlp_bias gate/up/down; Qwen3's as well
    "llama-biases": ("Llama", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                   attention_bias=True, mlp_bias=True)),
    "qwen3-attn-bias": ("Qwen3", dict(num_attention_heads=3, num_key_value_heads=1,
                                      head_dim=32, attention_bias=True)),
}
BASE = dict(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
            max_position_embeddings=512, initializer_range=0.08, rms_norm_eps=1e-6)


def hf_config(name: str, **overrides):
    import transformers

    family, kwargs = CONFIGS[name]
    cls = getattr(transformers, f"{family}Config")
    return cls(**{**BASE, **kwargs, **overrides})


def make_checkpoint(path: Path, name: str, seed: int = 0, **overrides):
    """Save a random HF model; returns (path, the transformers model in fp32 eval mode)."""
    import transformers

    cfg = hf_config(name, **overrides)
    torch.manual_seed(seed)
    family = CONFIGS[name][0]
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    model.save_pretrained(path)
    return Path(path), model


def save_tokenizer(root: Path, vocab_size: int = 300) -> Path:
    """Write a small byte-level BPE tokenizer.json (trained on the tokenizer tests' corpus) into
    `root`; returns `root`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.unit.test_tokenizer import CORPUS

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(Path(root) / "tokenizer.json"))
    return Path(root)


def random_prompts(n: int, vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    # an explicit mask: generate() would otherwise mask prompt tokens equal to pad_token_id
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_greedy_oracle(model_dir):
    """transformers' greedy decoding of the checkpoint in `model_dir` (fp32), cached per prompt:
    `greedy(prompt_ids, n)` → the first n tokens. The outside oracle the served tests match."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    done: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int], n: int) -> list[int]:  # a greedy prefix is its own answer
        if len(done.get(tuple(prompt), ())) < n:
            with torch.no_grad():
                done[tuple(prompt)] = hf_greedy(model, list(prompt), n)
        return done[tuple(prompt)][:n]

    return greedy


def prefill_then_tree_steps(vocab: int) -> list:
    """Two forward steps for model-path tests: a 21-token prefill chunk, then a 5-node tree
    verify over it — [(ids, AttnBatch.build args)] on pages [3, 0, 5] of 16 tokens."""
    import numpy as np

    from specserve.spec.tree import DraftTree, verify_layout

    g = torch.Generator().manual_seed(4)
    tree = DraftTree(np.array([3, 9, 4, 7, 1], dtype=np.int64),
                     np.array([0, 1, 1, 0, 4], dtype=np.int32),
                     np.array([1, 2, 2, 1, 2], dtype=np.int32))
    lay = verify_layout(tree, 5, 21)
    pages = [3, 0, 5]
    return [(torch.randint(0, vocab, (21,), generator=g),
             ([21], [0], [pages], list(range(21)), 16)),
            (torch.as_tensor(lay.token_ids) % vocab,
             ([lay.num_rows], [21], [pages], lay.positions, 16, [lay.mask]))]


def random_tree(rng: np.random.Generator, n: int, vocab: int | None = None) -> DraftTree:
    """n draft nodes, parent of node i drawn uniformly from the rows before it; tokens 0..n−1,
    or (vocab) n distinct random ids below vocab."""
    parents = np.array([rng.integers(0, i + 1) for i in range(n)], dtype=np.int32)  # [n]
    depths = np.zeros(n, dtype=np.int32)  # [n]
    for i, p in enumerate(parents):
        depths[i] = 1 if p == 0 else depths[p - 1] + 1
    tokens = (np.arange(n, dtype=np.int64) if vocab is None
              else rng.choice(vocab, size=n, replace=False).astype(np.int64))  # [n]
    return DraftTree(tokens, parents, depths)


def run_together(engine, prompts, params_list, budget: int = 0) -> tuple[list[list[int]], int]:
    """Queue every prompt (request ids r0, r1, ...; one params each), step the engine until
    all finish: (each request's generated ids, the number of steps)."""
    for i, (p, params) in enumerate(zip(prompts, params_list, strict=True)):
        engine.add_request(f"r{i}", p, params, budget)
    got = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        steps += 1
    return [got[f"r{i}"] for i in range(len(prompts))], steps


class AheadDrafter(NgramDrafter):
    """The n-gram drafter (trees from the history alone) that can also draft ahead: `submit`
    drafts at once and hands the trees back when collected; it logs what each call held."""

    asynchronous = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.step = 0  # the engine step running (set by the test)
        self.sent_ahead: dict[int, tuple[str, ...]] = {}  # step -> ids sent ahead during it

    def draft(self, requests):
        self.calls.append(("draft", tuple(r.request_id for r in requests)))
        return super().draft(requests)

    def submit(self, requests, ahead=False):
        self.calls.append(("ahead" if ahead else "submit", tuple(r.request_id for r in requests)))
        if ahead:
            self.sent_ahead[self.step] = self.calls[-1][1]
        trees = super().draft(requests)
        return lambda: trees


class ScoredAheadDrafter(AheadDrafter):
    """AheadDrafter's trees, each node's path scored as if the drafter were sure of it (what
    adaptive speculation reads); it logs each call's budgets."""

    def __init__(self) -> None:
        super().__init__()
        self.budgets: list[tuple[str, tuple[int, ...]]] = []

    @staticmethod
    def _scored(trees):
        return [DraftTree.unchecked(t.token_ids, t.parents, t.depths,
                                    (np.log(0.9) * t.depths).astype(np.float32)) for t in trees]

    def draft(self, requests):
        self.budgets.append(("draft", tuple(r.budget for r in requests)))
        return self._scored(super().draft(requests))

    def submit(self, requests, ahead=False):
        self.budgets.append(("ahead", tuple(r.budget for r in requests)))
        trees = self._scored(super().submit(requests, ahead)())
        return lambda: trees
