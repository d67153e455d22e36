"""A wrong checkpoint is a clear ModelError before anything runs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.errors import ModelError
from specserve.models.config import load_config
from specserve.models.loader import load_model


def _copy(src, dst):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    return load_file(src / "model.safetensors")


def test_unsupported_architecture(tmp_path, checkpoint_cache):
    src, _ = checkpoint_cache("qwen3-gqa1-tied")
    raw = json.loads((src / "config.json").read_text())
    raw["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="unsupported architecture.*Mamba"):
        load_config(tmp_path)


def test_missing_config_and_weights(tmp_path, checkpoint_cache):
    with pytest.raises(ModelError, match="no config.json"):
        load_model(tmp_path)
    src, _ = checkpoint_cache("qwen3-gqa1-tied")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ModelError, match="no model.safetensors"):
        load_model(tmp_path)


def test_missing_tensor_is_named(tmp_path, checkpoint_cache):
    src, _ = checkpoint_cache("qwen3-gqa4-yarn")
    tensors = _copy(src, tmp_path / "m")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(tmp_path / "m")


def test_misshaped_tensor_is_named(tmp_path, checkpoint_cache):
    src, _ = checkpoint_cache("llama-gqa4-llama3")
    tensors = _copy(src, tmp_path / "m")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(7, 5)
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelError, match=r"up_proj\.weight has shape \(7, 5\)"):
        load_model(tmp_path / "m")


def test_unsupported_rope_and_missing_key(tmp_path, checkpoint_cache):
    src, _ = checkpoint_cache("qwen3-gqa1-tied")
    raw = json.loads((src / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="unsupported rope_type 'longrope'"):
        load_config(tmp_path)
    del raw["rope_parameters"]
    del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="missing required key 'hidden_size'"):
        load_config(tmp_path)


def test_a_tensor_the_model_would_not_read_is_named(tmp_path, checkpoint_cache):
    """A bias of a kind this config does not build is an error, never silently dropped; the
    rotary buffers old checkpoints carry are fine."""
    src, _ = checkpoint_cache("llama-gqa4-llama3")
    tensors = _copy(src, tmp_path / "m")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(1.0, 9.0)
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    load_model(tmp_path / "m")
    tensors["model.layers.2.mlp.down_proj.bias"] = torch.randn(96)
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    with pytest.raises(ModelError, match=r"does not use.*model\.layers\.2\.mlp\.down_proj\.bias"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("key,value,words", [
    ("hidden_act", "gelu", "hidden_act 'gelu' is not implemented"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
    ("quantization_config", {"quant_method": "awq"}, "quantization_config"),
    ("layer_types", ["full_attention", "chunked_attention", "full_attention"],
     "chunked_attention"),
])
def test_a_setting_that_is_not_implemented_is_named(tmp_path, checkpoint_cache, key, value,
                                                     words):
    src, _ = checkpoint_cache("qwen3-gqa1-tied")
    raw = json.loads((src / "config.json").read_text())
    raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match=words):
        load_config(tmp_path)


def test_generation_config_adds_its_eos_ids(tmp_path, checkpoint_cache, make_engine):
    """Instruct checkpoints list end-of-turn ids in generation_config.json: generation stops
    at any of them."""
    src, _ = checkpoint_cache("qwen3-gqa1-tied")
    tensors = _copy(src, tmp_path / "m")
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    free = make_engine(tmp_path / "m").generate([[5, 9, 13]], _greedy(12))[0]
    stop = free[4]
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [7777, stop], "do_sample": False}))
    cfg = load_config(tmp_path / "m")
    assert stop in cfg.eos_token_ids and 7777 in cfg.eos_token_ids
    got = make_engine(tmp_path / "m").generate([[5, 9, 13]], _greedy(12, eos=True))[0]
    assert got == free[: free.index(stop) + 1]


def _greedy(n: int, eos: bool = False):
    from specserve.types import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=not eos)


def test_the_older_qwen3_sliding_layout_is_read_as_transformers_reads_it(tmp_path,
                                                                        make_engine):
    """`use_sliding_window` + `max_window_layers` without `layer_types`: layers from
    max_window_layers on slide; greedy output equals transformers'."""
    import transformers

    from tests.helpers import hf_config, hf_greedy, random_prompts

    cfg = hf_config("qwen3-gqa1-tied", use_sliding_window=True, sliding_window=6,
                    max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    torch.manual_seed(3)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["layer_types"]  # the older layout
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_config(tmp_path)
    assert ours.layer_types == tuple(cfg.layer_types) and ours.sliding_window == 6
    prompts = random_prompts(3, cfg.vocab_size, [19, 4, 27], seed=2)
    engine = make_engine(tmp_path)
    assert engine.generate(prompts, _greedy(20)) == [hf_greedy(hf, p, 20) for p in prompts]
    raw["use_sliding_window"] = False  # a window given but switched off: every layer full
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path).layer_types == () and load_config(tmp_path).sliding_window \
        is None


