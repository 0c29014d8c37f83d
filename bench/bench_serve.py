"""How fast and how lean does the serving engine run many requests that share an affix? LLaDA-8B shapes, random
bf16 weights (speed does not depend on them).

Workloads in the terms of SGLang's `bench_serving --dataset-name generated-shared-prefix`: one group of
--requests prompts, each a shared affix of --affix-len tokens (the "system prompt") and --question-len tokens of
its own, placed as a prefix [affix | own], an infix [own[:half] | affix | own[half:]] or a suffix [own | affix];
--output-len generated tokens, block 32, 8 steps a block (64 steps: random weights never pass a threshold).
  closed16      a closed loop: 16 requests in flight, the next submitted as one finishes
  poisson_R     open loop: Poisson arrivals at R requests/s
Rows (`sharing`): off (the dual cache, every request its own copy of the affix), on (one stored copy; ACache at
`ratio` 0, 0.2 and 1), generate (per-call `dllm_jax.generate` at batch 16 on the same prompts, the reference).
Columns: tokens_per_s (generated tokens / wall time of the whole workload), p50_s / p99_s (request latency, from
its arrival to its last block), peak_kv_bytes (pages held at the peak), probe_ms_per_request, max_requests_16gib
(how many such requests a 16 GiB KV pool holds at once: the shared copy once plus each request's private pages),
compiles_after_warmup (XLA compilations during the timed run), and the same-run ratios to sharing off.
--http serves the same workload through `dllm-jax serve`'s app (uvicorn on 127.0.0.1, the official `openai` client,
prompts sent as token ids, one client task per request in flight) after the same row through the Python API
(rows `transport` python and http, `vs_python` their ratio).
Writes bench/results/serve_h200.json (rows merged by --run label; serve_cpu_smoke.json on the CPU) and a plot.

    PYTHONPATH=. python bench/bench_serve.py --run NAME                       # the closed16 rows at 1024 tokens
    PYTHONPATH=. python bench/bench_serve.py --affix-len 2048 --ratios 0 0.2 --placements prefix --run NAME
    PYTHONPATH=. python bench/bench_serve.py --workloads poisson_2 poisson_4 poisson_8 --ratios 0.2 --run NAME
    PYTHONPATH=. python bench/bench_serve.py --http --placements prefix --ratios 0.2 --no-generate --run NAME
"""

from __future__ import annotations

import argparse
import gc as gc_module
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402

# package imports (re-point here when the package moves)
from dllm_jax.decoding.config import GenerationConfig  # noqa: E402
from dllm_jax.decoding.generate import generate  # noqa: E402
from dllm_jax.engine.engine import Engine, EngineConfig  # noqa: E402
from dllm_jax.engine.kv_pool import kv_bytes_per_token  # noqa: E402
from dllm_jax.engine.runner import backend_compiles  # noqa: E402

GIB = 1 << 30


