"""The DFlash drafter inside the engine, against the reference `dflash.model.dflash_generate`.

Chain mode (block 16) must give the reference's tokens AND its per-step acceptance lengths; tree
mode (DDTree budgets 1 … 64) must give exactly the target's greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from specserve.drafters.dflash import DFlashDrafter
from specserve.models.dflash import load_dflash
from specserve.types import SamplingParams
from tests.helpers import hf_config, hf_greedy, random_prompts

VOCAB, LAYERS, NEW = 211, 4, 64


@pytest.fixture(scope="module")
def dflash_pair(tmp_path_factory):
    """A tiny random target (saved by transformers) and a DFlash drafter (saved by `dflash`)."""
    return _pair(tmp_path_factory, [0, 2])


@pytest.fixture(scope="module")
def dflash_pair_last(tmp_path_factory):
    """The same, its drafter tapping the target's LAST layer: transformers' hidden_states[L]
    (which `dflash` reads for tap L − 1) is after the final norm."""
    return _pair(tmp_path_factory, [1, LAYERS - 1], draft_seed=12)  # 12: a chain is accepted


def _pair(tmp_path_factory, taps: list[int], draft_seed: int = 8):
    import transformers
    from dflash.model import DFlashDraftModel

    torch.manual_seed(7)
    target = transformers.Qwen3ForCausalLM(hf_config(
        "qwen3-gqa4-yarn", num_hidden_layers=LAYERS, initializer_range=0.2)).eval()
    tdir = tmp_path_factory.mktemp("dflash-target")
    target.save_pretrained(tdir)
    cfg = hf_config("qwen3-gqa4-yarn", num_hidden_layers=2, initializer_range=0.2)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size, cfg.num_target_layers = 16, LAYERS
    cfg.dflash_config = {"target_layer_ids": taps, "mask_token_id": VOCAB - 1}
    torch.manual_seed(draft_seed)
    draft = DFlashDraftModel(cfg).eval()
    ddir = tmp_path_factory.mktemp("dflash-draft")
    draft.save_pretrained(ddir)
    return tdir, target, ddir, draft


def _drafter(tdir, ddir, tree: bool) -> DFlashDrafter:
    return DFlashDrafter(load_dflash(ddir, tdir), num_pages=256, page_size=16, tree=tree,
                         poison=True)


def _prompts(n: int = 4):
    prompts = random_prompts(n, VOCAB - 1, [21, 6, 35, 13, 17, 3, 28, 9], seed=41)
    return [p + p[:9] for p in prompts]


@pytest.mark.parametrize("pair,page_size", [("dflash_pair", 1), ("dflash_pair", 16),
                                            ("dflash_pair_last", 16)])
def test_chain_matches_dflash_generate(request, make_engine, pair, page_size, monkeypatch):
    import time

    import dflash.model
    from dflash.model import dflash_generate

    # the reference times itself with torch.cuda.synchronize; on CPU a plain clock does
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)

    tdir, target, ddir, draft = request.getfixturevalue(pair)
    engine = make_engine(tdir, page_size=page_size, max_draft_tokens=15)
    engine.set_drafter(_drafter(tdir, ddir, tree=False))
    total_accepted = 0
    for prompt in _prompts():
        ref = dflash_generate(draft, target, torch.tensor([prompt]), max_new_tokens=NEW,
                              stop_token_ids=None, temperature=0.0, return_stats=True)
        steps = []
        engine.on_step = lambda rid, s, steps=steps: steps.append(s.commit_len)
        ours = engine.generate([prompt], SamplingParams(max_tokens=NEW, ignore_eos=True),
                               budget=15)[0]
        assert ours == ref.output_ids[0, len(prompt):].tolist()
        assert steps == ref.acceptance_lengths
        total_accepted += sum(steps) - len(steps)
    assert total_accepted > 0  # the drafter's chains were accepted at least sometimes


class _Recording(DFlashDrafter):
    """Records the context rows each call brings: ("feed" | "draft", start, rows)."""

    calls: list

    def feed(self, requests):
        self.calls += [("feed", r.start, r.context.shape[0]) for r in requests]
        return super().feed(requests)

    def draft(self, requests):
        self.calls += [("draft", r.start, 0 if r.context is None else r.context.shape[0])
                       for r in requests if r.budget]  # (feed drafts at budget 0)
        return super().draft(requests)


def test_prefill_chunks_feed_the_drafter_and_chains_still_match(dflash_pair, make_engine,
                                                                monkeypatch):
    """Prefill in 7-token chunks: each chunk's context goes to the drafter as it is made (the
    first draft carries none), and tokens and acceptance lengths still equal the reference's."""
    import time

    import dflash.model
    from dflash.model import dflash_generate

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)
    tdir, target, ddir, draft = dflash_pair
    engine = make_engine(tdir, max_draft_tokens=15, max_num_batched_tokens=7 + 16)
    drafter = _Recording(load_dflash(ddir, tdir), num_pages=256, page_size=16, tree=False,
                         poison=True)
    drafter.calls = []
    engine.set_drafter(drafter)
    prompt = _prompts(1)[0] * 2  # 60 tokens: 3 chunks of 23, the last 14
    ref = dflash_generate(draft, target, torch.tensor([prompt]), max_new_tokens=24,
                          stop_token_ids=None, temperature=0.0, return_stats=True)
    steps = []
    engine.on_step = lambda rid, s: steps.append(s.commit_len)
    ours = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True), budget=15)
    assert ours[0] == ref.output_ids[0, len(prompt):].tolist()
    assert steps == ref.acceptance_lengths
    feeds = [c for c in drafter.calls if c[0] == "feed"]
    assert [(s, n) for _, s, n in feeds] == [(23, 23), (46, 23), (60, 14)]
    first_draft = next(c for c in drafter.calls if c[0] == "draft")
    assert first_draft == ("draft", 60, 0)


