"""Model configuration parsed from a Hugging Face `config.json` (Qwen3 and the Llama family).

Owns the mapping from HF keys (both the transformers-4 `rope_scaling`/`rope_theta` spelling and the
transformers-5 `rope_parameters` spelling) to one frozen, validated `ModelConfig`, the way
transformers reads them: which projections have biases per architecture (`attention_bias` biases
o_proj too for Llama and Qwen3, Qwen2 always biases q/k/v only, `mlp_bias` is Llama's), the layer
types of the older Qwen2/Qwen3 layout (`use_sliding_window` + `max_window_layers`), and the EOS
ids of `generation_config.json` beside `config.json`. Unsupported architectures and settings this
engine does not implement are a `ModelError` here, naming them, before any tensor is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specserve.errors import ModelError

# architecture name -> q/k RMSNorm per head
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "Qwen3ForCausalLM": True,
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": False,
}
ROPE_TYPES = ("default", "linear", "yarn", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")
# settings that change the model's function and are not implemented here (None / default: fine)
UNIMPLEMENTED = {"final_logit_softcapping": None, "attn_logit_softcapping": None,
                 "quantization_config": None, "partial_rotary_factor": 1.0,
                 "num_experts": None, "num_local_experts": None}


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ModelError(f"unsupported rope_type {self.rope_type!r}; supported: {ROPE_TYPES}")
        if self.theta <= 0 or self.factor <= 0:
            raise ModelError(
                f"rope theta and factor must be positive ({self.theta}, {self.factor})"
            )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool  # q/k/v biases
    rope: RopeConfig = field(default_factory=RopeConfig)
    o_proj_bias: bool = False
    mlp_bias: bool = False  # gate/up/down biases
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # "full_attention" | "sliding_attention" per layer
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ModelError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if any(t not in LAYER_TYPES for t in self.layer_types):
            raise ModelError(f"layer_types {sorted(set(self.layer_types) - set(LAYER_TYPES))} "
                             f"are not implemented (only {LAYER_TYPES})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ModelError("sliding_attention layers need a positive sliding_window")

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    original = params.get("original_max_position_embeddings")
    if rope_type in ("yarn", "llama3") and original is None:
        original = raw.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    known = {f for f in RopeConfig.__dataclass_fields__} - {"rope_type", "theta"}
    extra = {k: params[k] for k in known if params.get(k) is not None}
    extra["original_max_position_embeddings"] = original
    if rope_type == "yarn" and params.get("factor") is None and original:
        extra["factor"] = raw["max_position_embeddings"] / original
    return RopeConfig(rope_type=rope_type, theta=float(theta), **extra)


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _biases(arch: str, raw: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v, o_proj, MLP) biases as transformers builds them for `arch`."""
    if arch == "Qwen2ForCausalLM":
        return True, False, False
    if arch == "MistralForCausalLM":
        return False, False, False
    attn = bool(raw.get("attention_bias", False))
    return attn, attn, arch == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False))


def _layers(arch: str, raw: dict[str, Any]) -> tuple[tuple[str, ...], int | None]:
    """(layer types, sliding window) as transformers derives them."""
    n, window = int(raw["num_hidden_layers"]), raw.get("sliding_window")
    layer_types = tuple(raw.get("layer_types") or ())
    if arch == "MistralForCausalLM":
        return (("sliding_attention",) * n if window else ()), window
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = window if raw.get("use_sliding_window", False) else None
        if not layer_types:  # the older layout: sliding from max_window_layers on
            first = int(raw.get("max_window_layers", 28))
            layer_types = tuple("sliding_attention" if window is not None and i >= first
                                else "full_attention" for i in range(n))
        if window is None:  # transformers: no window, so every layer attends fully
            layer_types = ()
    return layer_types, window if "sliding_attention" in layer_types else None


def _refuse_unimplemented(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelError(f"hidden_act {act!r} is not implemented (only silu)")
    for key, fine in UNIMPLEMENTED.items():
        value = raw.get(key)
        if value is not None and value != fine:
            raise ModelError(f"config.json sets {key}={value!r}, which is not implemented")
    odd = sorted(set(raw.get("layer_types") or ()) - set(LAYER_TYPES))
    if odd:
        raise ModelError(f"layer_types {odd} are not implemented (only {LAYER_TYPES})")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelError(f"partial_rotary_factor {rope['partial_rotary_factor']} is not "
                         "implemented")


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    _refuse_unimplemented(raw)
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        layer_types, window = _layers(arch, raw)
        qkv_bias, o_bias, mlp_bias = _biases(arch, raw)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=SUPPORTED_ARCHITECTURES[arch],
            attention_bias=qkv_bias, o_proj_bias=o_bias, mlp_bias=mlp_bias,
            rope=parse_rope(raw),
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            eos_token_ids=_eos_ids(raw),
        )
    except KeyError as e:
        raise ModelError(f"config.json is missing required key {e.args[0]!r}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"no config.json in {model_dir}") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from None
    cfg = parse_config(raw)
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():  # instruct checkpoints list their end-of-turn ids here
        try:
            extra = _eos_ids(json.loads(gen.read_text()))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ModelError(f"{gen} is not valid: {e}") from None
        cfg = replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + extra)))
    return cfg