def prompts_for(placement: str, affix: list[int], own: list[list[int]]) -> list[tuple[list[int], tuple[int, int]]]:
    out = []
    for q in own:
        head = {"prefix": [], "infix": q[: len(q) // 2], "suffix": q}[placement]
        tail = {"prefix": q, "infix": q[len(q) // 2 :], "suffix": []}[placement]
        out.append((head + affix + tail, (len(head), len(head) + len(affix))))
    return out


def gen_config(args, ratio: float | None, technique: str = "acache") -> GenerationConfig:
    """ratio None: sharing off; technique "bicache": BiCache at the paper's table depth (LLaDA-8B / Dream-7B)."""
    extra = {} if ratio is None else dict(affix="anchors", anchor_ratio=ratio)
    if technique == "bicache":
        extra = dict(affix="shallow", shallow_depth=args.bicache_depth)
    return GenerationConfig.from_options(
        gen_length=args.output_len,
        block_length=args.block_len,
        steps=args.output_len // args.block_len * args.steps_per_block,
        cache="dual",
        stop_at_eos=False,
        **extra,
    )


def drive(engine: Engine, items, workload: str, concurrency: int, rng) -> dict:
    """Serve (prompt, span) items under the workload; returns timings."""
    gc_items = list(items)
    arrivals = None
    if workload.startswith("poisson_"):
        rate = float(workload.split("_", 1)[1])
        arrivals = np.cumsum(rng.exponential(1.0 / rate, len(gc_items)))
    t0 = time.perf_counter()
    submitted, ids, done = 0, [], 0
    while done < len(gc_items):
        now = time.perf_counter() - t0
        if arrivals is None:  # closed loop: keep `concurrency` in flight
            while submitted < len(gc_items) and submitted - done < concurrency:
                prompt, gc, span = gc_items[submitted]
                ids.append(engine.add_request(prompt, gc, affix=span))
                submitted += 1
        else:
            while submitted < len(gc_items) and arrivals[submitted] <= now:
                prompt, gc, span = gc_items[submitted]
                ids.append(engine.add_request(prompt, gc, affix=span))
                engine.request(ids[-1]).arrival = t0 + arrivals[submitted]
                submitted += 1
            if not engine.has_unfinished() and submitted < len(gc_items):
                time.sleep(max(0.0, arrivals[submitted] - now))
                continue
        done += sum(1 for o in engine.step() if o.finished)
    wall = time.perf_counter() - t0
    reqs = [engine.request(i) for i in ids]
    lat = np.array([r.finish_time - r.arrival for r in reqs])
    return reqs, dict(
        seconds=wall,
        tokens=sum(len(r.generated) for r in reqs),
        p50_s=float(np.percentile(lat, 50)),
        p99_s=float(np.percentile(lat, 99)),
        ttfb_p50_s=float(np.median([r.first_block_time - r.arrival for r in reqs])),
    )


def engine_for(model, args, budget: int) -> Engine:
    return Engine(
        model,
        EngineConfig(
            max_batch=args.concurrency,
            kv_budget_bytes=budget,
            max_model_len=args.max_len,
            batch_sizes=(args.concurrency,),
            min_affix_tokens=min(64, args.affix_len),
        ),
    )


def engine_row(
    model,
    args,
    workload: str,
    placement: str,
    ratio: float | None,
    items,
    budget: int,
    technique: str = "acache",
    transport: str = "python",
) -> dict:
    gc = gen_config(args, ratio, technique)
    shared = ratio is not None or technique == "bicache"
    engine = engine_for(model, args, budget)
    spans = [span if shared else None for _, span in items]
    warm = engine.warmup([(p, gc, s) for (p, _), s in zip(items[:2], spans[:2])])
    before = backend_compiles()
    sizing = engine.plan_request(items[0][0], gc, spans[0], remember=False)  # its pages and depth
    if transport == "http":
        timing = http_drive(engine, args, [(p, gc, s) for (p, _), s in zip(items, spans)], workload)
    else:
        _, timing = drive(
            engine,
            [(p, gc, s) for (p, _), s in zip(items, spans)],
            workload,
            args.concurrency,
            np.random.default_rng(0),
        )
    per_token = kv_bytes_per_token(model.config)
    page_bytes = engine.block_manager.page_size * per_token
    private = -(-sizing.private_tokens() // engine.block_manager.page_size) * page_bytes
    shared_bytes = -(-args.affix_len // engine.block_manager.page_size) * page_bytes if shared else 0
    c = dict(engine.counters)
    host_s, device_s = engine.runner.host_seconds, engine.runner.device_seconds
    del engine  # its pool goes before the next row's is allocated
    gc_module.collect()
    return dict(
        workload=workload,
        affix_len=args.affix_len,
        placement=placement,
        sharing="on" if shared else "off",
        technique=technique if shared else "dual",
        ratio=ratio,
        depth=sizing.depth if technique == "bicache" else None,
        transport=transport,
        tokens_per_s=timing["tokens"] / timing["seconds"],
        **timing,
        peak_kv_bytes=c["peak_pages"] * page_bytes,
        probe_ms_per_request=1e3 * c["probe_seconds"] / c["probes"] if c["probes"] else None,
        max_requests_16gib=int((16 * GIB - shared_bytes) // private),
        compiles_after_warmup=backend_compiles() - before,
        warmup_compiles=warm,
        requests=len(items),
        private_bytes_per_request=private,
        shared_bytes=shared_bytes,
        block_host_s=host_s,
        block_device_s=device_s,
        probe_s=c["probe_seconds"],
        block_calls=c["blocks"],
    )


class IdTokenizer:
    """What the server needs of a tokenizer, for random weights that have none: a token is its id as text."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]


def http_drive(engine: Engine, args, items, workload: str) -> tuple[dict, list]:
    """The workload through the HTTP API: uvicorn in a thread, the openai client's async API, closed loop."""
    import asyncio
    import dataclasses
    import threading

    import uvicorn
    from openai import AsyncOpenAI

    from dllm_jax.server import EngineService, ServeSettings, create_app
    from dllm_jax.server.run import bind

    if engine.model.tokenizer is None:
        engine.model = dataclasses.replace(engine.model, tokenizer=IdTokenizer())
    service = EngineService(engine).start()
    app = create_app(
        service, ServeSettings(model_name="bench", max_tokens=args.output_len, block_length=args.block_len)
    )
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    gc = items[0][1]
    affix = gc.cache.affix
    extra = dict(
        block_length=args.block_len,
        steps=gc.schedule.steps,
        affix_technique={None: "none", "anchors": "anchors", "naive": "naive"}.get(
            None if affix is None else affix.name, "none"
        ),
    )
    if affix is not None and affix.name == "anchors":
        extra["anchor_ratio"] = affix.ratio

    async def run():
        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        sem = asyncio.Semaphore(args.concurrency)
        lat = []

        async def one(prompt, span):
            async with sem:
                t0 = time.perf_counter()
                body = dict(extra, affix={"start": span[0], "end": span[1]} if span else "none")
                r = await client.completions.create(
                    model="bench", prompt=prompt, max_tokens=args.output_len, temperature=0, extra_body=body
                )
                lat.append(time.perf_counter() - t0)
                return r.usage.completion_tokens

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*[one(p, s) for p, _, s in items])
        return time.perf_counter() - t0, sum(tokens), lat

    try:
        wall, tokens, lat = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(30)
        service.stop()
    timing = dict(seconds=wall, tokens=tokens, p50_s=float(np.percentile(lat, 50)), p99_s=float(np.percentile(lat, 99)))
    return timing


def generate_row(model, args, workload: str, placement: str, items) -> dict:
    """The per-call reference: generate at batch `concurrency` over the same prompts (dual cache, no sharing)."""
    gc = gen_config(args, None)
    prompts = [p for p, _ in items]
    b = args.concurrency
    generate(model, prompts[:b], gc)  # compile
    t0 = time.perf_counter()
    lat = []
    for i in range(0, len(prompts), b):
        generate(model, prompts[i : i + b], gc)
        lat += [time.perf_counter() - t0] * len(prompts[i : i + b])
    wall = time.perf_counter() - t0
    return dict(
        workload=workload,
        affix_len=args.affix_len,
        placement=placement,
        sharing="generate",
        technique="dual",
        ratio=None,
        transport="python",
        tokens_per_s=len(prompts) * args.output_len / wall,
        seconds=wall,
        p50_s=float(np.percentile(lat, 50)),
        p99_s=float(np.percentile(lat, 99)),
        peak_kv_bytes=b * (len(prompts[0]) + args.output_len) * kv_bytes_per_token(model.config),
        probe_ms_per_request=None,
        max_requests_16gib=None,
        compiles_after_warmup=0,
        requests=len(prompts),
    )


def plot(rows: list[dict], path: Path) -> None:
    """Tokens/s of every row in the results file, grouped by workload, placement and affix length."""

    def kind(r: dict) -> str:
        name = {"off": "off (own copy)", "generate": "generate"}.get(r["sharing"])
        name = name or ("BiCache" if r["technique"] == "bicache" else f"ACache r{r['ratio']:g}")
        return name + (" http" if r.get("transport") == "http" else "")

    labels = [f"{r['workload']} {r['placement']} {r['affix_len']}" for r in rows]
    keys, kinds = list(dict.fromkeys(labels)), list(dict.fromkeys(kind(r) for r in rows))
    latest = {(lab, kind(r)): r["tokens_per_s"] for r, lab in zip(rows, labels)}
    series = [(k, [latest.get((lab, k), 0) for lab in keys]) for k in kinds]
    common.grouped_bars(path, keys, series, "tokens / s", "serving engine: a shared affix, 16 requests in flight")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-8b", choices=list(common.MODELS))
    ap.add_argument("--workloads", nargs="+", default=["closed16"], help="closed16 and/or poisson_RATE")
    ap.add_argument("--placements", nargs="+", default=["prefix", "infix", "suffix"])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.0, 0.2, 1.0], help="ACache ratios (sharing on)")
    ap.add_argument("--no-off", action="store_true", help="skip the sharing-off rows")
    ap.add_argument("--no-generate", action="store_true", help="skip the per-call generate reference")
    ap.add_argument("--bicache", action="store_true", help="BiCache rows too")
    ap.add_argument("--bicache-depth", type=int, default=None, help="BiCache's depth (default: the paper's table)")
    ap.add_argument("--http", action="store_true", help="through the HTTP server and the openai client")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--affix-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--block-len", type=int, default=32)
    ap.add_argument("--steps-per-block", type=int, default=8)
    ap.add_argument("--kv-budget-gib", type=float, default=16.0, help="the engine's KV pool (the same in every row)")
    common.output_args(ap, budget_s=540.0)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    model = common.random_model(args.model)
    cfg = model.config
    args.max_len = args.affix_len + args.question_len + args.output_len
    rng = np.random.default_rng(0)
    hi = min(100_000, cfg.vocab_size - 3)
    affix = rng.integers(0, hi, args.affix_len).tolist()
    own = [rng.integers(0, hi, args.question_len).tolist() for _ in range(args.requests)]
    budget = int(args.kv_budget_gib * GIB)
    rows, skipped = [], []
    # the plan: sharing off once per workload (it has no placement), each ratio and BiCache per placement, and the
    # per-call generate reference once
    plan = []
    for workload in args.workloads:
        if not args.no_off:
            plan.append((workload, args.placements[0], None, "dual"))
        plan += [(workload, pl, r, "acache") for pl in args.placements for r in args.ratios]
        plan += [(workload, pl, None, "bicache") for pl in args.placements if args.bicache]
    # --http: each row through the Python API, then the same through HTTP (the ratio compares the two)
    plan = [(*p, t) for p in plan for t in (("python", "http") if args.http else ("python",))]
    for workload, placement, ratio, technique, transport in plan:
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(dict(workload=workload, placement=placement, ratio=ratio, technique=technique))
            continue
        try:
            row = engine_row(
                model,
                args,
                workload,
                placement,
                ratio,
                prompts_for(placement, affix, own),
                budget,
                technique,
                transport,
            )
        except Exception as e:  # noqa: BLE001  one failing row must not lose the run
            print(f"FAILED {workload} {placement} {technique} {ratio}: {type(e).__name__}: {e}", flush=True)
            skipped.append(
                dict(workload=workload, placement=placement, ratio=ratio, technique=technique, error=str(e)[:300])
            )
            continue
        if transport == "http" and rows and rows[-1]["transport"] == "python":
            row["vs_python"] = row["tokens_per_s"] / rows[-1]["tokens_per_s"]
        base = next(
            (r for r in rows if r["sharing"] == "off" and r["workload"] == workload and r["transport"] == transport),
            None,
        )
        if base is not None and row["sharing"] == "on":
            row["speedup_vs_off"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["peak_kv_vs_off"] = row["peak_kv_bytes"] / base["peak_kv_bytes"]
            row["capacity_vs_off"] = row["max_requests_16gib"] / base["max_requests_16gib"]
        rows.append(row)
        print(
            f"[{time.perf_counter() - t_start:5.0f}s] {workload} {placement} {row['technique']} r={ratio} "
            f"{row['transport']}: {row['tokens_per_s']:8.1f} tok/s p50 {row['p50_s']:.2f}s p99 {row['p99_s']:.2f}s "
            f"peak KV {row['peak_kv_bytes'] / GIB:.2f} GiB x{row.get('speedup_vs_off', 1):.2f} "
            f"probe {row['probe_ms_per_request'] or 0:.1f} ms compiles {row['compiles_after_warmup']}",
            flush=True,
        )
        save(args, rows, skipped)
    if not args.no_generate and time.perf_counter() - t_start <= args.budget_s:
        row = generate_row(model, args, "closed16", args.placements[0], prompts_for(args.placements[0], affix, own))
        off = next((r for r in rows if r["sharing"] == "off" and r["workload"] == "closed16"), None)
        if off is not None:
            off["vs_generate"] = off["tokens_per_s"] / row["tokens_per_s"]
        rows.append(row)
        print(
            f"[{time.perf_counter() - t_start:5.0f}s] generate b{args.concurrency}: {row['tokens_per_s']:8.1f} tok/s"
            + (f" (sharing off: x{off['vs_generate']:.3f})" if off else ""),
            flush=True,
        )
        save(args, rows, skipped)
    path = save(args, rows, skipped)
    plot(json.loads(path.read_text())["rows"], path.with_suffix(".png"))  # every run's rows in the file
    print(f"wrote {path}")
    return 0


def save(args, rows, skipped) -> Path:
    meta = common.meta(
        model=args.model,
        weights="random bf16",
        affix_len=args.affix_len,
        question_len=args.question_len,
        output_len=args.output_len,
        block_length=args.block_len,
        steps_per_block=args.steps_per_block,
        requests=args.requests,
        concurrency=args.concurrency,
        kv_budget_gib=args.kv_budget_gib,
        skipped=skipped,
        dataset="generated-shared-prefix: 1 group, --requests prompts, shared affix + own question",
        baseline="sharing off (dual cache, own copy) and per-call generate at batch 16, same run",
    )
    name = "serve_h200.json" if not common.SMOKE_ON_CPU else "serve_cpu_smoke.json"
    return common.write_results(name, meta, rows, args.out, args.run)


if __name__ == "__main__":
    raise SystemExit(main())
