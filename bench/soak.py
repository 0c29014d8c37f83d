"""Soak a running `dllm-jax serve` (yours or one this script starts) and check that nothing is lost.

N requests from M concurrent clients (asyncio + httpx), mixed settings: half share one document as an affix
(ACache), lengths vary; some clients disconnect mid-stream, some requests carry a deadline too short to meet
(`timeout`: a 504 expected), one burst sends many at once, and optionally a SIGTERM at a chosen point (the server
drains: what it accepted is answered, later requests are refused). Then the distinct requests are replayed one at a
time through the same server: at temperature 0 each answer must equal its replay.

Reported (JSON): sent, answered (200), refused by status (429 / 503 / 504 / connect: never accepted), disconnected
(by this driver), lost (accepted and never answered: must be 0), duplicated (an answer id seen twice: must be 0),
wrong (an answer that differs from its replay: must be 0), the server's pages in use at the end (back to 0, from
/metrics) and, with the server's pid, its RSS over time (after warm-up: once a tenth of the requests were sent, when
the first full batches have made their allocations; and at the end).

    PYTHONPATH=. python bench/soak.py --requests 3000 --clients 64 --sigterm-at 0.9 --out bench/results/soak_cpu.json
    PYTHONPATH=. python bench/soak.py --url http://127.0.0.1:8000 --requests 500       # against your own server
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import http_clients  # noqa: E402

DOC = (
    "the code of rabbit is 0 3 0 . the code of feather is 5 1 9 . the code of yogurt is 7 7 2 . "
    "the code of wizard is 0 3 0 . the code of bottle is 2 1 6 . the code of compass is 4 2 8 ."
)
KEYS = ["rabbit", "feather", "yogurt", "wizard", "bottle", "compass"]


def jobs(
    n: int, seed: int = 0, disconnect: float = 0.05, deadline: float = 0.05, lengths: tuple[int, ...] = (4, 8, 16)
) -> list[dict]:
    """The requests: a prompt, max_tokens, sharing or not, and what the client does (finish, disconnect after its
    first chunk, or send a deadline it cannot meet)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key = KEYS[int(rng.integers(len(KEYS)))]
        question = f"question : what is the code of {key} ? reply with the digits ."
        shared = i % 2 == 0
        prompt = f"{DOC} {question}" if shared else question if rng.random() < 0.5 else f"{question} {DOC}"
        body = {"prompt": prompt, "max_tokens": int(rng.choice(lengths))}
        if shared:
            body.update(affix_technique="anchors", anchor_ratio=0.5, affix={"text": DOC})
        u = rng.random()
        kind = "disconnect" if u < disconnect else "deadline" if u < disconnect + deadline else "answer"
        if kind == "deadline":
            body.update(timeout=0.001, max_tokens=32)
        out.append({"body": body, "kind": kind})
    return out


class Report:
    def __init__(self):
        self.sent = self.answered = self.disconnected = self.lost = 0
        self.refused: collections.Counter = collections.Counter()
        self.ids: collections.Counter = collections.Counter()
        self.answers: list[tuple[str, str]] = []  # (request key, text) of the answered ones
        self.lost_examples: list[str] = []
        self.warm_time: float | None = None  # when a tenth of the requests had been sent


