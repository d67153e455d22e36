"""The DFlash drafter's config: `DFlashConfig`, parsed from a z-lab checkpoint's config.json with
the reference's defaults (`parse_dflash_config`, `load_dflash_config`), and the default choice of
target tap layers (`build_target_layer_ids`). The model and its loading: `models/dflash.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specserve.errors import ModelError
from specserve.models.config import RopeConfig, parse_rope

ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default taps: spread from layer 1 to layer N−3 (N//2 for one tap)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    block_size: int
    target_layer_ids: tuple[int, ...]  # target decoder layers whose outputs are the features
    mask_token_id: int
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention" per layer
    causal: tuple[bool, ...]  # per layer: causal among the block (else bidirectional)
    num_target_layers: int | None = None
    sliding_window: int | None = None  # None: sliding layers have no window (reference rule)
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ModelError(f"drafter {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(f"num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        if not self.target_layer_ids:
            raise ModelError("drafter config has no target_layer_ids")
        limit = self.num_target_layers
        if min(self.target_layer_ids) < 0 or (limit and max(self.target_layer_ids) >= limit):
            raise ModelError(f"target_layer_ids {list(self.target_layer_ids)} out of range for "
                             f"{limit} target layers")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ModelError(f"mask_token_id {self.mask_token_id} outside the vocabulary "
                             f"({self.vocab_size})")
        if len(self.layer_types) != self.num_layers or len(self.causal) != self.num_layers:
            raise ModelError(f"layer_types / causal need {self.num_layers} entries, got "
                             f"{len(self.layer_types)} / {len(self.causal)}")
        if set(self.layer_types) - set(LAYER_TYPES):
            raise ModelError(f"unsupported layer_types {sorted(set(self.layer_types))}; "
                             f"supported: {LAYER_TYPES}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelError(f"sliding_window must be positive, got {self.sliding_window}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` on absolute positions, or None (full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def _attention_layout(raw: dict[str, Any], layers: int) -> tuple[tuple[str, ...], ...]:
    """Layer types, per-layer causality and the window in force, by the reference's rules."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    first_sliding = int(raw.get("max_window_layers", 28))  # transformers' Qwen3Config default
    types = tuple(raw.get("layer_types") or (
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
        for i in range(layers)))
    is_causal = raw.get("is_causal")
    causal = tuple(t == "sliding_attention" if is_causal is None else bool(is_causal)
                   for t in types)
    return types, causal, window


def _check_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """Reject other architectures; returns the `dflash_config` object (may be empty)."""
    archs = raw.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ModelError(f"unsupported drafter architecture {archs or raw.get('model_type')!r}; "
                         f"expected {ARCHITECTURE!r}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelError(f"unsupported hidden_act {raw['hidden_act']!r}; expected 'silu'")
    draft = raw.get("dflash_config") or {}
    if not isinstance(draft, dict):
        raise ModelError(f"dflash_config must be an object, got {type(draft).__name__}")
    return draft


def parse_dflash_config(raw: dict[str, Any]) -> DFlashConfig:
    """Parse a drafter config.json. `dflash_config.*` wins over the same top-level key.

    As in the reference (transformers' Qwen3Config), `sliding_window` is only in force when
    `use_sliding_window` is true; a layer is causal iff it is a sliding layer, unless a top-level
    `is_causal` sets every layer.
    """
    draft = _check_raw(raw)

    def value(name: str, default: Any = None) -> Any:
        return draft.get(name, raw.get(name, default))

    try:
        layers, heads, hidden = (int(raw[k]) for k in (
            "num_hidden_layers", "num_attention_heads", "hidden_size"))
        targets, taps, softcap = (raw.get("num_target_layers"), value("target_layer_ids"),
                                  value("final_logit_softcapping"))
        if taps is None:
            taps = build_target_layer_ids(int(raw["num_target_layers"]), layers)
        if value("mask_token_id") is None:
            raise ModelError("drafter config.json is missing required key 'mask_token_id'")
        types, causal, window = _attention_layout(raw, layers)
        return DFlashConfig(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]), num_layers=layers, num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            block_size=int(value("block_size", 16)), target_layer_ids=tuple(int(t) for t in taps),
            mask_token_id=int(value("mask_token_id")), layer_types=types, causal=causal,
            num_target_layers=int(targets) if targets is not None else None,
            sliding_window=int(window) if window is not None else None, rope=parse_rope(raw),
            attention_bias=bool(raw.get("attention_bias", False)),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None)
    except KeyError as e:
        raise ModelError(f"drafter config.json is missing required key {e.args[0]!r}") from None


def read_config_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"no config.json in {path.parent}") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path} is not valid JSON: {e}") from None


def load_dflash_config(draft_dir: str | Path) -> DFlashConfig:
    return parse_dflash_config(read_config_json(Path(draft_dir) / "config.json"))
