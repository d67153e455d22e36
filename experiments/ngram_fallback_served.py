"""A request whose DFlash context is lost mid-generation (the drafter killed with -9 while it
runs, rows not kept: the same-host default), measured through `specserve up` on the CPU demo
pair: its steps before the kill, while the drafter is down, and after `up` restarted it — mean
commit_len and how many steps verified a tree. Before 502328c the request decoded plainly after
the restart; since, it goes on with n-gram trees.

    python experiments/ngram_fallback_served.py --out F [--repo a checkout of the code before]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from served_audit import (  # a sibling: this directory is on the path
    audit_parser,
    drafter_pid,
    running_up,
    write_out,
)


def generate(repo: str, port: int, prompt: str, max_tokens: int, box: dict) -> None:
    """`specserve generate --json` through the gateway at `port`; its JSON into `box`."""
    cmd = [sys.executable, "-m", "services.cli", "generate", "--gateway", f"127.0.0.1:{port}",
           "--prompt", prompt, "--max-tokens", str(max_tokens), "--budget", "15",
           "--ignore-eos", "--timeout-s", "600", "--json"]
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    box["rc"], box["stderr"] = done.returncode, done.stderr[-2000:]
    box["result"] = json.loads(done.stdout) if done.returncode == 0 else None


def phases(steps: list[dict]) -> dict:
    """Steps split at the first fallback and the last: before / drafter down / after."""
    falls = [i for i, s in enumerate(steps) if s.get("fallback")]
    cut = (falls[0], falls[-1] + 1) if falls else (len(steps), len(steps))
    parts = {"before": steps[1:cut[0]], "down": steps[cut[0]:cut[1]], "after": steps[cut[1]:]}
    out = {}
    for name, part in parts.items():
        n = len(part)
        out[name] = {"steps": n,
                     "tokens": sum(s["commit_len"] for s in part),
                     "mean_commit_len": round(sum(s["commit_len"] for s in part) / n, 3)
                     if n else None,
                     "steps_with_a_tree": sum(1 for s in part if s.get("tree_size"))}
    return out


def main() -> None:
    ap = audit_parser(__doc__, 64551)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--kill-after-s", type=float, default=3.0)
    args = ap.parse_args()
    http_port, log = args.ports + 30, Path(tempfile.mkdtemp()) / "up.log"
    out: dict = {"repo": os.path.abspath(args.repo), "max_tokens": args.max_tokens}
    with running_up(args.repo, args.ports, http_port, log):
        box: dict = {}
        prompt = "The cat sat on the mat. " * 40
        worker = threading.Thread(target=generate, args=(args.repo, args.ports, prompt,
                                                         args.max_tokens, box))
        worker.start()
        time.sleep(args.kill_after_s)
        os.kill(drafter_pid(args.ports + 2), signal.SIGKILL)
        t_kill = time.monotonic()
        while "drafter SERVING again" not in log.read_text() and time.monotonic() - t_kill < 120:
            time.sleep(0.2)
        out["drafter_back_after_s"] = round(time.monotonic() - t_kill, 1)
        worker.join(600)
        result = box.get("result")
        out["rc"], out["stderr_tail"] = box.get("rc"), box.get("stderr", "")[-300:]
        if result is not None:
            out["completion_tokens"] = result["usage"]["completion_tokens"]
            out["wall_s"] = round(result["wall_s"], 2)
            out["phases"] = phases(result["steps"])
    write_out(args.out, out)

if __name__ == "__main__":
    main()
