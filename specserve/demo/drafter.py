"""The demo DFlash drafter and its training forward (ddtree_dflash.md A5).

Shape mirrors the seed's drafter: sliding-window layers (causal within the block, as the z-lab
reference treats sliding layers) and a final full-attention layer (bidirectional), one YaRN
rotary embedding, block size 16, the target's hidden size and heads. The module trained IS
`specserve.models.dflash.DFlashDraftModel` — the inference model — driven with a dense-mask
`attend` callback, so training and serving share every line of math (fc + hidden_norm fusion,
k_norm, RoPE/YaRN, GQA, the final norm, the target's LM head).

One training step: the frozen target runs once over a batch of sequences (taps + its greedy
next tokens, the labels — the analogue of A5's target-regenerated responses); random anchors
per sequence; each anchor's block is `[token at anchor, MASK × 15]` at positions anchor..+15;
a block query sees the fused target features of positions strictly before its anchor (within
the window on sliding layers) and its own block (no cross-block attention); cross-entropy on the
15 predicted slots weighted `exp(−(k−1)/γ)`, γ = 7. The target's embedding and LM head are used,
never trained. Half the sequences get their positions split by a random gap (PoSE-style), so the
full-attention layer also learns query–key distances up to the 128k the probe goes to.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specserve.demo.target import MAX_POSITIONS, TargetShape, taps
from specserve.models.dflash import NOT_IN_CHECKPOINT, DFlashDraftModel
from specserve.models.dflash_config import parse_dflash_config


@dataclass(frozen=True)
class DrafterShape:
    layers: int = 3  # layers − 1 sliding, then one full-attention layer
    intermediate: int = 768
    window: int = 256
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = (1, 3)
    yarn_factor: float = 64.0
    yarn_original: int = 4096  # factor × original = MAX_POSITIONS, as the seed's 64 × 4096
    anchors: int = 32  # blocks per training sequence
    gamma: float = 7.0
    gap_frac: float = 0.5  # sequences whose positions are split by a random gap
    read_last: float = 1.0  # supervision weight: layer 0 head 0 reads position anchor−1
    read_match: float = 0.0  # supervision weight: layer 1 head 0 reads the copy source (below;
    # off: in a 1200-step CPU run it did not raise commit_len)


QUICK_DRAFTER = DrafterShape(layers=2, intermediate=128, window=32, target_layer_ids=(0, 1),
                             anchors=4)


def drafter_config(shape: DrafterShape, target: TargetShape, vocab_size: int,
                   mask_token_id: int) -> dict:
    """config.json in the z-lab DFlashDraftModel format."""
    rope = {"rope_type": "yarn", "rope_theta": target.rope_theta, "factor": shape.yarn_factor,
            "original_max_position_embeddings": shape.yarn_original}
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "block_size": shape.block_size, "num_target_layers": target.layers,
        "dflash_config": {"mask_token_id": mask_token_id,
                          "target_layer_ids": list(shape.target_layer_ids)},
        "hidden_size": target.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": target.heads,
        "num_key_value_heads": target.kv_heads, "head_dim": target.head_dim,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rms_norm_eps": 1e-6, "rope_theta": target.rope_theta, "rope_parameters": rope,
        "max_position_embeddings": MAX_POSITIONS,
        "layer_types": ["sliding_attention"] * (shape.layers - 1) + ["full_attention"],
        "use_sliding_window": True, "sliding_window": shape.window, "max_window_layers": 0,
        "vocab_size": vocab_size, "tie_word_embeddings": False, "dtype": "bfloat16",
    }


def build_drafter(raw_config: dict, target, seed: int, device: str) -> DFlashDraftModel:
    """A seeded fresh drafter whose `embed`/`lm_head` ARE the (frozen) target's tensors."""
    torch.manual_seed(seed)
    model = DFlashDraftModel(parse_dflash_config(raw_config))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    target.requires_grad_(False)
    model.embed.weight = target.model.embed_tokens.weight
    model.lm_head.weight = target.lm_head.weight
    return model.to(device).train()


def trainable(model: DFlashDraftModel) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if n not in NOT_IN_CHECKPOINT]


