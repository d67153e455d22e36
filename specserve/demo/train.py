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
from specserve.demo.target import QUICK_TARGET, TargetShape, build_target, lm_loss, save_target

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
    target_lr: float = 3e-3
    drafter_steps: int = 400
    drafter_lr: float = 1.5e-3
    norm_lr_mult: float = 30.0
    log_every: int = 50
    target: TargetShape = TargetShape()
    drafter: DrafterShape = DrafterShape()


QUICK = Recipe(corpus_bytes=150_000, vocab_size=512, seq_len=64, batch=4, warm_steps=2,
               warm_seq_len=32, warm_batch=4, target_steps=4, drafter_steps=6, log_every=2,
               target=QUICK_TARGET, drafter=QUICK_DRAFTER)


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


def run(out: Path, seed: int, device: str, recipe: Recipe, log=None) -> dict:
    """Train both models and write them under `out`; returns the training.json summary."""
    log = log or sys.stdout
    _deterministic(device)
    t0 = time.perf_counter()
    corpus = data.stdlib_corpus(recipe.corpus_bytes)
    tok = data.train_tokenizer(corpus, recipe.vocab_size)
    tokens = data.tokenize_corpus(tok, corpus)
    words = data.corpus_words(corpus)
    mask_id = tok.token_to_id(data.MASK)
    unigram = data.unigram_entropy(tokens, recipe.vocab_size)
    print(f"corpus: {len(corpus.files)} stdlib files ({corpus.files[0]} .. {corpus.files[-1]}), "
          f"{corpus.num_bytes} bytes, {len(tokens)} tokens; unigram entropy {unigram:.3f} nats",
          file=log, flush=True)

    def batches(stream: int, copy_frac: float = recipe.copy_frac, **kw) -> data.Batches:
        return data.Batches(tok, tokens, words, kw.pop("seq_len", recipe.seq_len), copy_frac,
                            seed * 1000 + stream, **kw)

    target = build_target(recipe.target, recipe.vocab_size, seed * 1000 + 1, device)
    n_target = sum(p.numel() for p in target.parameters())
    print(f"target: Qwen3 {n_target / 1e6:.2f}M parameters on {device}", file=log, flush=True)
    warm_data = batches(8, 1.0, seq_len=recipe.warm_seq_len, max_period=16, prefix=False)
    train_data = batches(2)

    def target_step(step: int):
        if step < recipe.warm_steps:
            return lm_loss(target, warm_data.next(recipe.warm_batch).to(device)), {}
        return lm_loss(target, train_data.next(recipe.batch).to(device)), {}

    target_log = loop.train(
        "target", target.parameters(), target_step, recipe.warm_steps + recipe.target_steps,
        recipe.target_lr, recipe.log_every, norm_lr_mult=recipe.norm_lr_mult, out=log)
    target_eval = _eval_target(target, batches(3, 0.0), batches(4, 1.0), tok, recipe, device)
    print("target eval: " + ", ".join(f"{k} {v:.3f}" for k, v in target_eval.items()),
          file=log, flush=True)
    target.eval()

    raw = drafter_config(recipe.drafter, recipe.target, recipe.vocab_size, mask_id)
    drafter = build_drafter(raw, target, seed * 1000 + 5, device)
    n_drafter = sum(p.numel() for p in trainable(drafter))
    print(f"drafter: DFlash {n_drafter / 1e6:.2f}M trained parameters", file=log, flush=True)
    objective = DraftObjective(drafter, target, recipe.drafter, seed * 1000 + 6)
    draft_data = batches(7)
    drafter_log = loop.train(
        "drafter", trainable(drafter),
        lambda step: objective(draft_data.next(recipe.batch).to(device)),
        recipe.drafter_steps, recipe.drafter_lr, recipe.log_every,
        norm_lr_mult=recipe.norm_lr_mult, out=log)

    out.mkdir(parents=True, exist_ok=True)
    save_target(target, tok, out / TARGET_DIR)
    save_drafter(drafter, raw, out / DRAFTER_DIR)
    summary = {
        "seed": seed, "device": device, "device_name": _device_name(device),
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "corpus": corpus.describe(), "corpus_tokens": len(tokens),
        "unigram_entropy_nats": round(unigram, 4), "recipe": dataclasses.asdict(recipe),
        "target_parameters": n_target, "drafter_parameters": n_drafter,
        "target": {**target_log.as_dict(), "eval_loss": target_eval},
        "drafter": drafter_log.as_dict(),
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out / TARGET_DIR}, {out / DRAFTER_DIR}, {out / SUMMARY} "
          f"in {summary['total_seconds']:.0f} s", file=log, flush=True)
    return summary


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def run_from_args(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = QUICK if args.quick else Recipe()
    if args.target_steps is not None:
        recipe = replace(recipe, target_steps=args.target_steps)
    if args.drafter_steps is not None:
        recipe = replace(recipe, drafter_steps=args.drafter_steps)
    summary = run(Path(args.out), args.seed, resolve_device(args.device), recipe,
                  log=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    from specserve.cli import main as cli_main

    return cli_main(["train-demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
