"""Closed-loop clients of an OpenAI-compatible server in a process of their own (bench_serve's --http rows): the
official `openai` client's async API, streaming, `concurrency` requests in flight. Imports no jax, so it starts in
a fraction of a second.

    python bench/tools/http_clients.py SPEC.json   # {"url", "concurrency", "items": [[prompt, fields], ...]}

Writes {"result": [wall seconds, [[tokens, latency s, first chunk s], ...]]} back into SPEC.json.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from openai import AsyncOpenAI


async def drive(url: str, concurrency: int, items: list) -> tuple[float, list]:
    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt, fields):
        async with sem:
            t0 = time.perf_counter()
            first, tokens = None, 0
            stream = await client.completions.create(model="bench", prompt=prompt, stream=True, **fields)
            async for chunk in stream:
                first = first or time.perf_counter()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens, time.perf_counter() - t0, first - t0

    t0 = time.perf_counter()
    async with client:  # closed inside the loop
        out = await asyncio.gather(*[one(p, f) for p, f in items])
    return time.perf_counter() - t0, out


def main(path: str) -> int:
    spec = json.loads(Path(path).read_text())
    result = asyncio.run(drive(spec["url"], spec["concurrency"], spec["items"]))
    Path(path).write_text(json.dumps({**spec, "result": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
