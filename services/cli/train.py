"""`specserve train-demo`: train the bundled demo pair (a tiny Qwen3 target + its DFlash drafter).

The recipe, data and determinism live in `specserve.demo.train`; this only parses the flags.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.cli import usage


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="checkpoints", help="directory for demo-target/, "
                   "demo-drafter/ and training.json; refused if it is not empty (--force)")
    p.add_argument("--force", action="store_true",
                   help="overwrite what --out already holds (the committed pair, say)")
    p.add_argument("--seed", type=usage.int_range(0, 2**32 - 1), default=0,
                   help="seed of data, init and training")
    p.add_argument("--device", default="auto", type=usage.device(("auto", "cpu", "cuda")),
                   help="auto (cuda if available), cpu, cuda, cuda:N")
    steps = usage.int_range(1, 10**9)
    p.add_argument("--target-steps", type=steps, default=None, help="override the recipe's")
    p.add_argument("--drafter-steps", type=steps, default=None, help="override the recipe's")
    p.add_argument("--threads", type=usage.int_range(1, 4096), default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--recipe", choices=["cpu", "full"], default="cpu",
                   help="cpu: the committed checkpoints' recipe, on any device (about half an "
                        "hour on 2 CPU cores, minutes on a GPU: checkpoints/README.md); full: "
                        "longer sequences, not validated yet")
    p.add_argument("--target-from", metavar="DIR", default=None,
                   help="reuse the target of an earlier train-demo output (same seed and "
                        "target recipe) and train only the drafter")
    p.add_argument("--drafter-lr", type=usage.float_range(0, lo_open=True), default=None,
                   help="override the recipe's")
    p.add_argument("--drafter-copy-frac", type=usage.float_range(0, 1), default=None,
                   help="override the recipe's share of copy sequences for the drafter")
    p.add_argument("--quick", action="store_true", help="a tiny run (seconds) for tests")
    p.add_argument("--json", action="store_true",
                   help="print the training.json summary on stdout (progress always goes to "
                        "stderr)")


def add(sub) -> None:
    p = sub.add_parser(
        "train-demo", help="train the demo target + DFlash drafter (HF-format checkpoints)",
        formatter_class=usage.HelpFormatter,
        description="Train a BPE tokenizer and a tiny Qwen3 target on the Python standard "
                    "library's sources, then a DFlash drafter for it (frozen target embedding "
                    "and LM head, taps, random anchors, position-weighted loss). Deterministic "
                    "for a seed; progress lines with the loss.")
    add_arguments(p)
    p.set_defaults(func=_train)


def _check_writable(out: Path) -> None:
    """UsageError unless `out` can be made (its missing parents too) and written into."""
    import tempfile

    made = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise usage.UsageError(f"--out {out}: cannot write there ({e.strerror})") from None
    finally:
        for p in made:  # leave no empty directory behind: training makes them again
            if p.exists() and not any(p.iterdir()):
                p.rmdir()


def _train(args) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise usage.UsageError(f"--out {args.out} is a file, not a directory")
    if out.exists() and not args.force and any(out.iterdir()):
        raise usage.UsageError(f"--out {args.out} already exists and is not empty; pass --force "
                               "to overwrite it or --out a new directory")
    _check_writable(out)  # before the training, not after it
    from specserve.demo.train import run_from_args

    return run_from_args(args)
