"""Tensor parallelism on the CPU: 2 ranks over gloo (this process rank 0, one spawned worker).

The sharded forward equals the whole model's (prefill, tree verify, KV compaction, decode; the
drafter's taps), an engine on it generates TP=1's greedy tokens with speculation on and off, and
models that do not split raise ValueError before any worker starts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specserve.config import EngineConfig
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.runner import ForwardInput, ModelRunner
from specserve.models.config import load_config
from specserve.parallel import plan_for, start_workers, stop_workers
from specserve.types import SamplingParams
from tests.helpers import prefill_then_tree_steps, random_prompts, run_together

# (checkpoint, overrides): kv heads split (4 q / 2 kv, intermediate 168 = 2 · 84), one kv head
# replicated on both ranks (4 q / 1 kv), o_proj / down_proj / q/k/v biases (6 q / 2 kv), tied
# embeddings (2 q / 2 kv); vocab 211 (prime: the vocab-parallel head pads a row)
MODELS = [("qwen3-gqa4-yarn", dict(num_attention_heads=4, intermediate_size=168)),
          ("llama-gqa4-llama3", {}),
          ("llama-biases", {}),
          ("qwen3-gqa1-tied", {})]


@pytest.fixture(scope="module")
def tp2():
    start_workers(2, "cpu", timeout_s=120, num_threads=1)
    yield 2
    stop_workers()


def _steps(vocab: int, pages: list[int]):
    (ids0, args0), (ids1, args1) = prefill_then_tree_steps(vocab)
    pre = ForwardInput("a", ids0.tolist(), args0[3], 0, pages=args0[2][0])
    tree = ForwardInput("a", ids1.tolist(), np.asarray(args1[3]), 21, tree_mask=args1[5][0],
                        pages=args1[2][0])
    return pre, tree


def _slot(pages, pos: int, page_size: int = 16) -> int:
    return pages[pos // page_size] * page_size + pos % page_size


def _run_steps(runner: ModelRunner, vocab: int):
    pre, tree = _steps(vocab, [3, 0, 5])
    pages = list(pre.pages)
    out = [runner.forward([pre], list(range(21)), taps=True)]
    n = len(tree.token_ids)
    out.append(runner.forward([tree], list(range(n)), taps=True))
    # accept rows 2 and 4 of the tree: compact their K/V to positions 21, 22 (every rank)
    runner.kv.copy_slots([_slot(pages, 21 + 2), _slot(pages, 21 + 4)],
                         [_slot(pages, 21), _slot(pages, 22)])
    dec = ForwardInput("a", [int(tree.token_ids[4]) % vocab], [23], 23, pages=pages)
    out.append(runner.forward([dec], [0], taps=True))
    return out


@pytest.mark.parametrize("name,overrides", MODELS, ids=[m[0] for m in MODELS])
def test_tp2_forward_equals_tp1(tp2, checkpoint_cache, name, overrides):
    path, _ = checkpoint_cache(name, **overrides)
    cfg = EngineConfig(str(path), num_pages=8, poison_kv=True, tap_layers=(0, 2))
    vocab = load_config(path).vocab_size
    whole = _run_steps(ModelRunner(cfg), vocab)
    runner = ModelRunner(cfg.with_(tensor_parallel=2))
    attn = runner.model.model.layers[0].self_attn
    full = load_config(path)
    assert (attn.num_heads, attn.num_kv_heads) == (full.num_heads // 2,
                                                   max(1, full.num_kv_heads // 2))
    assert runner.kv.kv.shape[-2] == attn.num_kv_heads  # the pool holds this rank's heads
    sharded = _run_steps(runner, vocab)
    for (l1, f1), (l2, f2) in zip(whole, sharded, strict=True):
        assert l2.shape == l1.shape and l1.shape[-1] == vocab
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f2, f1, rtol=1e-5, atol=1e-5)
        assert torch.equal(l2.argmax(-1), l1.argmax(-1))


def _generate(engine, prompts, params, budget):
    return run_together(engine, prompts, [params] * len(prompts), budget)


def test_tp2_engine_greedy_lossless(tp2, checkpoint_cache, make_engine):
    path, _ = checkpoint_cache("qwen3-gqa4-yarn", num_attention_heads=4, intermediate_size=168)
    prompts = random_prompts(3, 211, [9, 23, 14], seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ar, _ = _generate(make_engine(path), prompts, params, 0)
    spec1 = make_engine(path, max_draft_tokens=12)
    spec1.set_drafter(NgramDrafter())
    tp_ar, _ = _generate(make_engine(path, tensor_parallel=2), prompts, params, 0)
    spec2 = make_engine(path, max_draft_tokens=12, tensor_parallel=2)
    spec2.set_drafter(NgramDrafter())
    tp_spec, steps = _generate(spec2, prompts, params, 12)
    assert tp_ar == ar
    assert tp_spec == ar  # speculation on the sharded verifier is lossless
    assert _generate(spec1, prompts, params, 12)[0] == ar
    assert steps < 40  # drafts were accepted: fewer steps than tokens


def test_unsplittable_models_raise(checkpoint_cache):
    path, _ = checkpoint_cache("llama-biases")  # 6 q heads, 2 kv heads, intermediate 160
    cfg = load_config(path)
    with pytest.raises(ValueError, match="attention heads"):
        plan_for(cfg, 4)
    with pytest.raises(ValueError, match="key/value heads"):
        plan_for(cfg, 3)  # 6 q heads split, but 2 kv heads over 3 ranks neither way
    with pytest.raises(ValueError, match="intermediate_size"):
        plan_for(dataclasses.replace(cfg, intermediate_size=161), 2)
    with pytest.raises(ValueError, match="attention heads"):  # before any worker starts
        ModelRunner(EngineConfig(str(path), tensor_parallel=4))
    with pytest.raises(ValueError, match="tensor_parallel"):
        EngineConfig(str(path), tensor_parallel=0)
    with pytest.raises(ValueError, match="not a model"):
        ModelRunner(EngineConfig(str(path), tensor_parallel=2), model=object())


def test_tp2_static_graph_path(tp2, checkpoint_cache, make_engine):
    """cuda_graphs="on" on the CPU: each rank runs its padded static decode / verify step (the
    CUDA graphs' eager twin; on CUDA each rank captures its own graphs, collectives inside)."""
    path, _ = checkpoint_cache("llama-gqa4-llama3")
    prompts = random_prompts(2, 211, [11, 30], seed=5)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ar, _ = _generate(make_engine(path), prompts, params, 0)
    spec = make_engine(path, max_draft_tokens=8, tensor_parallel=2, cuda_graphs="on",
                       max_model_len=128)
    assert spec.runner.graphs is not None
    spec.set_drafter(NgramDrafter())
    assert _generate(spec, prompts, params, 8)[0] == ar


def test_tp2_bad_input_raises_and_the_group_goes_on(tp2, checkpoint_cache):
    """An input that raises on rank 0 raises on the worker at the same point (before any
    collective); the worker goes on, so the engine's retry without that request works."""
    path, _ = checkpoint_cache("llama-gqa4-llama3")
    cfg = EngineConfig(str(path), num_pages=8)
    vocab = load_config(path).vocab_size
    runner = ModelRunner(cfg.with_(tensor_parallel=2))
    with pytest.raises(IndexError):
        runner.forward([ForwardInput("x", [vocab + 5], [0], 0, pages=[1])], [0])
    whole = _run_steps(ModelRunner(cfg), vocab)
    for (l1, _), (l2, _) in zip(whole, _run_steps(runner, vocab), strict=True):
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
