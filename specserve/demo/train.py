"""Train the demo pair: `specserve train-demo --out checkpoints --seed 0 [--device cuda]`.

Steps: read the stdlib corpus, train the BPE tokenizer, train the Qwen3 target (next-token loss
on natural + copy sequences), then freeze it and train the DFlash drafter (A5). Writes
`<out>/demo-target/` (HF Qwen3, bf16, tokenizer.json), `<out>/demo-drafter/` (z-lab DFlash,
bf16) and `<out>/training.json` (data, recipe, logged losses, times). Deterministic for a seed
on one machine (same Python stdlib, same torch, same device type): the same seed reproduces the
logged losses exactly on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specserve.demo import data, loop
from specserve.demo.drafter import (
    QUICK_DRAFTER,
    DrafterShape,
    DraftObjective,
    build_drafter,
    drafter_config,
    save_drafter,
    trainable,
)
from specserve.demo.target import (
    COPY_CIRCUITS,
    QUICK_TARGET,
    TargetObjective,
    TargetShape,
    build_target,
    lm_loss,
    save_target,
)

TARGET_DIR, DRAFTER_DIR, SUMMARY = "demo-target", "demo-drafter", "training.json"


@dataclass(frozen=True)
class Recipe:
    corpus_bytes: int = 3_000_000
    vocab_size: int = 4096
    seq_len: int = 512
    batch: int = 4
    copy_frac: float = 0.5
    warm_steps: int = 800  # target warm-up phase: short copy sequences only (periods ≤ 16)
    warm_seq_len: int = 64
    warm_batch: int = 16
    target_steps: int = 600  # then natural + copy sequences of seq_len
    target_lr: float = 1e-3
    circuits: tuple = COPY_CIRCUITS  # supervised attention heads (target.circuit_loss)
    circuit_weight: float = 1.0
    lookahead: int = 7  # training-only heads for tokens t+2 … t+1+lookahead
    lookahead_weight: float = 0.5
    drafter_steps: int = 400
    drafter_batch: int = 4
    drafter_copy_frac: float = 0.5
    drafter_lr: float = 1e-3
    weight_decay: float = 0.0
    norm_lr_mult: float = 1.0
    log_every: int = 50
    target: TargetShape = TargetShape()
    drafter: DrafterShape = DrafterShape()

    def __post_init__(self) -> None:
        for layer, head, kind, d in self.circuits:
            if layer >= self.target.layers or head >= self.target.heads or d < 1 \
                    or kind not in ("prev", "induction"):
                raise ValueError(f"circuit {(layer, head, kind, d)} does not fit a target of "
                                 f"{self.target.layers} layers × {self.target.heads} heads")
        if max(self.drafter.target_layer_ids) >= self.target.layers:
            raise ValueError(f"drafter taps {self.drafter.target_layer_ids} exceed the "
                             f"target's {self.target.layers} layers")


# The committed checkpoints' recipe on a CPU: short sequences, the same shapes.
CPU = Recipe(seq_len=128, batch=16, copy_frac=0.7, warm_steps=300, warm_batch=32,
             target_steps=1700, drafter_steps=1200, drafter_batch=8, drafter_lr=3e-3,
             drafter_copy_frac=0.9,
             drafter=replace(DrafterShape(), anchors=16))
QUICK = Recipe(corpus_bytes=150_000, vocab_size=512, seq_len=64, batch=4, warm_steps=2,
               warm_seq_len=32, warm_batch=4, target_steps=4, drafter_steps=6, log_every=2,
               circuits=((0, 0, "prev", 1), (1, 0, "induction", 1), (1, 1, "induction", 2)),
               lookahead=2, target=QUICK_TARGET, drafter=QUICK_DRAFTER)
RECIPES = {"full": Recipe(), "cpu": CPU, "quick": QUICK}


def recipe_from_dict(d: dict) -> Recipe:
    """The Recipe a training.json records (`dataclasses.asdict` inverted)."""
    drafter = {**d["drafter"], "target_layer_ids": tuple(d["drafter"]["target_layer_ids"])}
    return Recipe(**{**d, "circuits": tuple(tuple(c) for c in d["circuits"]),
                     "target": TargetShape(**d["target"]), "drafter": DrafterShape(**drafter)})


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _deterministic(device: str) -> None:
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)


@torch.no_grad()
def _eval_target(model, natural: data.Batches, copy: data.Batches, tok, recipe: Recipe,
                 device: str) -> dict[str, float]:
    """Held-out losses (natural and copy sequences), greedy accuracy on the second half of copy
    sequences, and on "The cat sat on the mat." repeated (never trained on)."""
    model.eval()
    n = 4 * recipe.batch
    ids = copy.next(n).to(device)
    half = recipe.seq_len // 2
    cat = tok.encode(" ".join(["The cat sat on the mat."] * (recipe.seq_len // 4))).ids
    cat = torch.tensor([cat[: recipe.seq_len]], device=device)

    def acc(x: torch.Tensor) -> float:
        pred = model(input_ids=x).logits[:, half - 1 : -1].argmax(-1)
        return float((pred == x[:, half:]).float().mean())

    out = {"natural_loss": float(lm_loss(model, natural.next(n).to(device))),
           "copy_loss": float(lm_loss(model, ids)), "copy_acc": acc(ids), "cat_acc": acc(cat)}
    model.train()
    return {k: round(v, 4) for k, v in out.items()}


def run(out: Path, seed: int, device: str, recipe: Recipe, log=None,
        stop_after: int | None = None, target_from: Path | None = None) -> dict:
    """Train both models and write them under `out`; returns the training.json summary.
    `stop_after` N: only the target's first N steps (on the full schedule), nothing written;
    returns {"target": its log}. `target_from`: a `train-demo` output whose target was trained
    with this seed and recipe: load it (bf16, as saved) and train only the drafter."""
    log = log or sys.stdout
    _deterministic(device)
    t0 = time.perf_counter()
    corpus, tok, tokens, unigram = _corpus(recipe, log)
    words = data.corpus_words(corpus)

    def batches(stream: int, copy_frac: float = recipe.copy_frac, **kw) -> data.Batches:
        return data.Batches(tok, tokens, words, kw.pop("seq_len", recipe.seq_len), copy_frac,
                            seed * 1000 + stream, **kw)

    if target_from is None:
        target, target_summary = _train_target(recipe, seed, device, batches, tok, log,
                                               stop_after)
        if stop_after is not None:
            return {"target": target_summary}
    else:
        target, target_summary = _reuse_target(Path(target_from), recipe, seed, device)
    drafter, raw, drafter_log = _train_drafter(recipe, seed, device, target, batches,
                                               tok.token_to_id(data.MASK), log)
    out.mkdir(parents=True, exist_ok=True)
    save_target(target, tok, out / TARGET_DIR)
    save_drafter(drafter, raw, out / DRAFTER_DIR)
    summary = {
        "seed": seed, "device": device, "device_name": _device_name(device),
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "corpus": corpus.describe(), "corpus_tokens": len(tokens),
        "unigram_entropy_nats": round(unigram, 4), "recipe": dataclasses.asdict(recipe),
        **_sizes(target, drafter),
        "target": target_summary, "drafter": drafter_log.as_dict(),
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / TARGET_DIR}, {out / DRAFTER_DIR}, {out / SUMMARY} "
          f"in {summary['total_seconds']:.0f} s", file=log, flush=True)
    return summary


def _corpus(recipe: Recipe, log):
    """The stdlib corpus, its trained tokenizer, its tokens and their unigram entropy."""
    corpus = data.stdlib_corpus(recipe.corpus_bytes)
    tok = data.train_tokenizer(corpus, recipe.vocab_size)
    tokens = data.tokenize_corpus(tok, corpus)
    unigram = data.unigram_entropy(tokens, recipe.vocab_size)
    print(f"corpus: {len(corpus.files)} stdlib files ({corpus.files[0]} .. {corpus.files[-1]}), "
          f"{corpus.num_bytes} bytes, {len(tokens)} tokens; unigram entropy {unigram:.3f} nats",
          file=log, flush=True)
    return corpus, tok, tokens, unigram


def _sizes(target, drafter) -> dict[str, int]:
    """Parameter counts as training.json names them (the drafter's trainable ones)."""
    return {"target_parameters": sum(p.numel() for p in target.parameters()),
            "drafter_parameters": sum(p.numel() for p in trainable(drafter))}


def _train_target(recipe: Recipe, seed: int, device: str, batches, tok, log,
                  stop_after: int | None):
    """Phase 1: the target (warm-up on short copies, then natural + copy) and its eval."""
    target = build_target(recipe.target, recipe.vocab_size, seed * 1000 + 1, device)
    n_target = sum(p.numel() for p in target.parameters())
    print(f"target: Qwen3 {n_target / 1e6:.2f}M parameters on {device}", file=log, flush=True)
    warm_data = batches(8, 1.0, seq_len=recipe.warm_seq_len, max_period=16, prefix=False)
    train_data = batches(2)
    objective = TargetObjective(recipe.target.hidden, recipe.lookahead, recipe.circuits,
                                recipe.circuit_weight, recipe.lookahead_weight,
                                seed * 1000 + 9).to(device)

    def target_step(step: int):
        if step < recipe.warm_steps:
            return objective(target, warm_data.next(recipe.warm_batch).to(device))
        return objective(target, train_data.next(recipe.batch).to(device))

    target_log = loop.train(
        "target", [*target.parameters(), *objective.parameters()], target_step,
        recipe.warm_steps + recipe.target_steps, recipe.target_lr, recipe.log_every,
        weight_decay=recipe.weight_decay, norm_lr_mult=recipe.norm_lr_mult, out=log,
        stop_after=stop_after)
    if stop_after is not None:
        return target, target_log.as_dict()
    target_eval = _eval_target(target, batches(3, 0.0), batches(4, 1.0), tok, recipe, device)
    print("target eval: " + ", ".join(f"{k} {v:.3f}" for k, v in target_eval.items()),
          file=log, flush=True)
    return target.eval(), {**target_log.as_dict(), "eval_loss": target_eval,
                           "torch_threads": torch.get_num_threads()}


def _reuse_target(src: Path, recipe: Recipe, seed: int, device: str):
    import transformers

    prev = json.loads((src / SUMMARY).read_text())
    same = {k: v for k, v in dataclasses.asdict(recipe).items() if not k.startswith("drafter")}
    if prev["seed"] != seed or {k: prev["recipe"].get(k) for k in same} != json.loads(
            json.dumps(same)):
        raise ValueError(f"{src}: its target was trained with another seed or target recipe")
    target = transformers.Qwen3ForCausalLM.from_pretrained(
        src / TARGET_DIR, dtype=torch.float32, attn_implementation="eager").to(device).eval()
    return target, {"torch_threads": prev["torch_threads"], **prev["target"],
                    "reused_from": str(src)}


def _train_drafter(recipe: Recipe, seed: int, device: str, target, batches, mask_id: int, log):
    """Phase 2: the DFlash drafter against the frozen target (A5)."""
    raw = drafter_config(recipe.drafter, recipe.target, recipe.vocab_size, mask_id)
    drafter = build_drafter(raw, target, seed * 1000 + 5, device)
    n_drafter = sum(p.numel() for p in trainable(drafter))
    print(f"drafter: DFlash {n_drafter / 1e6:.2f}M trained parameters", file=log, flush=True)
    objective = DraftObjective(drafter, target, recipe.drafter, seed * 1000 + 6)
    draft_data = batches(7, recipe.drafter_copy_frac)
    drafter_log = loop.train(
        "drafter", trainable(drafter),
        lambda step: objective(draft_data.next(recipe.drafter_batch).to(device)),
        recipe.drafter_steps, recipe.drafter_lr, recipe.log_every,
        weight_decay=recipe.weight_decay, norm_lr_mult=recipe.norm_lr_mult, out=log)
    return drafter, raw, drafter_log


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def run_from_args(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = RECIPES["quick" if args.quick else args.recipe or "cpu"]
    for name in ("target_steps", "drafter_steps", "drafter_lr", "drafter_copy_frac"):
        if getattr(args, name) is not None:
            recipe = replace(recipe, **{name: getattr(args, name)})
    summary = run(Path(args.out), args.seed, resolve_device(args.device), recipe,
                  log=sys.stderr, target_from=args.target_from)  # progress: stderr
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0
