"""Text in, text out: tokenizer, incremental detokenization and stop strings through the engine."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from specserve.types import FinishReason, SamplingParams
from tests.helpers import hf_config
from tests.unit.test_tokenizer import CORPUS


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory):
    import transformers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(CORPUS * 3, trainer)
    root = tmp_path_factory.mktemp("textmodel")
    hf.save(str(root / "tokenizer.json"))
    torch.manual_seed(4)
    model = transformers.Qwen3ForCausalLM(hf_config("qwen3-gqa1-tied", vocab_size=400)).eval()
    model.save_pretrained(root)
    return root


def _run(engine, prompt, params):
    engine.add_request("t", prompt, params)
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    return outs


def test_text_deltas_equal_full_decode(text_model_dir, make_engine):
    engine = make_engine(text_model_dir)
    prompt = "Speculative decoding drafts tokens: 我们今天学习 😀"
    outs = _run(engine, prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                               ignore_eos=True))
    ids = [t for o in outs for t in o.new_token_ids]
    text = "".join(o.text_delta for o in outs)
    assert len(ids) == 40 and text == engine.tokenizer.decode(ids)
    assert outs[0].num_prompt_tokens == len(engine.tokenizer.encode(prompt))


def test_stop_string_cuts_text(text_model_dir, make_engine):
    engine = make_engine(text_model_dir)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True)
    full = "".join(o.text_delta for o in _run(engine, "The quick brown", params))
    start = next(i for i in range(6, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    outs = _run(engine, "The quick brown", SamplingParams(
        max_tokens=40, temperature=1.0, seed=5, ignore_eos=True, stop=(stop,)))
    assert "".join(o.text_delta for o in outs) == full[: full.index(stop)]
    assert outs[-1].finish_reason is FinishReason.STOP
