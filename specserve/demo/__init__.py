"""The trained demo pair: a tiny Qwen3 target and a DFlash drafter for it, trained from scratch on
text every machine has (the running Python's standard library sources) plus synthetic
in-context-copying sequences: `specserve train-demo --out checkpoints --seed 0`. The committed
pair under `checkpoints/` is the default model of `specserve up` and `specserve probe`.

Modules: `data` (corpus, tokenizer, batches), `target` (the Qwen3 target and its training),
`drafter` (the DFlash drafter and its A5 training forward), `loop` (optimizer, schedule,
progress lines), `evaluate` (mean commit_len in the in-process engine), `train` (the CLI).
"""

from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"  # in a source checkout
DEMO_TARGET, DEMO_DRAFTER = CHECKPOINTS / "demo-target", CHECKPOINTS / "demo-drafter"


def default_pair() -> tuple[str | None, str | None]:
    """The committed demo (target, drafter) dirs, or (None, None) where they are not present."""
    if (DEMO_TARGET / "config.json").exists() and (DEMO_DRAFTER / "config.json").exists():
        return str(DEMO_TARGET), str(DEMO_DRAFTER)
    return None, None
