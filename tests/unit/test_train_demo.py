"""The demo trainer (specserve/demo): a `--quick` run is deterministic and writes checkpoints our
strict loaders accept; the committed demo pair (checkpoints/) reproduces its first logged losses
and speculates on predictable text in the in-process engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from services.cli import main as cli_main
from specserve.demo import train
from specserve.models.dflash import load_dflash
from specserve.models.loader import load_model

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def _dtypes(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return {str(f.get_tensor(n).dtype) for n in f.keys()}  # noqa: SIM118


def test_quick_training_is_deterministic_and_loads(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        assert cli_main(["train-demo", "--quick", "--out", str(tmp_path / name), "--seed", "3",
                         "--device", "cpu"]) == 0
        runs.append(json.loads((tmp_path / name / train.SUMMARY).read_text()))
    a, b = runs
    assert a["target"]["losses"][0][0] == 1 and a["drafter"]["losses"][0][0] == 1
    assert a["target"]["losses"] == b["target"]["losses"]  # the same seed: the same losses
    assert a["drafter"]["losses"] == b["drafter"]["losses"]
    assert a["drafter"]["metrics"] == b["drafter"]["metrics"]
    out = capsys.readouterr()
    assert out.out == ""  # progress goes to stderr, as every command's
    printed = [line.split(" (")[0] for line in out.err.splitlines()
               if line.startswith("[target] step 1/") or line.startswith("[drafter] step 1/")]
    assert len(printed) == 4 and printed[:2] == printed[2:]

    root = tmp_path / "a"
    target = load_model(root / train.TARGET_DIR)
    drafter = load_dflash(root / train.DRAFTER_DIR, root / train.TARGET_DIR)
    assert set(target.config.layer_types) == {"sliding_attention"}
    assert drafter.config.layer_types[-1] == "full_attention"
    assert set(drafter.config.layer_types[:-1]) == {"sliding_attention"}
    assert drafter.config.rope.rope_type == "yarn" and drafter.config.block_size == 16
    mask = drafter.config.mask_token_id
    assert mask == target.config.vocab_size - 1
    assert (root / train.TARGET_DIR / "tokenizer.json").exists()
    assert _dtypes(root / train.TARGET_DIR) == _dtypes(root / train.DRAFTER_DIR) == {
        "torch.bfloat16"}


def test_train_demo_reproduces_the_committed_first_losses(tmp_path):
    """The committed pair's training.json: the same seed and recipe, run again for its first 50
    steps on the full schedule, logs the same first losses, exactly."""
    import torch

    from specserve.demo import data

    summary = json.loads((CHECKPOINTS / train.SUMMARY).read_text())
    recipe = train.recipe_from_dict(summary["recipe"])
    corpus = data.stdlib_corpus(recipe.corpus_bytes)
    if corpus.sha256 != summary["corpus"]["sha256"]:
        pytest.skip(f"this Python's stdlib ({corpus.root}) is not the one the pair was trained on")
    threads = torch.get_num_threads()
    torch.set_num_threads(summary["target"].get("torch_threads", summary["torch_threads"]))
    try:
        again = train.run(tmp_path, summary["seed"], "cpu", recipe, stop_after=recipe.log_every)
    finally:
        torch.set_num_threads(threads)
    want = summary["target"]["losses"][:2]
    assert [s for s, _ in want] == [1, recipe.log_every]
    assert again["target"]["losses"] == want


def test_committed_pair_speculates_on_predictable_text():
    from specserve.demo.evaluate import commit_len, make_engine, predictable_ids

    tdir, ddir = CHECKPOINTS / train.TARGET_DIR, CHECKPOINTS / train.DRAFTER_DIR
    size = sum(f.stat().st_size for d in (tdir, ddir) for f in d.iterdir())
    assert size <= 20 << 20
    raw = json.loads((tdir / "config.json").read_text())
    assert set(raw["layer_types"]) == {"sliding_attention"} and raw["use_sliding_window"]
    assert raw["max_position_embeddings"] >= 131072
    engine = make_engine(tdir, ddir, max_context=1024 + 64, budget=16)
    r = commit_len(engine, predictable_ids(engine.tokenizer, 1024), new_tokens=64, budget=16)
    # an untrained drafter commits ~1.0 per step; this pair 7.00 (issue 8 asks > 3 on CPU)
    assert r["mean_commit_len"] > 3, r["mean_commit_len"]
    assert engine.blocks.num_used_pages == 0
    text = engine.tokenizer.decode(r["tokens"])
    assert "The cat sat on the mat." in text  # the target itself continues the phrase


def test_all_sliding_target_is_windowed_in_transformers_and_the_engine(tmp_path, make_engine):
    """The long-context recipe rests on this: with every layer windowed, tokens further back
    than layers × (window − 1) cannot matter — in transformers and in our engine alike."""
    import torch
    import transformers

    from specserve.demo.target import TargetShape, hf_config
    from specserve.types import SamplingParams
    from tests.helpers import hf_greedy

    shape = TargetShape(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=96,
                        window=8)
    cfg = hf_config(shape, 97)
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(1, 97, (1, 40))
    first_seen = 39 - shape.layers * (shape.window - 1)  # the last token's receptive field
    far, near = ids.clone(), ids.clone()
    far[0, :first_seen] = (far[0, :first_seen] + 1) % 96 + 1
    near[0, first_seen] = near[0, first_seen] % 96 + 1
    with torch.no_grad():
        last = [model(input_ids=x).logits[0, -1] for x in (ids, far, near)]
    torch.testing.assert_close(last[0], last[1], rtol=0, atol=1e-5)
    assert (last[0] - last[2]).abs().max() > 1e-3

    engine = make_engine(tmp_path)
    assert engine.model_config.layer_types == ("sliding_attention",) * 2
    assert engine.model_config.sliding_window == 8
    prompt = ids[0].tolist()
    got = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert got == hf_greedy(model, prompt, 16)
