"""bench/bench_served.py: a random target + DFlash drafter pair written as real checkpoints.

The services load models from directories, so the benchmark writes one: an HF Qwen3 target
(config.json, sharded safetensors with an index, the demo pair's tokenizer) and a z-lab DFlash
drafter (config.json with `dflash_config`, safetensors), N(0, std) weights drawn on `device`
from a seeded generator (norms 1), one layer at a time. Benchmark-only code.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.demo import DEMO_TARGET

# the shape: the Qwen3-8B body with the demo tokenizer's vocabulary, full attention
BODY_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=4096)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=4096)
TAPS_8B = (1, 9, 17, 25, 33)
DRAFT_LAYERS = 5


def _target_config(shape: dict) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **shape,
            "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144, "rope_parameters": {"rope_type": "default",
                                                                   "rope_theta": 1e6},
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
            "layer_types": ["full_attention"] * shape["num_hidden_layers"],
            "use_sliding_window": False, "dtype": "bfloat16"}


def _draft_config(shape: dict, taps: tuple[int, ...]) -> dict:
    cfg = _target_config(shape)
    cfg.update(architectures=["DFlashDraftModel"], num_hidden_layers=DRAFT_LAYERS,
               layer_types=["full_attention"] * DRAFT_LAYERS, block_size=16,
               num_target_layers=shape["num_hidden_layers"],
               dflash_config={"mask_token_id": shape["vocab_size"] - 1,
                              "target_layer_ids": list(taps)})
    return cfg


def _layer_tensors(prefix: str, s: dict) -> dict[str, tuple[int, ...]]:
    h, q, kv, d = (s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"],
                   s["head_dim"])
    out = {f"{prefix}.self_attn.q_proj.weight": (q * d, h),
           f"{prefix}.self_attn.k_proj.weight": (kv * d, h),
           f"{prefix}.self_attn.v_proj.weight": (kv * d, h),
           f"{prefix}.self_attn.o_proj.weight": (h, q * d),
           f"{prefix}.self_attn.q_norm.weight": (d,), f"{prefix}.self_attn.k_norm.weight": (d,),
           f"{prefix}.mlp.gate_proj.weight": (s["intermediate_size"], h),
           f"{prefix}.mlp.up_proj.weight": (s["intermediate_size"], h),
           f"{prefix}.mlp.down_proj.weight": (h, s["intermediate_size"]),
           f"{prefix}.input_layernorm.weight": (h,),
           f"{prefix}.post_attention_layernorm.weight": (h,)}
    return out


def _draw(shapes: dict, gen: torch.Generator, device, std: float) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, std, generator=gen)
        out[name] = t.cpu()
    return out


def write_pair(root: Path, shape: dict = BODY_8B, taps: tuple[int, ...] = TAPS_8B,
               device: str = "cuda", seed: int = 0, std: float = 0.02, log=print
               ) -> tuple[Path, Path]:
    """Write (target dir, drafter dir) under `root` (kept if already complete)."""
    target, drafter = root / "target", root / "drafter"
    if (target / "done").exists() and (drafter / "done").exists():
        return target, drafter
    t0 = time.time()
    for d in (target, drafter):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, v = shape["hidden_size"], shape["vocab_size"]
    weight_map = {}
    shards = [("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")] + \
        list(range(shape["num_hidden_layers"]))
    for i, shard in enumerate(shards):
        if isinstance(shard, tuple):
            shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                      "model.norm.weight": (h,)}
        else:
            shapes = _layer_tensors(f"model.layers.{shard}", shape)
        file = f"model-{i:05d}.safetensors"
        save_file(_draw(shapes, gen, device, std), str(target / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shapes, file))
    (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (target / "config.json").write_text(json.dumps(_target_config(shape), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TARGET / name, target / name)
    shapes = {"fc.weight": (h, len(taps) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for layer in range(DRAFT_LAYERS):
        shapes.update(_layer_tensors(f"layers.{layer}", shape))
    save_file(_draw(shapes, gen, device, std), str(drafter / "model.safetensors"),
              metadata={"format": "pt"})
    (drafter / "config.json").write_text(json.dumps(_draft_config(shape, taps), indent=1))
    for d in (target, drafter):
        (d / "done").touch()
    log(f"wrote the random pair to {root} in {time.time() - t0:.1f} s")
    return target, drafter
