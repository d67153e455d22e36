"""Two running streams while a third request waits for a slot, with one busy process elsewhere
on the host, through `specserve up` on the CPU demo pair (`--max-num-seqs 2`): the running
streams' wall time and middle gap between chunks, without and with the waiting request. A
waiting request made every decode step a prompt step under `--threads auto` (every core)
before a3d4e3a; `--repo` another checkout for a before/after.

    python experiments/queued_request_threads.py --out F [--repo a checkout of the code before]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from served_audit import (  # a sibling: this directory is on the path
    audit_parser,
    running_up,
    write_out,
)


def stream(port: int, prompt: list[int], max_tokens: int, box: dict) -> None:
    """One streamed completion: its wall time and the middle gap between its chunks."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0, times = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    box.update(wall_s=round(time.perf_counter() - t0, 2),
               middle_gap_ms=round(1e3 * statistics.median(gaps), 1) if gaps else None)


def run(port: int, queued: bool) -> list[dict]:
    ids = [5 + (i * 37) % 3900 for i in range(400)]
    boxes = [{}, {}, {}]
    workers = [threading.Thread(target=stream, args=(port, ids[k * 100:k * 100 + 50], 1500,
                                                     boxes[k])) for k in range(2)]
    if queued:
        workers.append(threading.Thread(target=stream, args=(port, ids[300:350], 50, boxes[2])))
    for k, w in enumerate(workers):
        w.start()
        time.sleep(0.5 if k == 1 else 0.0)
    for w in workers:
        w.join()
    return boxes[:len(workers)]


def main() -> None:
    args = audit_parser(__doc__, 64711).parse_args()
    http_port, log = args.ports + 30, Path(tempfile.mkdtemp()) / "up.log"
    out: dict = {"repo": os.path.abspath(args.repo)}
    with running_up(args.repo, args.ports, http_port, log, SPECSERVE_MAX_NUM_SEQS="2",
                    SPECSERVE_MAX_WAITING="4"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            out["alone"] = run(http_port, queued=False)
            out["one_waiting"] = run(http_port, queued=True)
        finally:
            busy.kill()
    write_out(args.out, out)


if __name__ == "__main__":
    main()
