"""The demo target: a tiny Qwen3 (transformers' `Qwen3ForCausalLM`) whose every layer is
sliding-window attention, so that it computes the same function at position 128k as at 1k.

RoPE attention scores depend only on the query–key distance, and with ALL layers windowed a
token never sees further back than `layers × (window − 1)` positions: the network's output at
any position is a function of that many preceding tokens and their per-layer offsets (< window).
No absolute position ever enters. The `full` recipe's 512-token sequences cover every offset a
window holds; the `cpu` recipe's 128-token ones only offsets < 128.
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
    kv_heads: int = 4  # one K/V per head: the supervised circuit heads do not share keys
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
    """A freshly initialised fp32 target (seeded), in train mode, on `device`, with eager
    attention (training reads its attention maps; the saved config does not keep that)."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(shape, vocab_size)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(cfg)
    model.config.architectures = ["Qwen3ForCausalLM"]
    return model.to(device).train()


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of `ids [B, S]`."""
    logits = model(input_ids=ids).logits  # [B, S, V]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


# (layer, head, kind, d): "prev" attends from t to t−d; "induction" from t to j+d, where j < t
# is the latest earlier occurrence of token t (in repeated text, j+d holds token t+d).
Circuit = tuple[int, int, str, int]
# Layer 0: tokens t−1…t−4; layer 1: t+1…t+4; layer 2 head 0: t−4's view (tokens t−5…t−8);
# layer 3: t+5…t+8 — so the last layer at t holds the 8 tokens after it on repeated text.
COPY_CIRCUITS: tuple[Circuit, ...] = (
    *((0, h, "prev", h + 1) for h in range(4)), *((1, h, "induction", h + 1) for h in range(4)),
    (2, 0, "prev", 4), *((3, h, "induction", h + 5) for h in range(4)))


def circuit_loss(attentions, ids: torch.Tensor, circuits) -> torch.Tensor:
    """Attention supervision that installs copying: mean −log of the attention each
    (layer, head) puts on its circuit's key position, over the positions where it exists.
    `attentions`: per layer `[B, H, S, S]`; `ids [B, S]`."""
    b, s = ids.shape
    t = torch.arange(s, device=ids.device)
    earlier = (ids[:, :, None] == ids[:, None, :]) & (t[:, None] > t[None, :])  # [B, t, j]
    last = torch.where(earlier, t, -1).amax(-1)  # [B, S]: j, or −1 where none
    terms = []
    for layer, head, kind, d in circuits:
        if kind == "prev":
            key, ok = (t - d).expand(b, s), (t >= d).expand(b, s)
        else:
            key = last + d
            ok = (last >= 0) & (key <= t)
        if ok.any():
            p = attentions[layer][:, head].gather(2, key.clamp(0, s - 1)[..., None])
            terms.append(torch.log(p.squeeze(-1)[ok] + 1e-9).mean())
    return -torch.stack(terms).mean()


class TargetObjective(torch.nn.Module):
    """The target's training loss: next-token cross-entropy + `circuit_weight` × the attention
    supervision of `circuit_loss` (copying forms in ~100 steps instead of thousands: small
    RoPE + q/k-norm models find a previous-token head late) + `lookahead_weight` × the loss of
    training-only multi-token heads (never saved): from the final hidden state `h_t` predict
    token t+1+i as `lm_head(h_t + W_i h_t)`, i = 1 … n. Those make the last layer carry what
    comes after the next token — the lookahead the DFlash drafter reads from its taps (large
    LMs have it without asking; a 4M model trained for minutes does not)."""

    def __init__(self, hidden: int, lookahead: int, circuits, circuit_weight: float,
                 lookahead_weight: float, seed: int, sample: int = 256) -> None:
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden, bias=False)
                                        for _ in range(lookahead))
        for lin in self.proj:
            torch.nn.init.zeros_(lin.weight)  # starts as the next-token head
        self.circuits, self.circuit_weight = tuple(map(tuple, circuits)), circuit_weight
        self.lookahead_weight, self.sample = lookahead_weight, sample
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        out = model.model(input_ids=ids, output_attentions=bool(self.circuits))
        h = out.last_hidden_state  # [B, S, H] (after the final norm)
        lm = F.cross_entropy(model.lm_head(h)[:, :-1].flatten(0, 1).float(),
                             ids[:, 1:].flatten())
        loss, logs = lm, {"lm": float(lm.detach())}
        if self.circuits:
            circ = circuit_loss(out.attentions, ids, self.circuits)
            loss = loss + self.circuit_weight * circ
            logs["circuit"] = float(circ.detach())
        if len(self.proj):
            ahead = torch.stack([self._ahead(model, h, ids, i, lin)
                                 for i, lin in enumerate(self.proj, start=1)]).mean()
            loss = loss + self.lookahead_weight * ahead
            logs["ahead"] = float(ahead.detach())
        return loss, logs

    def _ahead(self, model, h, ids, i: int, lin) -> torch.Tensor:
        """Cross-entropy of head i on `sample` random positions (the LM-head products are
        the cost, so they are subsampled)."""
        b, s, _ = h.shape
        flat = torch.randint(0, b * (s - 1 - i), (self.sample,), generator=self.gen)
        row = (flat // (s - 1 - i)).to(h.device)
        col = (flat % (s - 1 - i)).to(h.device)
        hs = h[row, col]  # [sample, H]
        return F.cross_entropy(model.lm_head(hs + lin(hs)).float(), ids[row, col + 1 + i])


# the demo pair's chat template: system text, then "Q: …" / "A: …" lines; generation opens "A:"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] in ('system', 'developer') %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}Q: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}A: {{ message['content'] }}{{ eos_token }}\n"
    "{% else %}{{ raise_exception('the demo template takes system, user and assistant "
    "messages') }}{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")


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
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE},
        indent=2) + "\n")


def taps(model, ids: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """No-grad target pass: transformers' `hidden_states[i + 1]` of each of `layers` (a layer's
    output; the last layer's after the final norm, as the engine and `dflash` tap them)
    concatenated `[B, S, len(layers) * hidden]`, and greedy next tokens `[B, S]`."""
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1), out.logits.argmax(-1)
