"""Closed-loop clients of an OpenAI-compatible server (bench_serve's --http rows): `concurrency` clients, each in a
process of its own as independent users are, each streaming one request at a time with the official `openai`
client, taking the next item of one shared list as it finishes one (so items start in order, as the Python API's
closed loop starts them). Imports no jax, so it starts in a second.

Why processes: the `openai` client spends ~26 ms of CPU building the request of a 2300-token prompt (this CPU;
prompts as token ids). Sixteen clients in one process wait for each other there: the successors of the requests a
block call finished arrived 40-120 ms into the next call (H200, mixed43-wait0.1), a delay no real population of
clients has.

    python bench/tools/http_clients.py SPEC.json   # {"url", "concurrency", "items": [[prompt, fields], ...]}

Writes {"result": [wall seconds, [[tokens, latency s, first chunk s], ...]]} (in item order) back into SPEC.json.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path


def client(url: str, items: list, next_item, start, results) -> None:
    """One client: after `start`, request items[next_item++] until none is left; (index, tokens, latency, first
    chunk) of each go on `results`."""
    from openai import AsyncOpenAI

    async def run() -> None:
        async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as api:
            start.wait()
            while True:
                with next_item.get_lock():
                    i = next_item.value
                    next_item.value += 1
                if i >= len(items):
                    return
                prompt, fields = items[i]
                t0 = time.perf_counter()
                first, tokens = None, 0
                try:
                    stream = await api.completions.create(model="bench", prompt=prompt, stream=True, **fields)
                    async for chunk in stream:
                        first = first or time.perf_counter()
                        if chunk.usage is not None:
                            tokens = chunk.usage.completion_tokens
                except Exception as e:  # noqa: BLE001  the bench reports it and stops
                    results.put((i, f"{type(e).__name__}: {e}"))
                    return
                results.put((i, tokens, time.perf_counter() - t0, first - t0))

    asyncio.run(run())


def drive(url: str, concurrency: int, items: list) -> tuple[float, list]:
    ctx = mp.get_context("spawn")
    next_item, start, results = ctx.Value("i", 0), ctx.Barrier(concurrency + 1), ctx.Queue()
    procs = [ctx.Process(target=client, args=(url, items, next_item, start, results)) for _ in range(concurrency)]
    for p in procs:
        p.start()
    start.wait(timeout=120)  # every client has imported openai and opened its connection pool
    t0 = time.perf_counter()
    out = [None] * len(items)
    for _ in items:
        i, *row = results.get(timeout=1800)
        if len(row) == 1:
            for p in procs:
                p.terminate()
            raise RuntimeError(f"request {i} failed: {row[0]}")
        out[i] = row
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    return wall, out


def main(path: str) -> int:
    spec = json.loads(Path(path).read_text())
    result = drive(spec["url"], spec["concurrency"], spec["items"])
    Path(path).write_text(json.dumps({**spec, "result": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
