"""The commit probe (docs/observability.md, "The commit probe"): predictable vs novel text across
context lengths.

A gRPC client of the gateway. For each text ("predictable": "The cat sat on the mat." repeated;
"novel": non-repetitive prose) and each context length it sends exactly that many prompt tokens,
generates N tokens greedily with speculation, and collects per-step stats from the stream. The
table answers "is commit_len low because the text is hard, or because the system is broken?":
a healthy system keeps a high commit_len on predictable text at every context length. The first
decode step and the steady ones are separate columns: a first step that waits (for the prompt's
context feed, say) is not folded into the cost of every step.

Each row also says whose fault a low commit_len is (`verdict`): whether the target itself
continued the predictable text (its continuation is known), whether the same request without
speculation gives the same tokens (the losslessness spot check), how often the drafter could not
serve, and where along the tree the drafts fail (`accepted_per_position`). The gateway calls are
`services/cli/probe_client.py`'s, the plot `probe_plot.py`'s; this module imports no grpc.

A row the server can never run (its prompt and new tokens need more KV pages than the verifier's
whole pool: the verifier refuses it with INVALID_ARGUMENT, the gateway passes the message on) is
kept as an unmeasured row: its figures are None, its verdict `UNFIT`, and `refused` says why
(`unfit`: the server's message and the page counts it names).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

PREDICTABLE = "The cat sat on the mat. "
TEXTS = ("predictable", "novel")  # what `--texts` may name


MAX_CONTEXT = 1 << 21  # prompt tokens a probe row may ask for (past every model served here)
HEALTHY = "healthy"
HARD = "text is hard for this drafter"
TARGET = "the target does not follow the text at this length"
BROKEN = "speculation broken (lossless check failed)"
NO_DRAFTER = "drafter unavailable (fallbacks)"
NOTHING_DRAFTED = "no speculation (nothing drafted)"
PLAIN = "adaptive chose plain decoding (drafts did not pay)"
FEW_STEPS = "too few decode steps to judge"
UNFIT = "does not fit this server"
# the verifier's refusal of a request larger than its KV pool (engine/scheduler.py, check_fits)
_NEVER_FITS = re.compile(r"needs (\d+) KV pages\b.*?\bthe pool has only (\d+)\b", re.S)


@dataclass(frozen=True)
class ProbeRow:
    text: str  # "predictable" | "novel"
    context: int  # prompt tokens
    new_tokens: int
    steps: int
    commit_len: float  # mean tokens committed per step
    depth: float  # mean accepted_depth
    drafts: float  # mean draft nodes per step (tree size)
    wall_s: float  # gateway-measured request time
    prefill_s: float  # verifier-measured prefill compute
    ttft_s: float
    step_ms: float  # mean decode step time: (wall − ttft) / steps (the first step included)
    first_step_ms: float  # the first decode step (a feed stall or a cold path shows here)
    steady_step_ms: float  # median of the later steps (what a step costs once running)
    fallbacks: int
    stream_commit_len: float  # the same mean recomputed from the streamed chunks
    text_head: str = ""  # the generated text's first characters
    followed: float | None = None  # share of tokens equal to the text's own continuation
    lossless: bool | None = None  # the same request without speculation: the same tokens
    accepted_per_position: dict[int, float] = field(default_factory=dict)  # depth → rate
    fail_position: int | None = None  # the first depth accepted in under half the steps
    verdict: str = ""
    trace_id: str | None = None  # the request's trace (when the services export spans)
    device: str = ""  # where the verifier ran the target
    verifier: str = ""  # the verifier replica that served it (its address)
    plain: float | None = None  # share of steps adaptive speculation decoded plainly (None: off)
    refused: dict | None = None  # the server can never run this row: `unfit`'s (None: measured)

    @property
    def ttft_other_s(self) -> float:
        """TTFT beyond the prefill compute: queueing, transport, the gateway (NaN: unmeasured)."""
        other = self.ttft_s - self.prefill_s
        return other if math.isnan(other) else max(0.0, other)


def unfit(message: str) -> dict | None:
    """A refusal that says the request can never fit the server's KV pool, as {"reason": the
    message, "kv_pages_needed", "kv_pages_total"}; None for any other message."""
    match = _NEVER_FITS.search(message)
    if match is None:
        return None
    return {"reason": message, "kv_pages_needed": int(match[1]),
            "kv_pages_total": int(match[2])}


def unfit_row(text: str, context: int, refused: dict) -> ProbeRow:
    """The row of a request the server refused as never fitting (`unfit`): nothing measured."""
    nan = {f.name: math.nan for f in fields(ProbeRow) if f.type == "float"}
    return ProbeRow(**nan, text=text, context=context, new_tokens=None, steps=None,
                    fallbacks=None, verdict=UNFIT, refused=refused)


def unfit_text(row: ProbeRow) -> str:
    """'does not fit this server: needs 8,201 KV pages, the pool has 8,192'."""
    r = row.refused
    return (f"{UNFIT}: needs {r['kv_pages_needed']:,} KV pages, the pool has "
            f"{r['kv_pages_total']:,}")


def verdict(row: ProbeRow, hard_below: float = 2.0) -> str:
    """Whose fault a low commit_len is, most serious first."""
    if row.lossless is False:
        return BROKEN
    if row.steps and row.fallbacks > row.steps / 2:
        return NO_DRAFTER
    if row.followed is not None and row.followed < 0.5:
        return TARGET
    if row.plain is not None and row.plain > 0.5:
        return PLAIN
    if row.steps and not row.drafts:
        return NOTHING_DRAFTED
    if row.steps < 2:
        return FEW_STEPS
    return HARD if row.commit_len < hard_below else HEALTHY


def acceptance(accepted_per_position: dict[int, int], steps: int) -> tuple[dict, int | None]:
    """(depth → share of steps that accepted a token there, the first depth under 1/2)."""
    rates = {int(k): v / steps for k, v in sorted(accepted_per_position.items())} if steps \
        else {}
    first = next((k for k in range(1, len(rates) + 2) if rates.get(k, 0.0) < 0.5), None)
    return rates, first


def followed(generated: list[int], expected: list[int] | None) -> float | None:
    """Share of generated tokens equal to the known continuation (None: not known)."""
    if not expected or not generated:
        return None
    return sum(a == b for a, b in zip(generated, expected, strict=False)) / len(generated)


def parse_contexts(spec: str) -> list[int]:
    """'1k,16k,64k,128k' → [1024, 16384, 65536, 131072]; ValueError naming a bad part."""
    out = []
    for part in spec.split(","):
        part = part.strip().lower()
        scale = 1024 if part.endswith("k") else 1
        try:
            out.append(int(float(part.removesuffix("k")) * scale))
        except (ValueError, OverflowError):  # '1x', '', 'inf'
            where = f" in {spec!r}" if part != spec.strip().lower() else ""
            raise ValueError(f"{part!r} is not a token count (e.g. 512, 1k, 16k){where}") \
                from None
    if any(c <= 0 for c in out):
        raise ValueError(f"must be positive token counts, got {spec!r}")
    if max(out) > MAX_CONTEXT:
        raise ValueError(f"{max(out):,} tokens is past the probe's limit, {MAX_CONTEXT:,}")
    return out


def novel_corpus(min_chars: int, seed: int = 0) -> str:
    """Non-repetitive prose every machine has: stdlib docstring sentences, shuffled."""
    import ast
    import sysconfig

    sentences: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            doc = ast.get_docstring(node) if isinstance(
                node, ast.FunctionDef | ast.ClassDef | ast.Module) else None
            if doc:
                sentences += [s.strip() + "." for s in doc.replace("\n", " ").split(". ")
                              if len(s.split()) > 3]
        if sum(map(len, sentences)) > 4 * min_chars:
            break
    random.Random(seed).shuffle(sentences)
    text = " ".join(dict.fromkeys(sentences))  # no sentence twice
    if len(text) < min_chars:
        text = (text + " ") * (min_chars // max(len(text), 1) + 1)
    return text


def prompt_ids(tokenizer, text: str, n: int) -> list[int]:
    """Exactly n token ids of `text` (repeated if it is too short)."""
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("the text has no tokens")
    while len(ids) < n:
        ids += ids
    return ids[:n]


def measured(rows: list[ProbeRow]) -> list[ProbeRow]:
    """The rows the server ran (not refused as never fitting)."""
    return [r for r in rows if r.refused is None]


def table(rows: list[ProbeRow]) -> str:
    """The markdown table; a `plain` column when adaptive speculation chose the shapes, a
    `verifier` column when the rows were served by several replicas; a row that does not fit
    the server has '-' for every figure and says so (with the page counts) as its verdict."""
    ran = measured(rows)
    several = len({r.verifier for r in ran}) > 1
    adaptive = any(r.plain is not None for r in ran)
    extra = (" plain |" if adaptive else "") + (" verifier |" if several else "")
    head = ("| text | context | commit len | depth | drafts | followed | lossless | fails at "
            "| prefill s | TTFT other s | 1st step ms | steady step ms | fallbacks | verdict |"
            + extra + "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
            + "---|" * extra.count("|"))
    return "\n".join([head, *(_line(r, adaptive, several) for r in rows)])


def _line(r: ProbeRow, adaptive: bool, several: bool) -> str:
    if r.refused is not None:
        return (f"| {r.text} | {r.context:,} |" + " - |" * 11 + f" {unfit_text(r)} |"
                + " - |" * (adaptive + several))
    return (f"| {r.text} | {r.context:,} | {r.commit_len:.2f} | {r.depth:.2f} | "
            f"{r.drafts:.2f} | {_opt(r.followed)} | {_yes(r.lossless)} | "
            f"{r.fail_position or '-'} | {r.prefill_s:.2f} | {r.ttft_other_s:.2f} | "
            f"{ms(r.first_step_ms)} | {ms(r.steady_step_ms)} | {r.fallbacks} | {r.verdict} |"
            + (f" {_opt(r.plain)} |" if adaptive else "") + (f" {r.verifier} |" if several else ""))


def ms(x: float | None) -> str:
    """A step time in ms, '-' when there was no such step (None or NaN)."""
    return "-" if x is None or x != x else f"{x:.1f}"


def _opt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _yes(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "**NO**")


def rows_as_json(rows: list[ProbeRow]) -> list[dict]:
    """The rows as plain JSON values: a figure with no samples (NaN) is null, as is every
    figure of a row that does not fit the server (its `refused`: the reason and page counts)."""
    return [{k: None if isinstance(v, float) and v != v else v
             for k, v in {**asdict(r), "ttft_other_s": r.ttft_other_s}.items()} for r in rows]
