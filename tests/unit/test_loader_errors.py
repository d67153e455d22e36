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
