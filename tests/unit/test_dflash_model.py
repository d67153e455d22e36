"""DFlash drafter logits against the reference `dflash` package, config parsing, strict loading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.drafters.base import DraftRequest
from specserve.drafters.dflash import DFlashDrafter
from specserve.errors import ModelError
from specserve.models.dflash import load_dflash
from specserve.models.dflash_config import build_target_layer_ids, parse_dflash_config

VOCAB, HIDDEN, TARGET_LAYERS, MASK = 157, 48, 6, 150
DRAFT = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=72, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
             initializer_range=0.1, max_position_embeddings=256)
SLIDING = dict(use_sliding_window=True, max_window_layers=0,
               layer_types=["sliding_attention", "sliding_attention", "full_attention"])
CONFIGS = {
    "full": (dict(), dict(), False),
    "sliding": (dict(**SLIDING, sliding_window=9), dict(), False),
    "yarn": (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 16},
                  max_position_embeddings=64),
             dict(input_embedding_scale=1.7, output_multiplier=0.8,
                  final_logit_softcapping=6.0), True),
    "sliding-bidirectional": (dict(**SLIDING, sliding_window=5, is_causal=False), dict(), True),
}
# (new context rows, bonus token, block length) per step: irregular, the last blocks shrink.
STEPS = [(13, 5, 7), (3, 17, 7), (1, MASK, 7), (6, 2, 7), (2, 40, 4), (9, 88, 7), (4, 11, 2)]
TAPS = [1, 4]


def _save_pair(root, name: str):
    import transformers
    from dflash.model import DFlashDraftModel as RefDraft

    config_kw, dflash_kw, tied = CONFIGS[name]
    torch.manual_seed(0)
    target_cfg = transformers.Qwen3Config(**{**DRAFT, "num_hidden_layers": TARGET_LAYERS,
                                             "tie_word_embeddings": tied})
    target = transformers.Qwen3ForCausalLM(target_cfg).eval()
    draft_cfg = transformers.Qwen3Config(**{**DRAFT, **config_kw})
    draft_cfg.block_size, draft_cfg.num_target_layers = 7, TARGET_LAYERS
    draft_cfg.dflash_config = {"target_layer_ids": TAPS, "mask_token_id": MASK, **dflash_kw}
    ref = RefDraft(draft_cfg).eval()
    target.save_pretrained(root / "target")
    ref.save_pretrained(root / "draft")
    return root / "draft", root / "target", ref, target


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = _save_pair(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return get


def ref_logits(ref, target, cache, features, start: int, bonus: int, n: int) -> torch.Tensor:
    """One step of `dflash_generate`'s drafting, exactly as the reference calls the model."""
    from dflash.model import _crop_to

    block = torch.tensor([[bonus] + [MASK] * (n - 1)])
    scale = float(ref.config.dflash_config.get("input_embedding_scale", 1.0))
    noise = target.model.embed_tokens(block) * scale
    positions = torch.arange(start - features.shape[0], start + n)[None]
    hidden = ref(target_hidden=features[None], noise_embedding=noise, position_ids=positions,
                 past_key_values=cache, use_cache=True)[:, 1 - n :, :]
    _crop_to(cache, start)
    return ref.compute_logits(hidden, target.lm_head)[0].float()  # [n-1, V]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_reference_incrementally(pairs, name):
    from dflash.model import _make_cache

    draft_dir, target_dir, ref, target = pairs(name)
    drafter = DFlashDrafter(load_dflash(draft_dir, target_dir), num_pages=40, page_size=5,
                            poison=True)
    ref_cache = _make_cache(ref.config)
    gen = torch.Generator().manual_seed(3)
    start, seen, errs = 0, [], []
    with torch.no_grad():
        for n_new, bonus, n in STEPS:
            start += n_new
            feats = 2 * torch.randn(n_new, len(TAPS) * HIDDEN, generator=gen)  # [n_new, 2H]
            seen.append(feats)
            expected = ref_logits(ref, target, ref_cache, feats, start, bonus, n)
            request = DraftRequest("r", bonus, start, budget=4, max_depth=n - 1, context=feats)
            (ours,) = drafter.draft_logits([request])
            assert expected.std() > 0.3  # logits are not flat
            errs.append(rel_err(ours, expected))
    assert max(errs) < 1e-5, errs
    # The cache-reusing path equals a fresh drafter fed all the context at once.
    fresh = DFlashDrafter(load_dflash(draft_dir, target_dir), num_pages=40, page_size=3)
    request = DraftRequest("r", bonus, start, budget=4, max_depth=n - 1, context=torch.cat(seen))
    assert rel_err(fresh.draft_logits([request])[0], ours) < 1e-5


