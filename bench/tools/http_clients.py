"""HTTP clients of an OpenAI-compatible server (bench_serve's --http rows), each in a process of its own as
independent users are, streaming with the official `openai` client. Two patterns:

* closed loop (no "arrivals"): `concurrency` clients, each with one request in flight, taking the next item of one
  shared list as it finishes one (so items start in order, as the Python API's closed loop starts them);
* open loop ("arrivals": seconds from the start, one per item): item i is sent at its arrival whatever is in flight,
  by client i mod `concurrency`; its latency counts from that arrival, as the Python API's Poisson rows count it.

Imports no jax, so it starts in a second. Why processes: the `openai` client spends ~26 ms of CPU building the
request of a 2300-token prompt (this CPU; prompts as token ids). Sixteen clients in one process wait for each other
there: the successors of the requests a block call finished arrived 40-120 ms into the next call (H200,
mixed43-wait0.1), a delay no real population of clients has.

    python bench/tools/http_clients.py SPEC.json   # {"url", "concurrency", "items": [[prompt, fields], ...],
                                                   #  "arrivals": [seconds, ...] or absent}

Writes {"result": [wall seconds, [[tokens, latency s, first chunk s], ...]]} (in item order) back into SPEC.json.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import queue
import sys
import time
from pathlib import Path


async def _one(api, i: int, prompt, fields, t0: float, results) -> bool:
    """Stream item i (its latency from t0, perf_counter seconds); False if it failed (reported on `results`)."""
    first, tokens = None, 0
    try:
        stream = await api.completions.create(model="bench", prompt=prompt, stream=True, **fields)
        async for chunk in stream:
            first = first or time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if first is None:
            raise RuntimeError("the stream ended without a chunk")
        results.put((i, tokens, time.perf_counter() - t0, first - t0))
        return True
    except Exception as e:  # noqa: BLE001  the bench reports it and stops
        results.put((i, f"{type(e).__name__}: {e}"))
        return False


def client(url: str, items: list, arrivals: list | None, k: int, n: int, next_item, gates, start_at, results) -> None:
    """Client k of n: closed loop (arrivals None: items[next_item++] one at a time) or its share of an open loop
    (items k, k + n, ... at start_at + their arrival, wall-clock seconds)."""
    from openai import AsyncOpenAI

    async def run() -> None:
        async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) as api:
            for gate in gates:  # ready, then go (start_at is set in between)
                gate.wait()
            if arrivals is None:
                while True:
                    with next_item.get_lock():
                        i = next_item.value
                        next_item.value += 1
                    if i >= len(items) or not await _one(api, i, *items[i], time.perf_counter(), results):
                        return

            async def at_arrival(i: int) -> None:
                due = time.perf_counter() + start_at.value + arrivals[i] - time.time()  # its arrival, perf_counter
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                await _one(api, i, *items[i], due, results)  # late because this client was busy: counted

            await asyncio.gather(*[at_arrival(i) for i in range(k, len(items), n)])

    asyncio.run(run())


def drive(url: str, concurrency: int, items: list, arrivals: list | None = None) -> tuple[float, list]:
    # forked from this process once it has imported openai (~0.6 s of CPU a process otherwise, per client and row):
    # it runs no thread and imports no jax, so a fork is safe here
    import openai  # noqa: F401

    ctx = mp.get_context("fork")
    n = min(concurrency, len(items))
    next_item, gates, results = ctx.Value("i", 0), (ctx.Barrier(n + 1), ctx.Barrier(n + 1)), ctx.Queue()
    start_at = ctx.Value("d", 0.0)  # the open loop's time zero (wall clock), set before the clients go
    procs = [
        ctx.Process(target=client, args=(url, items, arrivals, k, n, next_item, gates, start_at, results))
        for k in range(n)
    ]
    for p in procs:
        p.start()
    ok = False
    try:
        gates[0].wait(timeout=120)  # every client has imported openai
        start_at.value = time.time()
        gates[1].wait(timeout=30)
        t0 = time.perf_counter()
        out = [None] * len(items)
        for _ in items:
            while True:  # a client that died without a word must not leave us waiting for its answers
                try:
                    i, *row = results.get(timeout=5)
                    break
                except queue.Empty:
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead or time.perf_counter() - t0 > 1800:
                        raise RuntimeError(f"clients stopped (exit codes {dead}) or 1800 s passed") from None
            if len(row) == 1:
                raise RuntimeError(f"request {i} failed: {row[0]}")
            out[i] = row
        wall, ok = time.perf_counter() - t0, True
        return wall, out
    finally:
        for p in procs:
            if ok:  # every answer is in: the clients are closing their connections
                p.join(30)
            if p.is_alive():
                p.terminate()


def main(path: str) -> int:
    spec = json.loads(Path(path).read_text())
    result = drive(spec["url"], spec["concurrency"], spec["items"], spec.get("arrivals"))
    Path(path).write_text(json.dumps({**spec, "result": result}))
    return 0


def start_server(flags: list[str], ready_within: float = 600.0):
    """`dllm-jax serve --port 0 FLAGS` in a process of its own, as a user starts it: (the process, its base URL) once
    GET /ready answers 200. Its stderr keeps being read (a full pipe would block the server)."""
    import re
    import subprocess
    import threading

    import httpx

    proc = subprocess.Popen(
        [sys.executable, "-m", "dllm_jax.cli", "serve", "--port", "0", *flags],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    for _ in range(50):
        found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", proc.stderr.readline())
        if found:
            url = found.group(1)
            break
    else:
        proc.kill()
        raise RuntimeError(f"dllm-jax serve {' '.join(flags)} did not start")
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    deadline = time.time() + ready_within
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=10).status_code == 200:
                return proc, url
        except httpx.HTTPError:  # a cluster's HTTP proxy may not listen yet
            pass
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"{url} did not get ready within {ready_within:g} s")
        time.sleep(0.2)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
