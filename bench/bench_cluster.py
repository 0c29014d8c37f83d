"""Replicas on Ray Serve (`dllm-jax serve --replicas N`, started exactly as a user starts it): affix routing against
round-robin (`--no-affinity`, the least loaded with ties in turn), and one engine without Ray, on the same mixed
workload of the bundled model's tasks (rule, lookup and locate problems: affixes shared by several questions, each
request at its own placement, 16 or 32 answer tokens), sent over HTTP by a closed loop of clients.

Per row: affix hit rate (requests that found their affix stored on the replica that served them: the engines'
`affix_hits` / (`affix_hits` + `affix_builds`), read from each replica's /metrics), the affix copies stored in the
cluster (builds), the peak KV bytes of every replica summed and per served request, the requests each replica
served, tokens/s and p50 / p99 latency. On the CPU the replicas share its cores, so tokens/s and latency say little;
hit rate, copies and bytes do not depend on speed. Writes bench/results/cluster_cpu.json and a plot beside it.

    PYTHONPATH=. python bench/bench_cluster.py --replicas 1 2 4 --run NAME
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common, http_clients  # noqa: E402

FLAGS = ["--dtype", "float32", "--max-batch", "4", "--max-model-len", "256", "--affix-technique", "anchors"]
TASKS = ("rule", "lookup", "locate")


def workload(n_affixes: int, per_affix: int, seed: int = 0) -> list[dict]:
    """n_affixes shared contexts (tasks in turn), per_affix questions on each, shuffled; each request at a random
    placement with its affix named as a token span."""
    import dllm_jax
    from dllm_jax.tasks import generate as problems
    from dllm_jax.tasks import render
    from dllm_jax.tasks.generators import PLACEMENTS

    vocab = dllm_jax.load().tokenizer.hf.get_vocab()
    rng = random.Random(seed)
    out = []
    for a in range(n_affixes):
        task = TASKS[a % len(TASKS)]
        group = problems(task, "heldout", per_affix, seed=seed * 1000 + a, per_shared=per_affix)
        for p in group:
            r = render(p, rng.choice(PLACEMENTS), vocab)
            start, end = r.affix_span
            out.append(
                dict(
                    prompt=list(r.prompt), affix={"start": start, "end": end}, max_tokens=rng.choice([16, 32]), group=a
                )
            )
    rng.shuffle(out)
    return out


def distinct_affixes(reqs: list[dict]) -> set[tuple]:
    """The workload's distinct affix contents (what the engines store: one copy each at best)."""
    return {tuple(r["prompt"][r["affix"]["start"] : r["affix"]["end"]]) for r in reqs}