def test_reference_config_rules(pairs):
    draft_dir, _, ref, _ = pairs("sliding")
    raw = json.loads((draft_dir / "config.json").read_text())
    cfg = parse_dflash_config(raw)
    assert cfg.causal == tuple(layer.self_attn.is_causal for layer in ref.layers)
    assert tuple(cfg.window(i) for i in range(3)) == tuple(
        layer.self_attn.sliding_window for layer in ref.layers)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (7, MASK, tuple(TAPS))
    # Without dflash_config.target_layer_ids the reference formula applies.
    del raw["dflash_config"]["target_layer_ids"]
    raw["num_target_layers"] = 36
    assert parse_dflash_config(raw).target_layer_ids == (1, 17, 33)
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert build_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert build_target_layer_ids(10, 1) == (5,)
    # use_sliding_window false drops the window (transformers' Qwen3Config rule) ...
    assert parse_dflash_config({**raw, "use_sliding_window": False}).sliding_window is None
    # ... and a top-level is_causal sets every layer.
    assert parse_dflash_config({**raw, "is_causal": True}).causal == (True, True, True)


@pytest.mark.parametrize("change, match", [
    (lambda raw: raw.update(architectures=["DFlash2DraftModel"]), "DFlash2DraftModel"),
    (lambda raw: raw.pop("hidden_size"), "hidden_size"),
    (lambda raw: raw["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda raw: raw["dflash_config"].update(target_layer_ids=[1, 6]), "target_layer_ids"),
])
def test_config_errors(pairs, change, match):
    draft_dir, *_ = pairs("full")
    raw = json.loads((draft_dir / "config.json").read_text())
    change(raw)
    with pytest.raises(ModelError, match=match):
        parse_dflash_config(raw)


def _broken_copy(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_load_errors_name_the_tensor(pairs, tmp_path):
    draft_dir, target_dir, *_ = pairs("full")
    name = "layers.1.self_attn.k_norm.weight"
    missing = _broken_copy(draft_dir, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ModelError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        load_dflash(missing, target_dir)
    wrong = _broken_copy(draft_dir, tmp_path / "wrong",
                         lambda t: t.update({"fc.weight": torch.ones(HIDDEN, HIDDEN)}))
    with pytest.raises(ModelError, match=r"fc\.weight has shape \(48, 48\), expected \(48, 96\)"):
        load_dflash(wrong, target_dir)
    extra = _broken_copy(draft_dir, tmp_path / "extra",
                         lambda t: t.update({"candidate_selector.x": torch.ones(2)}))
    with pytest.raises(ModelError, match="unexpected tensors.*candidate_selector"):
        load_dflash(extra, target_dir)
    headless = _broken_copy(target_dir, tmp_path / "headless", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelError, match=r"lm_head\.weight"):
        load_dflash(draft_dir, headless)


def test_embedding_and_head_come_from_the_target(pairs):
    for name, tied in (("full", False), ("yarn", True)):
        draft_dir, target_dir, _, target = pairs(name)
        model = load_dflash(draft_dir, target_dir)
        assert torch.equal(model.embed.weight, target.model.embed_tokens.weight)
        assert torch.equal(model.lm_head.weight, target.lm_head.weight)
        assert (model.lm_head.weight is model.embed.weight) == tied
