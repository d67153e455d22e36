"""The trained demo pair: a tiny Qwen3 target and a DFlash drafter for it, trained from scratch on
text every machine has (the running Python's standard library sources) plus synthetic
in-context-copying sequences. `python -m specserve.demo.train --out checkpoints --seed 0`.

Modules: `data` (corpus, tokenizer, batches), `target` (the Qwen3 target and its training),
`drafter` (the DFlash drafter and its A5 training forward), `loop` (optimizer, schedule,
progress lines), `evaluate` (mean commit_len in the in-process engine), `train` (the CLI).
"""