def start(replicas: int, affinity: bool, spill_queue: int) -> tuple[subprocess.Popen, str]:
    cluster = [] if replicas == 1 else ["--replicas", str(replicas), "--spill-queue", str(spill_queue)]
    cluster += [] if affinity else ["--no-affinity"]
    return http_clients.start_server([*FLAGS, *cluster], ready_within=900)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def per_replica(url: str) -> dict[str, dict[str, float]]:
    """{replica: {metric: value}} of the counters this bench reads (one engine: a single replica "0")."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    wanted = {
        "dllm_jax_affix_hits_total",
        "dllm_jax_affix_builds_total",
        "dllm_jax_requests_finished_total",
        "dllm_jax_kv_bytes_peak",
        "dllm_jax_generation_tokens_total",
    }
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out.setdefault(s.labels.get("replica", "0"), {})[s.name] = s.value
    return out


def drive(url: str, reqs: list[dict], clients: int) -> tuple[float, list[float], int]:
    """A closed loop of `clients`: (wall seconds, latencies, answer tokens)."""
    it, lock = iter(reqs), threading.Lock()
    latencies, tokens = [], [0]

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    r = next(it, None)
                if r is None:
                    return
                body = {"model": "dllm-jax-demo", "prompt": r["prompt"], "max_tokens": r["max_tokens"]}
                t = time.perf_counter()
                answer = http.post(f"{url}/v1/completions", json={**body, "affix": r["affix"]})
                answer.raise_for_status()
                latencies.append(time.perf_counter() - t)
                tokens[0] += answer.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    return time.perf_counter() - t0, latencies, tokens[0]


def row(replicas: int, affinity: bool, reqs: list[dict], args) -> dict:
    proc, url = start(replicas, affinity, args.spill_queue)
    try:
        before = per_replica(url)
        wall, latencies, tokens = drive(url, reqs, args.clients)
        after = per_replica(url)
    finally:
        stop(proc)

    def delta(name: str) -> dict[str, float]:
        return {k: after[k].get(name, 0.0) - before.get(k, {}).get(name, 0.0) for k in after}

    hits, builds = delta("dllm_jax_affix_hits_total"), delta("dllm_jax_affix_builds_total")
    served = delta("dllm_jax_requests_finished_total")
    peak = sum(v.get("dllm_jax_kv_bytes_peak", 0.0) for v in after.values())
    n_hits, n_builds = sum(hits.values()), sum(builds.values())
    return dict(
        replicas=replicas,
        routing="affix" if affinity else "round_robin",
        requests=len(reqs),
        affix_groups=len({r["group"] for r in reqs}),
        affixes=len(distinct_affixes(reqs)),  # contents: a group's affix tokens may differ by placement
        affix_hit_rate=n_hits / max(1.0, n_hits + n_builds),
        affix_copies=int(n_builds),
        kv_peak_bytes=int(peak),
        kv_peak_bytes_per_request=peak / len(reqs),
        served_per_replica=sorted(int(v) for v in served.values()),
        tokens_per_s=tokens / wall,
        p50_s=float(np.percentile(latencies, 50)),
        p99_s=float(np.percentile(latencies, 99)),
        wall_s=wall,
        clients=args.clients,
        spill_queue=args.spill_queue,
    )


def plot(rows: list[dict], path: Path) -> None:
    labels = [f"{r['replicas']} {r['routing']}" for r in rows]
    common.grouped_bars(
        path,
        labels,
        [("affix hit rate", [r["affix_hit_rate"] for r in rows])],
        "requests that found their affix stored",
        "replicas on Ray Serve: affix routing vs round-robin (bundled model, CPU)",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--affixes", type=int, default=12, help="shared contexts in the workload")
    ap.add_argument("--per-affix", type=int, default=8, help="questions on each")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop HTTP clients")
    ap.add_argument("--spill-queue", type=int, default=8, help="serve --spill-queue for the affix-routed rows")
    common.output_args(ap, common.RESULTS / "cluster_cpu.json")
    args = ap.parse_args(argv)
    reqs = workload(args.affixes, args.per_affix)
    meta = common.meta(
        flags=" ".join(FLAGS),
        workload=f"{args.affixes} affixes x {args.per_affix} questions of the bundled model's tasks, random placements",
    )
    rows, out = [], Path(args.out)
    plan = [(n, True) for n in args.replicas] + [(n, False) for n in args.replicas if n > 1]
    for n, affinity in plan:
        print(f"{n} replica(s), {'affix' if affinity else 'round-robin'} routing ...", flush=True)
        rows.append(row(n, affinity, reqs, args))
        r = rows[-1]
        print(
            f"    hit rate {r['affix_hit_rate']:.3f}, {r['affix_copies']} copies, "
            f"peak KV {r['kv_peak_bytes'] / 2**20:.1f} MiB, served {r['served_per_replica']}, "
            f"{r['tokens_per_s']:.1f} tok/s, p99 {r['p99_s']:.2f} s",
            flush=True,
        )
        path = common.write_results(out.name, meta, rows, out.parent, args.run)
    plot([r for r in json.loads(path.read_text())["rows"] if r.get("run") == args.run], out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
