"""The demo target: a tiny Qwen3 (transformers' `Qwen3ForCausalLM`) whose every layer is
sliding-window attention, so that it computes the same function at position 128k as at 1k.

RoPE attention scores depend only on the query–key distance, and with ALL layers windowed a
token never sees further back than `layers × (window − 1)` positions: the network's output at
any position is a function of that many preceding tokens and their relative offsets, all of
which training (sequences of twice the window) covers. No absolute position ever enters.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.demo.data import EOS, MASK

MAX_POSITIONS = 262144  # well past the probe's 128k context (the model has no absolute positions)


@dataclass(frozen=True)
class TargetShape:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 768
    window: int = 256  # every layer: a query sees keys at distance < window
    rope_theta: float = 10000.0


QUICK_TARGET = TargetShape(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32,
                           intermediate=128, window=32)


def hf_config(shape: TargetShape, vocab_size: int):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        use_sliding_window=True, sliding_window=shape.window, max_window_layers=0,
        layer_types=["sliding_attention"] * shape.layers, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.02)


def build_target(shape: TargetShape, vocab_size: int, seed: int, device: str):
    """A freshly initialised fp32 target (seeded), in train mode, on `device`."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(hf_config(shape, vocab_size))
    model.config.architectures = ["Qwen3ForCausalLM"]
    return model.to(device).train()


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of `ids [B, S]`."""
    logits = model(input_ids=ids).logits  # [B, S, V]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def save_target(model, tokenizer, out_dir: Path) -> None:
    """HF format in bfloat16 (`save_pretrained`), plus tokenizer.json and tokenizer_config.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = copy.deepcopy(model).to("cpu", torch.bfloat16).eval()
    bf16.config.architectures = ["Qwen3ForCausalLM"]
    import transformers

    transformers.utils.logging.disable_progress_bar()  # plain progress lines only
    bf16.save_pretrained(out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
        "additional_special_tokens": [MASK], "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")


def taps(model, ids: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad target pass: outputs of decoder `layers` (before the final norm, as the engine
    taps them) concatenated `[B, S, len(layers) * hidden]`, and greedy next tokens `[B, S]`."""
    caught: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda _m, _a, out, i=i: caught.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layers]
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([caught[i] for i in layers], dim=-1), logits.argmax(-1)