def test_generation_config_sampling_defaults(tmp_path):
    """As transformers' generate reads generation_config.json: its sampling values only with
    do_sample (top_k 50 when unset, 0 = none); a request's own values win, top_k 0 = no cut."""
    from services.common.convert import sampling_from_pb
    from specserve.models.generation_config import GenerationDefaults, load_generation_defaults
    from specserve.v1 import common_pb2

    assert load_generation_defaults(tmp_path) == GenerationDefaults()
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))  # no do_sample: greedy
    assert load_generation_defaults(tmp_path) == GenerationDefaults()
    gen.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95}))
    assert load_generation_defaults(tmp_path) == GenerationDefaults(0.6, 0.95, 50)
    gen.write_text(json.dumps({"do_sample": True, "top_k": 0}))
    d = load_generation_defaults(tmp_path)
    assert d == GenerationDefaults(1.0, 1.0, None)
    qwen = GenerationDefaults(0.6, 0.95, 20)
    unset = common_pb2.SamplingParams(max_tokens=9)
    got = sampling_from_pb(unset, qwen)
    assert (got.temperature, got.top_p, got.top_k) == (pytest.approx(0.6), pytest.approx(0.95),
                                                       20)
    mine = common_pb2.SamplingParams(max_tokens=9, temperature=0.0, top_k=0, top_p=1.0)
    got = sampling_from_pb(mine, qwen)
    assert (got.temperature, got.top_p, got.top_k, got.greedy) == (0.0, 1.0, None, True)
    assert sampling_from_pb(unset).greedy  # no defaults: greedy


@pytest.mark.parametrize("bad", [{"temperature": -0.3}, {"top_p": 1.7}, {"top_p": 0},
                                 {"temperature": float("inf")}])
def test_generation_config_out_of_range_is_refused(tmp_path, bad):
    """A generation_config.json whose sampling values no request could take is refused at
    load, naming the file and the value, not carried into every request that leaves them unset."""
    from specserve.models.generation_config import load_generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, **bad}))
    key = next(iter(bad))
    with pytest.raises(ModelError, match=f"generation_config.json is not valid: {key}"):
        load_generation_defaults(tmp_path)


@pytest.mark.parametrize("setting", [{"repetition_penalty": 1.05}, {"min_p": 0.05},
                                     {"no_repeat_ngram_size": 3}, {"bad_words_ids": [[5]]},
                                     {"num_beams": 4}, {"suppress_tokens": [1, 2]}])
def test_a_generation_setting_specserve_does_not_implement_is_refused(tmp_path, setting):
    """transformers' generate applies it (greedy or not), so serving the file's defaults without
    it would silently differ: refused at load, naming it and the way out; --generation-config
    none serves the model greedy by default without the file's sampling."""
    from specserve.models.generation_config import GenerationDefaults, load_generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, **setting}))
    key = next(iter(setting))
    with pytest.raises(ModelError, match=f"sets {key}=.*not implemented.*--generation-config "
                                         "none"):
        load_generation_defaults(tmp_path)
    assert load_generation_defaults(tmp_path, "none") == GenerationDefaults()
    with pytest.raises(ValueError, match="generation_config must be one of"):
        load_generation_defaults(tmp_path, "off")


def test_transformers_defaults_of_the_refused_settings_are_neutral(tmp_path):
    """Every setting the check refuses, at transformers' own GenerationConfig default (what a
    checkpoint's file often spells out), is taken as doing nothing."""
    transformers = pytest.importorskip("transformers")
    from specserve.models.generation_config import NOT_IMPLEMENTED, load_generation_defaults

    defaults = transformers.GenerationConfig()
    written = {k: getattr(defaults, k) for k in NOT_IMPLEMENTED if hasattr(defaults, k)}
    assert len(written) >= 15  # most of them are transformers' fields by these names
    written.update({"repetition_penalty": 1, "min_p": 0, "num_beams": 1.0})  # ints / floats
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "top_k": 20, **written}))
    assert load_generation_defaults(tmp_path).top_k == 20