async def drive(
    url: str,
    job_list: list[dict],
    model: str,
    clients: int = 64,
    burst: int = 0,
    sigterm_at: float | None = None,
    server_pid: int | None = None,
    progress: bool = True,
) -> Report:
    """Send the jobs from `clients` concurrent clients (a burst of `burst` at once halfway); SIGTERM the server
    after sigterm_at of them were sent."""
    rep = Report()
    warm_at = max(1, len(job_list) // 10)  # the server's RSS after this many: its allocations' warm-up
    term_at = int(sigterm_at * len(job_list)) if sigterm_at is not None and server_pid is not None else -1
    sem = asyncio.Semaphore(clients)
    bar = tqdm(total=len(job_list), desc="soak", unit="req", disable=not progress)
    limits = httpx.Limits(max_connections=clients + burst + 8)

    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(job: dict, gate: asyncio.Semaphore | None) -> None:
            body = {"model": model, **job["body"]}
            key = json.dumps(job["body"], sort_keys=True)
            async with gate or _Null():
                rep.sent += 1
                if rep.sent == warm_at:
                    rep.warm_time = time.time()
                if rep.sent == term_at:  # a moment later: some of those sent run, some wait
                    asyncio.get_running_loop().call_later(0.5, os.kill, server_pid, signal.SIGTERM)
                try:
                    if job["kind"] == "disconnect":
                        async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                            async for _ in r.aiter_lines():
                                break  # the first event: leave
                        rep.disconnected += 1
                        return
                    r = await client.post(f"{url}/v1/completions", json=body)
                except httpx.ConnectError:
                    rep.refused["connect"] += 1
                    return
                except httpx.HTTPError as e:  # accepted, then no answer
                    rep.lost += 1
                    rep.lost_examples.append(f"{type(e).__name__}: {e}"[:200])
                    return
                finally:
                    bar.update()
                if r.status_code != 200:
                    rep.refused[str(r.status_code)] += 1
                    return
                data = r.json()
                rep.answered += 1
                rep.ids[data["id"]] += 1
                rep.answers.append((key, data["choices"][0]["text"]))

        tasks = []
        half = len(job_list) // 2
        for i, job in enumerate(job_list):
            if burst and i == half:  # many at once, past the clients' bound
                tasks += [asyncio.create_task(one(j, None)) for j in job_list[half : half + burst]]
                continue
            if burst and half < i < half + burst:
                continue
            tasks.append(asyncio.create_task(one(job, sem)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
    bar.close()
    return rep


class _Null:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


async def replay(url: str, keys: list[str], model: str) -> dict[str, str]:
    """Each distinct request alone, one at a time: its answer."""
    out = {}
    async with httpx.AsyncClient(timeout=300) as client:
        for key in keys:
            r = await client.post(f"{url}/v1/completions", json={"model": model, **json.loads(key)})
            out[key] = r.json()["choices"][0]["text"] if r.status_code == 200 else f"HTTP {r.status_code}"
    return out


def metric(url: str, name: str) -> float | None:
    try:
        found = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics", timeout=10).text, re.M)
    except httpx.HTTPError:
        return None
    return float(found.group(1)) if found else None


def rss_mib(pid: int) -> float | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024


def summary(rep: Report, replayed: dict[str, str] | None, pages_end: float | None, rss: list) -> dict:
    # an answer is checked against its request's replay where that request was replayed
    wrong = [(k, t, replayed[k]) for k, t in rep.answers if replayed is not None and k in replayed and replayed[k] != t]
    out = dict(
        sent=rep.sent,
        answered=rep.answered,
        refused=dict(rep.refused),
        disconnected=rep.disconnected,
        lost=rep.lost,
        duplicated=sum(c - 1 for c in rep.ids.values() if c > 1),
        wrong=len(wrong) if replayed is not None else None,
        wrong_examples=[dict(request=k, got=t, replay=w) for k, t, w in wrong[:3]],
        lost_examples=rep.lost_examples[:3],
        kv_pages_used_end=pages_end,
    )
    if rss:
        warm = next((v for t, v in rss if rep.warm_time is not None and t >= rep.warm_time), rss[0][1])
        out.update(
            rss_mib_after_warmup=warm, rss_mib_end=rss[-1][1], rss_mib=[(round(t - rss[0][0], 1), v) for t, v in rss]
        )
        out["rss_end_vs_warmup"] = rss[-1][1] / warm
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start `dllm-jax serve` on the CPU)")
    ap.add_argument("--server-pid", type=int, default=None, help="its pid (RSS, --sigterm-at) when --url is given")
    ap.add_argument("--serve-flags", default="--dtype float32 --max-batch 16 --max-model-len 128 --no-compile-cache")
    ap.add_argument("--model", default="dllm-jax-demo", help="the served model's name")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--burst", type=int, default=128, help="requests sent at once halfway (0: none)")
    ap.add_argument("--disconnect", type=float, default=0.05, help="share of clients that leave mid-stream")
    ap.add_argument("--deadline", type=float, default=0.05, help="share of requests with a deadline they miss")
    ap.add_argument("--sigterm-at", type=float, default=None, help="SIGTERM the server after this share was sent")
    ap.add_argument("--no-replay", action="store_true")
    ap.add_argument("--out", default=None, help="write the report here (JSON)")
    args = ap.parse_args(argv)
    proc, url, pid = None, args.url, args.server_pid
    if url is None:
        proc, url = http_clients.start_server(args.serve_flags.split())
        pid = proc.pid
    rss: list = []
    stop = False

    async def sample():
        while not stop and pid is not None:
            value = rss_mib(pid)
            if value is not None:
                rss.append((time.time(), round(value, 1)))
            await asyncio.sleep(0.5)

    async def run():
        nonlocal stop
        job_list = jobs(args.requests, disconnect=args.disconnect, deadline=args.deadline)
        replayed = None
        if not args.no_replay:  # first, so that a SIGTERM during the soak leaves it possible
            keys = sorted({json.dumps(j["body"], sort_keys=True) for j in job_list if j["kind"] == "answer"})
            replayed = await replay(url, keys, args.model)
        sampler = asyncio.create_task(sample())
        rep = await drive(url, job_list, args.model, args.clients, args.burst, args.sigterm_at, pid)
        deadline = time.time() + 10
        pages = metric(url, "dllm_jax_kv_pages_used")
        while pages and time.time() < deadline:
            await asyncio.sleep(0.1)
            pages = metric(url, "dllm_jax_kv_pages_used")
        stop = True
        await sampler
        return rep, replayed, pages

    t0 = time.time()
    try:
        rep, replayed, pages = asyncio.run(run())
    finally:
        if proc is not None and args.sigterm_at is None:
            proc.terminate()
        code = proc.wait(120) if proc is not None else None
    out = summary(rep, replayed, pages, rss)
    out.update(seconds=round(time.time() - t0, 1), requests=args.requests, clients=args.clients, burst=args.burst)
    out.update(sigterm_at=args.sigterm_at, server_exit_code=code, serve_flags=args.serve_flags)
    print(json.dumps({k: v for k, v in out.items() if k != "rss_mib"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["lost"] == 0 and out["duplicated"] == 0 and not out["wrong"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