def save_drafter(model: DFlashDraftModel, raw_config: dict, out_dir: Path) -> None:
    """config.json + model.safetensors (bf16, z-lab names, no embedding / LM head)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().to("cpu", torch.bfloat16).contiguous()
               for n, t in model.state_dict().items() if n not in NOT_IN_CHECKPOINT}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")


class DraftObjective:
    """The A5 loss of `model` on a batch, with anchors and gaps drawn from its own generator."""

    def __init__(self, model: DFlashDraftModel, target, shape: DrafterShape, seed: int) -> None:
        self.model, self.target, self.shape = model, target.eval(), shape
        self.gen = torch.Generator().manual_seed(seed)
        k = torch.arange(shape.block_size - 1, dtype=torch.float32)
        self.weights = torch.exp(-k / shape.gamma)  # slot k+1: exp(-(k+1-1)/γ)

    def _positions(self, b: int, s: int) -> torch.Tensor:  # [B, S] int64
        pos = torch.arange(s).repeat(b, 1)
        max_gap = MAX_POSITIONS - s - self.shape.block_size
        for row in range(b):
            if torch.rand((), generator=self.gen) < self.shape.gap_frac:
                split = int(torch.randint(1, s, (), generator=self.gen))
                gap = int(math.exp(float(torch.rand((), generator=self.gen)) * math.log(max_gap)))
                pos[row, split:] += gap
        return pos

    def _masks(self, anchors, blk_pos, pos, n_ctx) -> dict:
        """Visibility `[B, n·bs, S + n·bs]` per (window, causal) among the model's layers."""
        b, n, bs = blk_pos.shape
        before = torch.arange(n_ctx)[None, None, None, :] < anchors[:, :, None, None]
        dist = blk_pos[..., None] - pos[:, None, None, :]  # [B, n, bs, S]
        same = torch.eye(n, dtype=torch.bool)[:, None, :, None].expand(n, bs, n, bs)
        k = torch.arange(bs)
        out = {}
        cfg = self.model.config
        for layer in range(cfg.num_layers):
            key = (cfg.window(layer), cfg.causal[layer])
            if key in out:
                continue
            window, causal = key
            ctx = before if window is None else before & (dist < window)
            inner = (k[:, None] >= k[None, :]) if causal else torch.ones(bs, bs, dtype=torch.bool)
            if window is not None:
                inner = inner & ((k[:, None] - k[None, :]).abs() < window)
            blk = (same & inner[None, :, None, :]).reshape(n * bs, n * bs)
            out[key] = torch.cat([ctx.expand(b, n, bs, n_ctx).reshape(b, n * bs, n_ctx),
                                  blk.expand(b, n * bs, n * bs)], dim=-1)
        return out

    def draw(self, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random anchors `[B, n]` (sorted, in [1, S − bs]) and positions `[B, S]`."""
        n, bs = self.shape.anchors, self.shape.block_size
        anchors = torch.stack([torch.randperm(s - bs, generator=self.gen)[:n] + 1
                               for _ in range(b)]).sort(-1).values
        return anchors, self._positions(b, s)

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        anchors, pos = self.draw(*ids.shape)
        self.read_p, self.match_p = None, None
        logits, labels = self.forward(ids, anchors, pos)
        b, n, k = labels.shape
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
        w = self.weights.to(ids.device)
        loss = (ce.view(b, n, k) * w).sum(-1).mean() / w.sum()
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels).long()  # [B, n, bs-1]
            tau = 1 + hit.cumprod(-1).sum(-1).float().mean()  # chain acceptance incl. the bonus
        logs = {"acc1": float(hit[..., 0].float().mean()), "tau": float(tau)}
        for key, p, weight in (("read", self.read_p, self.shape.read_last),
                               ("match", self.match_p, self.shape.read_match)):
            if p is not None and p.numel():
                term = -torch.log(p + 1e-9).mean()
                loss = loss + weight * term
                logs[key] = float(term.detach())
        return loss, logs

    def _last_keys(self, anchors: torch.Tensor) -> torch.Tensor:
        """Context index anchor−1 for every slot 1…: `[B, n, bs−1]` (the target's last layer
        there holds the tokens after the anchor)."""
        return (anchors - 1)[..., None].expand(-1, -1, self.shape.block_size - 1)

    def _match_keys(self, ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """For slot k, the context index c = j + k − 1, where j is the latest occurrence of the
        anchor's token with c < anchor (−1: none): in repeated text, the target's features at
        c hold the token after c = the token of slot k (their tokens k−1 back name the anchor's
        token — the content the query matches). `[B, n, bs−1]`."""
        b, s = ids.shape
        a = ids.gather(1, anchors)  # [B, n]
        j = torch.arange(s)
        eq = ids[:, None, :] == a[..., None]  # [B, n, S]
        out = []
        for k in range(1, self.shape.block_size):
            ok = eq & (j[None, None, :] + k - 1 < anchors[..., None])
            jk = torch.where(ok, j, -1).amax(-1)  # [B, n]
            out.append(torch.where(jk >= 0, jk + k - 1, -1))
        return torch.stack(out, -1)

    def _read_at(self, q, k, mask, scale: float, keys: torch.Tensor) -> torch.Tensor:
        """Head attention probabilities from each block's slots 1… to context index
        `keys [B, n, bs−1]` (CPU; −1 = none), where that key exists and is visible: `[m]`."""
        b, n, _ = keys.shape
        bs = self.shape.block_size
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
        p = scores.softmax(-1).view(b, n, bs, -1)[:, :, 1:]  # [B, n, bs−1, S + t]
        idx = keys.clamp(min=0).to(q.device)[..., None]
        seen = mask.view(b, n, bs, -1)[:, :, 1:].gather(-1, idx).squeeze(-1)  # gaps hide keys
        ok = seen & (keys >= 0).to(q.device)
        return p.gather(-1, idx).squeeze(-1)[ok]

    def forward(self, ids: torch.Tensor, anchors: torch.Tensor,
                pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits `[B, n, bs−1, V]` of the blocks at `anchors [B, n]` (CPU int64) of
        `ids [B, S]` at positions `pos [B, S]`, and the target's greedy labels `[B, n, bs−1]`."""
        model, cfg = self.model, self.model.config
        device = ids.device
        b, s = ids.shape
        n, bs = anchors.shape[1], self.shape.block_size
        feats, greedy = taps(self.target, ids, cfg.target_layer_ids)  # [B,S,F], [B,S]
        offs = torch.arange(bs)
        blk_pos = pos.gather(1, anchors)[..., None] + offs  # [B, n, bs]
        label_idx = anchors[..., None] + offs[1:] - 1  # greedy[p] is the target's token p+1
        labels = greedy.gather(1, label_idx.flatten(1).to(device)).view(b, n, bs - 1)
        block = torch.full((b, n, bs), cfg.mask_token_id, dtype=torch.long)
        block[..., 0] = ids.cpu().gather(1, anchors)
        masks = {k: v.to(device) for k, v in self._masks(anchors, blk_pos, pos, s).items()}
        fused = model.fuse_context(feats.flatten(0, 1))  # [B*S, hidden]
        pos_flat = pos.flatten().to(device)
        t = n * bs

        def attend(layer, q, k, v, scale):  # q [B*t, Hq, D]; k, v [B*t, Hkv, D]
            ck, cv = model.context_kv(layer, fused, pos_flat)  # [B*S, Hkv, D]
            rep = cfg.num_heads // cfg.num_kv_heads

            def heads(x, length):  # [B*L, H, D] -> [B, H, L, D]
                return x.view(b, length, x.shape[1], x.shape[2]).transpose(1, 2)

            keys = torch.cat([heads(ck, s), heads(k, t)], 2).repeat_interleave(rep, 1)
            vals = torch.cat([heads(cv, s), heads(v, t)], 2).repeat_interleave(rep, 1)
            mask = masks[(cfg.window(layer), cfg.causal[layer])][:, None]
            if layer == 0 and self.shape.read_last:
                self.read_p = self._read_at(heads(q, t)[:, 0], keys[:, 0], mask[:, 0], scale,
                                            self._last_keys(anchors))
            if layer == 1 and self.shape.read_match:
                self.match_p = self._read_at(heads(q, t)[:, 0], keys[:, 0], mask[:, 0], scale,
                                             self._match_keys(ids.cpu(), anchors))
            o = F.scaled_dot_product_attention(heads(q, t), keys, vals, attn_mask=mask,
                                               scale=scale)  # [B, Hq, t, D]
            return o.transpose(1, 2).reshape(b * t, cfg.num_heads, cfg.head_dim)

        hidden = model(block.flatten().to(device), blk_pos.flatten().to(device), attend)
        return model.logits(hidden.view(b, n, bs, -1)[:, :, 1:]), labels  # [B, n, bs-1, V]
