"""Our decoder on a paged KV cache equals transformers (the oracle) on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.base import AttnBatch
from specserve.kvcache.pool import KVPool, KVShape
from specserve.models.loader import load_model
from specserve.types import SamplingParams
from tests.helpers import CONFIGS, hf_greedy, random_prompts

NAMES = sorted(CONFIGS)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _pool(model, page_size=16, num_pages=64):
    c = model.config
    return KVPool(KVShape(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32),
                  num_pages, page_size, poison=True)


@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_decode_logits_match_transformers(checkpoint_cache, name):
    path, hf = checkpoint_cache(name)
    ours = load_model(path)
    ids = torch.randint(0, hf.config.vocab_size, (1, 75),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [75, V]
    kv, pages = _pool(ours), [5, 2, 9, 0, 7, 1]  # shuffled pages
    # prefill 61 tokens in two chunks, then 14 one-token decode steps
    spans = [(0, 40), (40, 61)] + [(i, i + 1) for i in range(61, 75)]
    for s, e in spans:
        batch = AttnBatch.build([e - s], [s], [pages], list(range(s, e)), 16)
        with torch.no_grad():
            hidden, _ = ours(ids[0, s:e], batch, kv)
            logits = ours.logits(hidden)
        assert rel_err(logits, ref[s:e]) <= 1e-5, (name, s, e)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(checkpoint_cache, make_engine, name):
    path, hf = checkpoint_cache(name)
    engine = make_engine(path, page_size=16, max_num_batched_tokens=512)
    prompts = random_prompts(8, hf.config.vocab_size, [3, 17, 40, 9, 61, 1, 28, 12], seed=11)
    ours = engine.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True))
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 64)
    assert len({tuple(o) for o in ours}) > 1  # the prompts really produce different outputs


@pytest.mark.parametrize("taps", [(0, 1), (2, 0)])  # 2: the last layer, after the final norm
def test_tapped_hidden_states_equal_output_hidden_states(checkpoint_cache, taps):
    """Tap i is transformers' hidden_states[i + 1], as `dflash` reads it: for the last layer
    that is after the final norm."""
    path, hf = checkpoint_cache("qwen3-gqa4-yarn")
    ours = load_model(path)
    assert hf.config.num_hidden_layers == 3
    ids = torch.randint(0, hf.config.vocab_size, (1, 33),
                        generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states  # index 0 = embeddings
        batch = AttnBatch.build([33], [0], [[3, 4, 0]], list(range(33)), 16)
        _, feats = ours(ids[0], batch, _pool(ours), taps=taps)
        ours.train(False)  # the module path too (the engine's CPU path is above)
        with torch.enable_grad():
            _, module_feats = ours(ids[0], batch, _pool(ours), taps=taps)
    d = hf.config.hidden_size
    assert feats.shape == (33, 2 * d)
    for i, layer in enumerate(taps):
        assert rel_err(feats[:, i * d:(i + 1) * d], ref[layer + 1][0]) <= 1e-5
        assert rel_err(module_feats[:, i * d:(i + 1) * d].detach(), ref[layer + 1][0]) <= 1e-5
    with torch.no_grad():
        _, none = ours(ids[0], batch, _pool(ours))
    assert none is None  # nothing collected unless asked


def test_sharded_checkpoint_and_bf16(tmp_path, checkpoint_cache):
    _, hf = checkpoint_cache("qwen3-gqa7-hd128")
    hf.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_model(tmp_path)
    ids = torch.arange(7, 40).view(1, -1)
    with torch.no_grad():
        ref = hf(ids).logits[0]
        batch = AttnBatch.build([33], [0], [[1, 0, 2]], list(range(33)), 16)
        out = ours.logits(ours(ids[0], batch, _pool(ours))[0])
    assert rel_err(out, ref) <= 1e-5
    half = load_model(tmp_path, dtype="bfloat16")
    assert half.lm_head.weight.dtype == torch.bfloat16
    pool = KVPool(KVShape(3, 1, 128, torch.bfloat16), 8, 16)
    with torch.no_grad():
        out16 = half.logits(half(ids[0], batch, pool)[0])
    assert rel_err(out16, ref) < 5e-2
