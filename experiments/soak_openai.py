"""A mixed-load soak through the gateway's OpenAI HTTP API of a running `specserve up`: greedy
prompts solo, then the same prompts twice at concurrency 12 beside sampled streams cancelled
after 1–5 chunks and bad requests. Prints whether each greedy output equals its solo one, the
bad requests' statuses, and the verifier's KV-page and request gauges before and after.

    specserve up --adaptive on &   # the demo pair
    python experiments/soak_openai.py [--base-url http://127.0.0.1:8000/v1] [--model demo-target]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import urllib.request

from openai import APIStatusError, AsyncOpenAI

WORDS = ("the", "cat", "sat", "on", "mat", "and", "then", "a", "dog", "ran", "past", "old", "red",
         "barn", "while", "seven", "quiet", "birds", "watched", "from", "tall", "green", "tree",
         "near", "river", "bank")
GAUGES = ("specserve_kv_pages", "specserve_running", "specserve_waiting")
# the bad requests: each breaks one field
BAD = ({"max_tokens": -3}, {"temperature": -1.0}, {"prompt": "word " * 200000}, {"top_p": 7.0},
       {"logprobs": 10**6}, {"prompt": ""})


def prompt(i: int) -> str:
    r = random.Random(i)
    return " ".join(r.choice(WORDS) for _ in range(r.randint(3, 400)))


def gauges(port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(GAUGES)}


async def greedy(c, model: str, i: int) -> str:
    r = await c.completions.create(model=model, prompt=prompt(i), max_tokens=24 + (i * 7) % 40,
                                   temperature=0)
    return r.choices[0].text


async def cancelled(c, model: str, i: int) -> str:
    s = await c.completions.create(model=model, prompt=prompt(i), max_tokens=200,
                                   temperature=0.9, seed=i, stream=True)
    n = 0
    async for _ in s:
        n += 1
        if n >= 1 + i % 5:
            await s.close()
            return "cancelled"
    return "finished"


async def bad(c, model: str, kind: int) -> str:
    kw = {"model": model, "prompt": "hello there", "max_tokens": 8, **BAD[kind]}
    try:
        await c.completions.create(**kw)
    except APIStatusError as e:
        return f"bad {kind}: {e.status_code} {str(e.message)[:90]}"
    return f"bad {kind}: accepted"


async def main(args) -> None:
    c = AsyncOpenAI(base_url=args.base_url, api_key="x", timeout=600, max_retries=0)
    n, t0 = 24, time.time()
    ref = {i: await greedy(c, args.model, i) for i in range(n)}
    print(f"{n} greedy prompts solo in {time.time() - t0:.1f} s; {gauges(args.metrics_port)}")
    sem = asyncio.Semaphore(12)

    async def job(kind: str, i: int):
        async with sem:
            if kind == "greedy":
                return kind, i, await greedy(c, args.model, i) == ref[i]
            if kind == "cancel":
                return kind, i, await cancelled(c, args.model, i)
            return kind, i, await bad(c, args.model, i % len(BAD))

    jobs = [job("greedy", i) for i in range(n)] * 2 + [job("cancel", 100 + i) for i in range(16)]
    jobs += [job("bad", i) for i in range(12)]
    random.Random(0).shuffle(jobs)
    t0 = time.time()
    res = await asyncio.gather(*jobs, return_exceptions=True)
    print(f"{len(jobs)} jobs in {time.time() - t0:.1f} s")
    errors = [r for r in res if isinstance(r, BaseException)]
    done = [r for r in res if not isinstance(r, BaseException)]
    equal = [ok for kind, _, ok in done if kind == "greedy"]
    print(f"exceptions: {len(errors)} {[repr(e)[:200] for e in errors[:5]]}")
    print(f"greedy equal to solo: {sum(equal)} / {len(equal)}")
    print(f"cancel: {sorted({r for kind, _, r in done if kind == 'cancel'})}")
    for line in sorted({r for kind, _, r in done if kind == "bad"}):
        print("  ", line)
    await asyncio.sleep(2)
    print(f"after: {gauges(args.metrics_port)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="demo-target")
    ap.add_argument("--metrics-port", type=int, default=9102, help="the verifier's metrics")
    asyncio.run(main(ap.parse_args()))