@pytest.fixture(scope="module")
def greedy_expected(dflash_pair):
    _, target, _, _ = dflash_pair
    prompts = _prompts(8)
    return prompts, [hf_greedy(target, p, 128) for p in prompts]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", ["ddtree-1", "ddtree-4", "ddtree-16", "ddtree-64", "chain-15"])
def test_greedy_lossless_8x128(dflash_pair, greedy_expected, make_engine, mode, page_size):
    tdir, _, ddir, _ = dflash_pair
    prompts, expected = greedy_expected
    kind, budget = mode.split("-")
    engine = make_engine(tdir, page_size=page_size, max_draft_tokens=64,
                         max_num_batched_tokens=96)
    engine.set_drafter(_drafter(tdir, ddir, tree=kind == "ddtree"))
    steps = []
    engine.on_step = lambda rid, s: steps.append(s)
    got = engine.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True),
                          budget=int(budget))
    assert got == expected
    assert sum(s.commit_len for s in steps) == 8 * 127
    assert all(s.tree_size <= int(budget) and s.accepted_depth <= 15 for s in steps)
    assert engine.generate(prompts[:2], SamplingParams(max_tokens=128, ignore_eos=True)) == \
        expected[:2]  # the engine's own AR decoding gives the same tokens


def test_warm_up_runs_every_tree_size_class_and_leaves_no_state(dflash_pair, make_engine):
    """The services' compile-ahead: trees of every size class, an AR step, then nothing held
    (make_engine checks no pages leak) and the engine's own drafter back in place."""
    from specserve.engine.warmup import size_classes, warm_up_drafter, warm_up_engine

    assert size_classes(64) == [1, 3, 7, 15, 31, 63, 64]
    assert size_classes(15) == [1, 3, 7, 15] and size_classes(0) == []
    tdir, _, ddir, _ = dflash_pair
    engine = make_engine(tdir, max_draft_tokens=20, max_num_batched_tokens=40)
    drafter = _drafter(tdir, ddir, tree=True)
    engine.set_drafter(drafter)
    sizes = []
    engine.on_step = lambda rid, s: sizes.append(s.tree_size)
    warm_up_engine(engine)
    assert sizes[:6] == [1, 3, 7, 15, 20, 0] and engine.drafter is drafter
    assert not engine.has_unfinished and not engine.requests
    warm_up_drafter(drafter)
    assert drafter.cache.length("__specserve_warmup__") == 0
    prompt = _prompts(1)[0]
    fresh = make_engine(tdir, max_draft_tokens=20)
    fresh.set_drafter(_drafter(tdir, ddir, tree=True))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.on_step = None
    assert engine.generate([prompt], params, budget=16) == fresh.generate([prompt], params,
                                                                          budget=16)
