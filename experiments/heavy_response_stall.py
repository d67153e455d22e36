"""How long the gateway's /health stalls while it answers a large logprobs response (a
2,000-token prompt, `prompt_logprobs: 20`, `n: 8`, not streamed), measured through `specserve
up` on the CPU demo pair: /health polled every 20 ms during the request, its slowest answer;
`--repo` another checkout for a before/after.

    python experiments/heavy_response_stall.py --out F [--repo a checkout of the code before]
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

from served_audit import (  # a sibling: this directory is on the path
    audit_parser,
    http,
    running_up,
    write_out,
)


def poll_health(port: int, stop: threading.Event, worst: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        http(port, "/health", timeout=30)
        worst.append(time.perf_counter() - t0)
        time.sleep(0.02)


def main() -> None:
    args = audit_parser(__doc__, 64611).parse_args()
    http_port, log = args.ports + 30, Path(tempfile.mkdtemp()) / "up.log"
    ids = [5 + (i * 37) % 3900 for i in range(2000)]
    out: dict = {"repo": os.path.abspath(args.repo)}
    with running_up(args.repo, args.ports, http_port, log):
        for round_ in range(2):
            stop, seen = threading.Event(), []
            poller = threading.Thread(target=poll_health, args=(http_port, stop, seen))
            poller.start()
            t0 = time.perf_counter()
            status, body = http(http_port, "/v1/completions", {
                "prompt": ids, "max_tokens": 1, "n": 8, "prompt_logprobs": 20}, timeout=600)
            wall = time.perf_counter() - t0
            stop.set()
            poller.join()
            out[f"round_{round_}"] = {
                "status": status, "wall_s": round(wall, 2), "health_polls": len(seen),
                "health_worst_s": round(max(seen), 3),
                "prompt_logprob_entries": sum(len(c.get("prompt_logprobs") or [])
                                              for c in body["choices"])
                if isinstance(body, dict) and "choices" in body else None}
    write_out(args.out, out)


if __name__ == "__main__":
    main()
