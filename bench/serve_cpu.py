"""`dllm-jax serve` on the CPU with the bundled model, as a new user runs it, for several source trees in one run
(a change against its baseline).

Each tree starts its own `dllm-jax serve` (serve's defaults, a fresh compilation cache), waits for /ready, then sends
bursts of concurrent chat requests (the README's digit-rule prompt with other inputs) of three kinds: `default` (the
model's own settings: a 3-token answer), `long` (max_tokens 32) and `mixed` (temperature 0 / 0.7, max_tokens 8-32,
the examples shared as an affix exactly, with ACache at ratio 0 / 0.2, or naively, or not at all). A row per tree and
kind: the median burst's seconds, its completion tokens/s, each request's p50 / p99 latency, and the compiles after
the warm-up (must stay 0). Writes bench/results/serve_cpu.json (rows merged by --run) and serve_cpu.png.

    PYTHONPATH=. python bench/serve_cpu.py --run NAME --trees . /path/to/baseline-worktree
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402

EXAMPLES = "rule examples : 7 4 0 -> 2 5 9 ; 3 6 8 -> 6 3 1 ; 6 5 2 -> 3 4 7 ; 4 3 4 -> 5 6 5 ; 0 4 1 -> 9 5 8 ;"
KINDS = ("default", "long", "mixed")
READY_TIMEOUT_S, REQUEST_TIMEOUT_S = 600.0, 300.0


def body(kind: str, i: int) -> dict:
    """Request i of a burst of this kind (seeded by i: every tree gets the same requests)."""
    r = random.Random(i)
    digits = " ".join(str(r.randrange(10)) for _ in range(3))
    out = dict(
        model="dllm-jax-demo",
        messages=[dict(role="user", content=f"{EXAMPLES} input : {digits} what does the rule give ?")],
    )
    if kind == "long":
        out.update(max_tokens=32)
    if kind == "mixed":
        out.update(temperature=r.choice([0.0, 0.7]), max_tokens=r.choice([8, 16, 32]))
        technique = r.choice(["none", "anchors", "naive", None])
        if technique is not None:
            out.update(affix=dict(text=EXAMPLES), affix_technique=technique)
            if technique == "anchors":
                out.update(anchor_ratio=r.choice([0.0, 0.2]))
    return out


async def burst(client: httpx.AsyncClient, kind: str, n: int, first: int) -> tuple[float, int, list[float]]:
    """n requests at once: the burst's seconds, its completion tokens and each request's latency."""

    async def one(i: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        reply = await client.post("/v1/chat/completions", json=body(kind, i))
        reply.raise_for_status()
        return time.perf_counter() - t0, reply.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(first + i) for i in range(n)))
    return time.perf_counter() - t0, sum(d[1] for d in done), [d[0] for d in done]


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else float("nan")


async def drive(url: str, requests: int, bursts: int) -> tuple[list[dict], dict]:
    rows = []
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as client:
        for kind in KINDS:
            runs = [await burst(client, kind, requests, 1000 * b) for b in range(bursts)]
            mid = sorted(runs)[len(runs) // 2]  # the median burst by seconds
            lat = sorted(x for run in runs for x in run[2])
            rows.append(
                dict(
                    kind=kind,
                    requests=requests,
                    bursts=bursts,
                    burst_s=mid[0],
                    burst_s_all=[r[0] for r in runs],
                    tokens_per_s=mid[1] / mid[0],
                    latency_p50_s=statistics.median(lat),
                    latency_p99_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                )
            )
            print(f"  {kind}: {mid[0]:.2f} s a burst of {requests}, {mid[1] / mid[0]:.1f} tokens/s", flush=True)
        metrics = (await client.get("/metrics")).text
    return rows, dict(
        compiles_after_warmup=metric(metrics, "dllm_jax_compiles_after_warmup_total"),
        warmup_s=metric(metrics, "dllm_jax_warmup_seconds"),
        programs=metric(metrics, "dllm_jax_programs"),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_tree(tree: Path, tmp: Path, requests: int, bursts: int) -> tuple[list[dict], dict]:
    """One tree's `dllm-jax serve` (run from the tree: its own code; its log in tmp), driven, then stopped with
    SIGTERM."""
    port = free_port()
    command = [sys.executable, "-c", "from dllm_jax.cli import main; raise SystemExit(main())"]
    command += ["serve", "--host", "127.0.0.1", "--port", str(port), "--compile-cache", str(tmp / "xla")]
    env, log = dict(os.environ, PYTHONPATH=str(tree)), tmp / "serve.log"
    with log.open("w") as f:
        server = subprocess.Popen(command, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)
    url, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
    try:
        while time.perf_counter() - t0 < READY_TIMEOUT_S:
            if server.poll() is not None:
                raise RuntimeError(f"serve exited with {server.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError(f"serve was not ready after {READY_TIMEOUT_S:.0f} s")
        ready_s = time.perf_counter() - t0
        try:
            rows, info = asyncio.run(drive(url, requests, bursts))
        except httpx.HTTPError as e:
            raise RuntimeError(f"{type(e).__name__} {e}; the server's log ends: {log.read_text()[-2000:]}") from e
        return rows, dict(info, ready_s=ready_s)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = list(dict.fromkeys(r["tree"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(trees)
    for j, tree in enumerate(trees):
        xs = [KINDS.index(r["kind"]) + j * width for r in rows if r["tree"] == tree]
        ax.bar(xs, [r["burst_s"] for r in rows if r["tree"] == tree], width, label=tree)
    ax.set_xticks([i + width * (len(trees) - 1) / 2 for i in range(len(KINDS))], KINDS)
    ax.set_ylabel(f"seconds a burst of {rows[0]['requests']} requests")
    ax.set_title("dllm-jax serve on the CPU, the bundled model (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="source trees to serve (the first: this change)")
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests a burst")
    ap.add_argument("--bursts", type=int, default=3, help="bursts of each kind (the median is reported)")
    common.output_args(ap)
    args = ap.parse_args(argv)
    if args.requests < 1 or args.bursts < 1:
        ap.error("--requests and --bursts must be positive")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, tree in enumerate(map(Path, args.trees)):
            commit = subprocess.run(
                ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            print(f"{tree} ({commit}):", flush=True)
            (Path(tmp) / str(i)).mkdir()
            tree_rows, info = serve_tree(tree.resolve(), Path(tmp) / str(i), args.requests, args.bursts)
            rows += [dict(r, tree=commit, path=str(tree), **info) for r in tree_rows]
            meta = common.meta(model="the bundled model", serve="dllm-jax serve (defaults)", trees=args.trees)
            path = common.write_results("serve_cpu.json", meta, rows, args.out, args.run)
    plot(rows, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
