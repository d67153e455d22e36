"""Mean commit_len of a demo pair in the in-process engine (greedy, DDTree), at a given context.

Texts: PREDICTABLE ("The cat sat on the mat." repeated, the seed's probe text) and novel text —
stdlib sources the training never read (the top-level files after the training cap) or the
built-in made-up paragraph. `python -m specserve.demo.evaluate checkpoints --contexts 1024 4096`
prints one line per (text, context).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from specserve.config import EngineConfig
from specserve.demo import data
from specserve.drafters.dflash import DFlashDrafter
from specserve.engine.engine import Engine
from specserve.models.dflash import load_dflash
from specserve.tokenizer import Tokenizer
from specserve.types import SamplingParams

PREDICTABLE = "The cat sat on the mat."
MADE_UP = (
    "Marguerite kept a ledger of the weather on the island for eleven winters. Each morning she "
    "climbed to the lighthouse gallery, counted the fishing boats that had dared the strait, and "
    "wrote down the colour of the sea in words nobody else used: pewter, bruised plum, the grey "
    "of an old spoon. When the ferry company finally printed timetables, her neighbours still "
    "asked her, not the paper, whether the crossing would be calm enough for a cello."
)


def predictable_ids(tok: Tokenizer, n: int) -> list[int]:
    """`n` tokens of "The cat sat on the mat." repeated (space-separated)."""
    per = len(tok.encode(PREDICTABLE + " "))
    ids = tok.encode(" ".join([PREDICTABLE] * (n // max(per - 1, 1) + 2)))
    return ids[:n]


def novel_ids(tok: Tokenizer, n: int, cap_bytes: int = 3_000_000) -> list[int]:
    """`n` tokens of held-out stdlib sources: the top-level files after the training corpus."""
    import sysconfig

    seen = set(data.stdlib_corpus(cap_bytes).files)
    root = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(root.glob("*.py")):
        if path.name not in seen and path.is_file():
            ids += tok.encode(path.read_bytes().decode("utf-8", errors="replace"))
            if len(ids) >= n:
                break
    return ids[:n]


def make_engine(target_dir: str | Path, draft_dir: str | Path, max_context: int,
                budget: int = 16, device: str = "cpu", dtype: str = "float32") -> Engine:
    """An engine over the pair, sized for one request of up to `max_context` tokens."""
    pages = math.ceil((max_context + 256) / 16) + 8
    engine = Engine(EngineConfig(str(target_dir), dtype=dtype, device=device, num_pages=pages,
                                 max_draft_tokens=budget))
    drafter_model = load_dflash(draft_dir, target_dir, dtype, device)
    window = drafter_model.config.sliding_window or max_context
    engine.set_drafter(DFlashDrafter(drafter_model, num_pages=pages, page_size=16,
                                     sliding_num_pages=math.ceil((window + 64) / 16) + 8))
    return engine


def commit_len(engine: Engine, prompt: list[int], new_tokens: int = 64,
               budget: int = 16) -> dict:
    """Generate `new_tokens` greedily with DDTree `budget`; the per-step commit_len summary."""
    lens: list[int] = []
    engine.on_step = lambda _rid, step: lens.append(step.commit_len)
    rid = f"probe-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                       budget=budget)
    out: list[int] = []
    stats = None
    while engine.has_unfinished:
        for o in engine.step():
            out += o.new_token_ids
            stats = o.stats.request if o.stats is not None else stats
    engine.on_step = None
    return {"context": len(prompt), "mean_commit_len": sum(lens) / max(1, len(lens)),
            "steps": len(lens), "tokens": out, "wall_s": time.perf_counter() - t0,
            "prefill_s": stats.prefill_s if stats is not None else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specserve.demo.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("root", nargs="?", default="checkpoints")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tdir, ddir = Path(args.root) / "demo-target", Path(args.root) / "demo-drafter"
    tok = Tokenizer.from_dir(tdir)
    engine = make_engine(tdir, ddir, max(args.contexts) + args.new_tokens, args.budget,
                         args.device)
    texts = {"predictable": predictable_ids, "novel (held-out stdlib)": novel_ids}
    for n in args.contexts:
        for name, make in texts.items():
            r = commit_len(engine, make(tok, n), args.new_tokens, args.budget)
            print(f"{name:24s} context {r['context']:6d}  mean commit_len "
                  f"{r['mean_commit_len']:.2f} over {r['steps']} steps  prefill "
                  f"{r['prefill_s']:.1f} s  wall {r['wall_s']:.1f} s  "
                  f"{tok.decode(r['tokens'][:24])!r}", flush=True)
    r = commit_len(engine, tok.encode(MADE_UP), args.new_tokens, args.budget)
    print(f"{'novel (made-up prose)':24s} context {r['context']:6d}  mean commit_len "
          f"{r['mean_commit_len']:.2f} over {r['steps']} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
