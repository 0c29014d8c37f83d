"""How fast and how lean does the serving engine run many requests that share an affix? LLaDA-8B shapes, random
bf16 weights (speed does not depend on them). Every engine is built as `dllm-jax serve` builds it: serve's own
parser and `cli.engine_config` on the serve flags the JSON records (`serve_flags`), warmed with `Engine.warmup`
(every program its settings allow) and reused by every row of those settings; nothing bench-only.

Workloads in the terms of SGLang's `bench_serving --dataset-name generated-shared-prefix`:
  closed16      one shared affix of --affix-len tokens and --question-len tokens of each request's own, placed as a
                prefix [affix | own], an infix [own[:half] | affix | own[half:]] or a suffix [own | affix];
                --output-len tokens, block 32, 8 steps a block; a closed loop of 16 in flight (poisson_R: open
                loop, Poisson arrivals at R requests/s). Rows (`sharing`): off (the dual cache, every request its own
                copy), on (one stored copy; ACache at `ratio` 0, 0.2 and 1; BiCache with --bicache), generate
                (per-call `dllm_jax.generate` at batch 16, the reference). Writes serve_h200.json.
  mixed         (issue 39) six shared affixes of 128, 256, 512, 1024, 1024 and 2048 tokens placed as prefix, suffix,
                prefix, infix, suffix, prefix (three prefixes, one infix, two suffixes); --requests (200) requests,
                each an affix drawn uniformly and a question of 16-256 tokens, max_tokens drawn from 64/128/256,
                temperature 0 or 0.7 and 4 or 8 steps a block drawn per request (random weights never pass a
                confidence threshold: a threshold row would run every step of a block), block 32; arrivals
                (--arrivals) Poisson at 2, 4 and 8 requests/s and a closed loop of 16. Rows (--rows): off, acache_0.2,
                acache_0 (serve's default engine) and bicache (an engine serving the one BiCache depth the row uses:
                the shallowest of the LLaDA-8B table's depths over the workload's requests, to which the engine
                rounds every request's table depth, as `serve --shallow-depths D` would). Writes
                serve_mixed_h200.json.
Columns: tokens_per_s (generated tokens / wall time of the workload), p50_s / p99_s (request latency from its
arrival to its last block), ttfb_p50_s / ttfb_p99_s (to its first block), peak_kv_bytes (pages held at the peak),
probe_ms_per_request (ACache's probe: the wall time of its own calls per probed request), max_requests_16gib (how
many such requests a 16 GiB pool holds: the shared copies once plus each request's private pages), programs,
compiles_after_warmup / compile_s_after_warmup (XLA compilations during the timed run), the same-run ratios to
sharing off; mixed rows also load_s (an HF LLaDA-8B directory to the device, --hf-dir: written by
bench_load.write_checkpoint when missing), warmup_s (a first start: the persistent compilation cache empty) and
warmup_s_cached (a second start with it), each measured in a fresh process (--starts) before this process touches
the device, else this process's own warm-up (`start`: which).
--http serves rows through `dllm-jax serve`'s app (uvicorn on 127.0.0.1; the official `openai` client streaming from
a process of its own, prompts sent as token ids, per-request settings as the request's fields) after the same row
through the Python API (`transport` python and http, `vs_python` their ratio); for mixed, at every --arrivals. The
HTTP rows run the server's audit as serve does (--audit-fraction; serve's default 0.02): rows of another fraction
or of --batch-invariant are kept apart under one --run label, and `vs_unaudited` is an audited HTTP row's tokens/s
against the --audit-fraction 0 row of the label (what auditing costs).
Each row is written when it finishes (a run cut short keeps its rows; rows merge by --run label), a plot at the end.

    PYTHONPATH=. python bench/bench_serve.py --run NAME                       # the closed16 rows at 1024 tokens
    PYTHONPATH=. python bench/bench_serve.py --workloads poisson_2 poisson_4 poisson_8 --ratios 0.2 --run NAME
    # mixed, on one H200: the two starts take about 2.5 min (serve's default engine is 6 programs, ~96 s to compile,
    # ~20 s to load); a command sent while the machine is still warm finds them in build/xla-cache-bench-serve (rows
    # of one --run label merge)
    PYTHONPATH=. python bench/bench_serve.py --workloads mixed --starts-only --run NAME
    PYTHONPATH=. python bench/bench_serve.py --workloads mixed --rows off acache_0.2 acache_0 --requests 100 \
        --arrivals closed poisson_8 poisson_4 poisson_2 --http --hf-dir build/llada8b-hf --budget-s 480 --run NAME
    PYTHONPATH=. python bench/bench_serve.py --workloads mixed --rows bicache --http --budget-s 480 --run NAME
"""

from __future__ import annotations

import argparse
import dataclasses
import gc as gc_module
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402  (imports no backend: the fresh-process starts run first)
from tools.serve_drive import IdTokenizer, drive, http_drive  # noqa: E402

# package imports (re-point here when the package moves)
from dllm_jax import cli  # noqa: E402
from dllm_jax.compilation import enable_compile_cache  # noqa: E402
from dllm_jax.decoding.caches.bicache import DEPTH_TABLES, depth_from_table  # noqa: E402
from dllm_jax.decoding.config import GenerationConfig  # noqa: E402
from dllm_jax.decoding.generate import generate  # noqa: E402
from dllm_jax.engine import Engine  # noqa: E402
from dllm_jax.engine.kv_pool import kv_bytes_per_token  # noqa: E402

GIB = 1 << 30
MIXED_PLACEMENTS = ("prefix", "suffix", "prefix", "infix", "suffix", "prefix")  # of --mixed-affix-lens, in order
MIXED_ROWS = ("off", "acache_0.2", "acache_0", "bicache")
DEFAULT_CACHE = "build/xla-cache-bench-serve"  # the persistent compilation cache (git-ignored)
CACHE_MARK = "bench_serve_cache"  # a compilation cache directory this bench made (and may empty for a cold start)
TECHNIQUE = {"none": "dual", "anchors": "acache", "shallow": "bicache"}


class Item(NamedTuple):
    """One request: its prompt, the shared affix's span (None: nothing shared), its settings for the engine and
    the same settings as the HTTP request's fields."""

    prompt: list[int]
    span: tuple[int, int] | None
    config: GenerationConfig
    seed: int
    http: dict


def place(placement: str, affix: list[int], own: list[int]) -> tuple[list[int], tuple[int, int]]:
    head = {"prefix": [], "infix": own[: len(own) // 2], "suffix": own}[placement]
    tail = {"prefix": own, "infix": own[len(own) // 2 :], "suffix": []}[placement]
    return head + affix + tail, (len(head), len(head) + len(affix))


def prompts_for(placement: str, affix: list[int], own: list[list[int]]) -> list[tuple[list[int], tuple[int, int]]]:
    return [place(placement, affix, q) for q in own]


def item(
    prompt,
    span,
    *,
    technique: str,
    ratio: float | None = None,
    depth: int | None = None,
    max_tokens: int,
    block: int,
    steps_per_block: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> Item:
    """technique "none" (sharing off), "anchors" (ACache at ratio) or "shallow" (BiCache: depth, or None for the
    table's depth, rounded by the engine to a served one)."""
    steps = max_tokens // block * steps_per_block
    extra = {}
    if technique == "anchors":
        extra["anchor_ratio"] = ratio
    if technique == "shallow" and depth is not None:
        extra["shallow_depth"] = depth
    config = GenerationConfig.from_options(
        gen_length=max_tokens,
        block_length=block,
        steps=steps,
        cache="dual",
        affix=technique,
        temperature=temperature,
        stop_at_eos=False,
        **extra,
    )
    shared = technique != "none"
    body = dict(block_length=block, steps=steps, affix_technique=technique, **extra)
    body["affix"] = {"start": span[0], "end": span[1]} if shared else "none"
    http = dict(max_tokens=max_tokens, temperature=temperature, seed=seed, extra_body=body)
    return Item(list(prompt), span if shared else None, config, seed, http)


# ---- engines as `dllm-jax serve` builds them -------------------------------------------------------------------
def row_start(start: dict | None, flags: str, info: dict, load_s: float | None) -> dict:
    """How a mixed row's engine (`flags`, warmed here: `info`) started: the fresh-process starts of its --run label
    where they ran these flags (not another --weights', say), else this process's warm-up (partly from the persistent
    cache where earlier engines filled it)."""
    if start is not None and start.get("serve_flags") == flags:
        begin = {k: start[k] for k in ("start", "load_s", "warmup_s", "warmup_s_cached", "warmup")}
        begin["load_s"] = begin["load_s"] if begin["load_s"] is not None else load_s  # starts on random weights
    else:
        begin = dict(start="this process", load_s=load_s, warmup_s=info["seconds"], warmup_s_cached=None, warmup=info)
    return {**begin, "warmup_this_process": info}


def serve_flags(args, depths: tuple[int, ...] = (), audit_fraction: float | None = None) -> list[str]:
    """The `dllm-jax serve` flags of the engine a row runs on (serve's defaults for everything else); the audit's
    fraction is the row's (else the first --audit-fraction): it is the server's, the engine does not depend on it."""
    flags = ["--max-batch", str(args.max_batch), "--kv-budget-gib", f"{args.kv_budget_gib:g}"]
    if args.max_model_len is not None:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.block_len != 32:
        flags += ["--block-lengths", str(args.block_len)]
    if depths:
        flags += ["--shallow-depths", *map(str, depths)]
    if args.admission_wait is not None:
        flags += ["--admission-wait", f"{args.admission_wait:g}"]
    if args.window_chunk is not None:
        flags += ["--window-chunk", str(args.window_chunk)]
    for option in args.compiler_option or ():
        flags += ["--compiler-option", option]
    audit = audit_fraction if audit_fraction is not None else (args.audit_fraction or [None])[0]
    if audit is not None:
        flags += ["--audit-fraction", f"{audit:g}"]
    if args.batch_invariant:
        flags += ["--batch-invariant"]
    if args.weights != "bf16":
        flags += ["--weights", args.weights]
    return flags + ["--compile-cache", str(args.compile_cache)]


def serve_engine(model, flags: list[str]) -> Engine:
    """The engine `dllm-jax serve FLAGS` builds: its parser, its EngineConfig builder, its compilation cache."""
    sargs = cli.build_parser().parse_args(["serve", *flags])
    config = cli.engine_config(sargs, cli.shallow_depths(sargs, model.config))
    cache = cli.compile_cache_dir(sargs)
    if cache is not None:  # FLAGS with --no-compile-cache: serve runs without one
        enable_compile_cache(cache)
    return Engine(model, config)


def warm(engine: Engine, what: str) -> dict:
    t0 = time.perf_counter()
    info = engine.warmup(progress=True)
    seconds = time.perf_counter() - t0
    print(f"{what}: warmed up in {seconds:.1f} s: {info}", flush=True)
    return dict(info, seconds=seconds)


def ensure_checkpoint(hf_dir: Path, config) -> None:
    """An HF LLaDA directory with `config`'s shapes at hf_dir: bench_load's, reused when its marker matches."""
    import bench_load

    if config.family != "llada":
        raise SystemExit(f"--hf-dir: bench_load writes LLaDA checkpoints only, not {config.family}")
    print(f"a random {config.n_layers}-layer checkpoint at {hf_dir} (written if missing)", flush=True)
    bench_load.ensure_checkpoint(hf_dir, config, 5.0, clear=False)


def build_model(args):
    """(the model, load_s): --hf-dir through `dllm_jax.load` as serve loads it (timed until every param is on the
    device), else random weights on the device (load_s None)."""
    import jax

    import dllm_jax

    weights = getattr(args, "weights", "bf16")
    if args.hf_dir is None:
        model = common.random_model(args.model, weights)
        load_s = None
    else:
        d = Path(args.hf_dir)
        ensure_checkpoint(d, common.MODELS[args.model])
        jax.devices()  # the backend's start is not loading
        t0 = time.perf_counter()
        model = dllm_jax.load(d, dtype="bfloat16", weights=weights)
        jax.block_until_ready(model.params)
        load_s = time.perf_counter() - t0
    if model.tokenizer is None:  # what the server needs of one: a token is its id as text
        model = dataclasses.replace(model, tokenizer=IdTokenizer())
    return model, load_s


def start_child(spec: dict) -> int:
    """A fresh process's start (--start-child): load, build the engine, warm it; one JSON line on stdout."""
    weights = cli.build_parser().parse_args(["serve", *spec["flags"]]).weights or "bf16"  # as the flags say
    args = argparse.Namespace(model=spec["model"], hf_dir=spec["hf_dir"], weights=weights)
    t0 = time.perf_counter()
    model, load_s = build_model(args)
    engine = serve_engine(model, spec["flags"])
    info = engine.warmup(progress=True)
    out = dict(load_s=load_s, warmup_s=info["seconds"], warmup=info, start_s=time.perf_counter() - t0)
    print(json.dumps(out), flush=True)
    return 0


def fresh_start(args, flags: list[str]) -> dict:
    """Start the engine in a child process (this one has not touched the device) and return what it measured."""
    spec = dict(model=args.model, hf_dir=args.hf_dir, flags=flags)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--start-child", json.dumps(spec)]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.start_timeout_s)
    if r.returncode:
        raise RuntimeError(f"the fresh-process start exited with {r.returncode}: {r.stdout[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def empty_cache_dir(path: Path) -> None:
    """The cold start's cache: this bench's directory, emptied (a directory it did not make is refused)."""
    if path.exists() and any(path.iterdir()):
        if path.resolve() != Path(DEFAULT_CACHE).resolve() and not (path / CACHE_MARK).is_file():
            raise SystemExit(f"--starts empties --compile-cache, and {path} is not a directory this bench made")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CACHE_MARK).write_text("made by bench/bench_serve.py; emptied by --starts\n")


def measured(
    engine: Engine, items: list[Item], arrival: str, args, transport: str, audit_fraction: float | None = None
) -> dict:
    """One row's timings plus the engine's counters over it (peak KV, probes, compiles after warm-up)."""
    if "peak_pages" in engine.counters:  # the peak of this row, not of the engine's earlier rows
        engine.counters["peak_pages"] = engine.block_manager.num_used_pages
    s0 = engine.stats()
    if transport == "http":
        sargs = cli.build_parser().parse_args(["serve", *serve_flags(args, audit_fraction=audit_fraction)])
        t = http_drive(engine, items, arrival, args.concurrency, sargs.admission_wait, sargs.audit_fraction)
    else:
        t = dict(drive(engine, items, arrival, args.concurrency), audit_fraction=None)  # the engine alone
    t["batch_invariant"] = engine.config.batch_invariant
    t["weights"] = engine.model.config.weights
    s1 = engine.stats()
    delta = lambda key: s1[key] - s0[key]  # noqa: E731  the engine's counters over the row
    probes = delta("probes")
    return dict(
        transport=transport,
        **t,
        peak_kv_bytes=s1["peak_kv_bytes"],
        # the probe calls' own time (Engine.stats' probe_seconds: dispatch to ranking, the device idle before)
        probe_ms_per_request=1e3 * delta("probe_seconds") / probes if probes else None,
        probe_timer="probe_calls",  # the probe programs' own time (older rows' "probe_seconds": a share of the calls)
        programs=s1["programs"],
        compiles_after_warmup=delta("compiles_after_warmup"),
        compile_s_after_warmup=delta("compile_seconds_after_warmup"),
        requests=len(items),
        block_host_s=delta("block_host_seconds"),
        block_device_s=delta("block_device_seconds"),
        block_calls=delta("blocks"),
    )


def capacity(engine: Engine, items: list[Item], affix_lens: list[int], budget: int = 16 * GIB) -> int | None:
    """Requests like these a `budget` pool holds at once: the shared copies once, each request's private pages (the
    mean over the items)."""
    page = engine.block_manager.page_size
    page_bytes = page * kv_bytes_per_token(engine.model.config)
    private = [
        -(-engine.plan_request(it.prompt, it.config, it.span, remember=False).private_tokens() // page) * page_bytes
        for it in items
    ]
    shared = sum(-(-n // page) * page_bytes for n in affix_lens)
    return int((budget - shared) // np.mean(private))


# ---- closed16 / poisson_R: one affix ---------------------------------------------------------------------------
def gen_item(args, prompt, span, ratio: float | None, technique: str, depth: int | None, seed: int) -> Item:
    name = "shallow" if technique == "bicache" else "none" if ratio is None else "anchors"
    return item(
        prompt,
        span,
        technique=name,
        ratio=ratio,
        depth=depth if args.bicache_depth is not None else None,
        max_tokens=args.output_len,
        block=args.block_len,
        steps_per_block=args.steps_per_block,
        seed=seed,
    )


def table_depth(config, items_lens: list[tuple[int, int, int]]) -> int:
    """The shallowest BiCache table depth over (affix, prompt, gen) lengths: the one depth an engine serves them at
    (the engine rounds each request's table depth down to a served one)."""
    table = DEPTH_TABLES.get((config.family, config.n_layers))
    if table is None:
        raise SystemExit(f"no BiCache depth table for a {config.n_layers}-layer {config.family}: set --bicache-depth")
    return min(depth_from_table(table, a, p, g) for a, p, g in items_lens)


def engine_row(engine, args, workload, placement, ratio, technique, depth, prompts, transport) -> dict:
    items = [gen_item(args, p, s, ratio, technique, depth, i) for i, (p, s) in enumerate(prompts)]
    shared = items[0].span is not None
    m = measured(engine, items, workload, args, transport)
    return dict(
        workload=workload,
        affix_len=args.affix_len,
        placement=placement,
        sharing="on" if shared else "off",
        technique=technique if shared else "dual",
        ratio=ratio,
        depth=depth if technique == "bicache" else None,
        **m,
        max_requests_16gib=capacity(engine, items[:1], [args.affix_len] if shared else []),
    )


def generate_row(model, args, workload: str, placement: str, prompts) -> dict:
    """The per-call reference: generate at batch `concurrency` over the same prompts (dual cache, no sharing)."""
    gc = gen_item(args, prompts[0][0], None, None, "acache", None, 0).config
    prompts = [p for p, _ in prompts]
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
        weights=model.config.weights,
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


def run_closed(args) -> int:
    t_start = time.perf_counter()
    args.requests = args.requests or 64
    model, _ = build_model(args)
    cfg = model.config
    rng = np.random.default_rng(0)
    hi = min(100_000, cfg.vocab_size - 3)
    affix = rng.integers(0, hi, args.affix_len).tolist()
    own = [rng.integers(0, hi, args.question_len).tolist() for _ in range(args.requests)]
    rows, skipped = [], []
    earlier = previous_rows(closed_path(args), args.run)  # this label's rows from earlier commands (`save_closed`)
    meta = dict(serve_flags={}, model_config=dataclasses.asdict(cfg), earlier=earlier)
    depth = None
    if args.bicache:
        prompt_len = args.affix_len + args.question_len
        depth = args.bicache_depth
        depth = depth if depth is not None else table_depth(cfg, [(args.affix_len, prompt_len, args.output_len)])
    # the plan, by engine: sharing off once per workload (it has no placement) and each ratio per placement on
    # serve's default engine; BiCache per placement on an engine serving its depth
    plans = {(): [], (depth,): []}
    for workload in args.workloads:
        if not args.no_off:
            plans[()].append((workload, args.placements[0], None, "dual"))
        plans[()] += [(workload, pl, r, "acache") for pl in args.placements for r in args.ratios]
        plans[(depth,)] += [(workload, pl, None, "bicache") for pl in args.placements if args.bicache]
    transports = ("python", "http") if args.http else ("python",)  # --http: each row, then the same through HTTP
    for depths, plan in plans.items():
        if not plan:
            continue
        if time.perf_counter() - t_start > args.budget_s:
            skipped += [dict(workload=w, placement=p, ratio=r, technique=t) for w, p, r, t in plan]
            continue
        flags = serve_flags(args, depths)
        meta["serve_flags"][str(depths)] = "dllm-jax serve " + " ".join(flags)
        engine = serve_engine(model, flags)
        info = warm(engine, "dllm-jax serve " + " ".join(flags))
        for (workload, placement, ratio, technique), transport in ((p, t) for p in plan for t in transports):
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(dict(workload=workload, placement=placement, ratio=ratio, technique=technique))
                continue
            try:
                row = engine_row(
                    engine,
                    args,
                    workload,
                    placement,
                    ratio,
                    technique,
                    depth,
                    prompts_for(placement, affix, own),
                    transport,
                )
            except Exception as e:  # noqa: BLE001  one failing row must not lose the run
                print(f"FAILED {workload} {placement} {technique} {ratio}: {type(e).__name__}: {e}", flush=True)
                skipped.append(
                    dict(workload=workload, placement=placement, ratio=ratio, technique=technique, error=str(e)[:300])
                )
                continue
            row.update(warmup_s=info["seconds"], warmup=info)
            if transport == "http" and rows and rows[-1]["transport"] == "python":
                row["vs_python"] = row["tokens_per_s"] / rows[-1]["tokens_per_s"]
            base = next(
                (
                    r
                    for r in rows
                    if r["sharing"] == "off" and r["workload"] == workload and r["transport"] == transport
                ),
                None,
            )
            if base is not None and row["sharing"] == "on":
                row["speedup_vs_off"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["peak_kv_vs_off"] = row["peak_kv_bytes"] / base["peak_kv_bytes"]
                row["capacity_vs_off"] = row["max_requests_16gib"] / base["max_requests_16gib"]
            rows.append(row)
            print(
                f"[{time.perf_counter() - t_start:5.0f}s] {workload} {placement} {row['technique']} r={ratio} "
                f"{row['transport']}: {row['tokens_per_s']:8.1f} tok/s p50 {row['p50_s']:.2f}s p99 "
                f"{row['p99_s']:.2f}s peak KV {row['peak_kv_bytes'] / GIB:.2f} GiB "
                f"x{row.get('speedup_vs_off', 1):.2f} probe {row['probe_ms_per_request'] or 0:.1f} ms "
                f"compiles {row['compiles_after_warmup']}",
                flush=True,
            )
            save_closed(args, rows, skipped, meta)
        del engine  # its pool goes before the next engine's is allocated
        gc_module.collect()
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
    path = save_closed(args, rows, skipped, meta)
    plot(json.loads(path.read_text())["rows"], path.with_suffix(".png"))  # every run's rows in the file
    print(f"wrote {path}")
    return 0


def closed_key(r: dict) -> tuple:
    """What a closed16 row measured: another row of one --run label with this key is the same row re-measured."""
    fields = ("workload", "sharing", "technique", "ratio", "placement", "depth", "weights", "transport")
    return tuple(r.get(n) for n in fields) + (r.get("audit_fraction"), r.get("batch_invariant"))


def closed_path(args) -> Path:
    return Path(args.out) / ("serve_h200.json" if not common.SMOKE_ON_CPU else "serve_cpu_smoke.json")


def save_closed(args, rows, skipped, meta) -> Path:
    """This command's rows, after the rows its --run label got from earlier commands that it did not re-measure
    (bf16 and fp8_all rows from two commands under one label), with every command in meta."""
    earlier, meta = meta["earlier"], {k: v for k, v in meta.items() if k != "earlier"}
    measured = {closed_key(r) for r in rows}
    rows = [r for r in earlier if closed_key(r) not in measured] + rows
    path = closed_path(args)
    before = json.loads(path.read_text())["meta"].get("runs", {}).get(args.run, {}) if earlier else {}
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
        **meta,
    )
    commands = before.get("commands") or ([before["command"]] if "command" in before else [])
    if commands:  # (this command's rows are saved after each: it is last once it saved one)
        meta["commands"] = commands + ([] if commands[-1] == meta["command"] else [meta["command"]])
    return common.write_results(path.name, meta, rows, path.parent, args.run)


# ---- mixed (issue 39) ------------------------------------------------------------------------------------------
def mixed_requests(args, config) -> tuple[list[dict], list[int]]:
    """The workload's requests (the same for every row): prompt, affix span, which affix, and the drawn settings."""
    rng = np.random.default_rng(0)
    hi = min(100_000, config.vocab_size - 3)
    lens = args.mixed_affix_lens
    affixes = [rng.integers(0, hi, n).tolist() for n in lens]
    qmin, qmax = args.mixed_question_lens
    out = []
    for i in range(args.requests):
        k = int(rng.integers(len(lens)))
        own = rng.integers(0, hi, int(rng.integers(qmin, qmax + 1))).tolist()
        prompt, span = place(MIXED_PLACEMENTS[k], affixes[k], own)
        out.append(
            dict(
                prompt=prompt,
                span=span,
                affix=k,
                max_tokens=int(rng.choice(args.mixed_max_tokens)),
                temperature=float(rng.choice([0.0, 0.7])),
                steps_per_block=int(rng.choice([4, 8])),
                seed=i,
            )
        )
    return out, lens


def mixed_items(reqs: list[dict], row: str, depth: int | None, explicit_depth: bool, block: int) -> list[Item]:
    technique, ratio = {"off": ("none", None), "bicache": ("shallow", None)}.get(row, ("anchors", None))
    if technique == "anchors":
        ratio = float(row.split("_", 1)[1])
    return [
        item(
            r["prompt"],
            r["span"],
            technique=technique,
            ratio=ratio,
            depth=depth if explicit_depth else None,
            max_tokens=r["max_tokens"],
            block=block,
            steps_per_block=r["steps_per_block"],
            temperature=r["temperature"],
            seed=r["seed"],
        )
        for r in reqs
    ]


def mixed_key(r: dict) -> tuple:
    return (
        r["arrival"],
        r["row"],
        r["transport"],
        r.get("audit_fraction"),
        r.get("batch_invariant", False),
        r.get("weights", "bf16"),
    )


def run_mixed(args) -> int:
    t_start = time.perf_counter()
    args.requests = args.requests or 200
    config = common.MODELS[args.model]
    if len(args.mixed_affix_lens) != len(MIXED_PLACEMENTS):
        raise SystemExit(f"--mixed-affix-lens takes {len(MIXED_PLACEMENTS)} lengths ({', '.join(MIXED_PLACEMENTS)})")
    reqs, affix_lens = mixed_requests(args, config)
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in reqs)
    if longest > (args.max_model_len or min(config.max_seq_len, 4096)):
        raise SystemExit(f"a request of {longest} tokens exceeds the engine's maximum length: lower the lengths")
    depth = None
    if "bicache" in args.rows:
        depth = args.bicache_depth
        if depth is None:
            depth = table_depth(
                config, [(r["span"][1] - r["span"][0], len(r["prompt"]), r["max_tokens"]) for r in reqs]
            )
    args.compile_cache = Path(args.compile_cache)
    default_flags = serve_flags(args)
    meta = dict(
        model_config=dataclasses.asdict(config),
        serve_flags={"serve": "dllm-jax serve " + " ".join(default_flags)},
        bicache_depth=depth,
        requests=args.requests,
        affix_lens=affix_lens,
        placements=list(MIXED_PLACEMENTS),
        affix_counts=np.bincount([r["affix"] for r in reqs], minlength=len(affix_lens)).tolist(),
        question_lens=args.mixed_question_lens,
        max_tokens=args.mixed_max_tokens,
        mean_prompt_tokens=float(np.mean([len(r["prompt"]) for r in reqs])),
        generated_tokens=int(sum(r["max_tokens"] for r in reqs)),
        temperatures=[0.0, 0.7],
        steps_per_block=[4, 8],
        block_length=args.block_len,
        concurrency=args.concurrency,
        kv_budget_gib=args.kv_budget_gib,
        hf_dir=args.hf_dir,
        skipped=[],
    )
    # 1. the starts, each in a fresh process before this one touches the device (nothing above does: on a GPU its
    # memory is the children's): a first start with an empty persistent cache (it fills it), then a second with it
    start = None
    if args.starts or args.starts_only:
        empty_cache_dir(args.compile_cache)
        cold = fresh_start(args, default_flags)
        print(f"first start: load {cold['load_s']} s, warm-up {cold['warmup_s']:.1f} s {cold['warmup']}", flush=True)
        cached = fresh_start(args, default_flags)
        print(f"second start: warm-up {cached['warmup_s']:.1f} s {cached['warmup']}", flush=True)
        start = dict(
            arrival="start",
            row="serve",
            transport="python",
            start="fresh processes",
            load_s=cold["load_s"],
            warmup_s=cold["warmup_s"],
            warmup_s_cached=cached["warmup_s"],
            warmup=cold["warmup"],
            warmup_cached=cached["warmup"],
            programs=cold["warmup"]["programs"],
            serve_flags=meta["serve_flags"]["serve"],
        )
    path = mixed_path(args)
    rows = previous_rows(path, args.run)  # rows of this --run label from earlier commands stay unless re-measured

    def save(row: dict | None = None) -> None:
        if row is not None:
            rows[:] = [r for r in rows if mixed_key(r) != mixed_key(row)] + [row]
        common.write_results(
            path.name, common.meta(model=args.model, workload="mixed", **meta), rows, path.parent, args.run
        )

    if start is not None:
        save(start)
    if args.starts_only:
        print(f"wrote {path}")
        return 0
    start = next((r for r in rows if r["arrival"] == "start" and r["row"] == "serve"), None)
    measured_here: set[tuple] = set()

    # 2. the rows, engine by engine (serve's defaults; then the BiCache depth's), each engine warmed once
    model, load_s = build_model(args)
    groups = [((), [r for r in args.rows if r != "bicache"]), ((depth,), [r for r in args.rows if r == "bicache"])]
    for depths, names in groups:
        if not names:
            continue
        if time.perf_counter() - t_start > args.budget_s:
            meta["skipped"] += [dict(row=n, arrival=a) for n in names for a in args.arrivals]
            continue
        flags = serve_flags(args, depths)
        meta["serve_flags"]["bicache" if depths else "serve"] = "dllm-jax serve " + " ".join(flags)
        engine = serve_engine(model, flags)
        info = warm(engine, "dllm-jax serve " + " ".join(flags))
        begin = row_start(start, "dllm-jax serve " + " ".join(flags), info, load_s)
        # HTTP rows once per --audit-fraction, in the order given, on this warm engine (the audit is the server's)
        fractions = args.audit_fraction or [None]
        plan = [(a, n, "python", None) for a in args.arrivals for n in names]
        plan += [(a, n, "http", f) for a in args.arrivals for n in names for f in fractions if args.http]
        for arrival, name, transport, fraction in plan:
            if time.perf_counter() - t_start > args.budget_s:
                meta["skipped"].append(dict(row=name, arrival=arrival, transport=transport))
                continue
            items = mixed_items(reqs, name, depth, args.bicache_depth is not None, args.block_len)
            try:
                m = measured(engine, items, arrival, args, transport, fraction)
            except Exception as e:  # noqa: BLE001  one failing row must not lose the run
                print(f"FAILED {arrival} {name} {transport}: {type(e).__name__}: {e}", flush=True)
                meta["skipped"].append(dict(row=name, arrival=arrival, transport=transport, error=str(e)[:300]))
                continue
            shared = name != "off"
            row = dict(
                workload="mixed",
                arrival=arrival,
                row=name,
                affix_len="mixed",
                placement="mixed",
                sharing="on" if shared else "off",
                technique=TECHNIQUE[items[0].http["extra_body"]["affix_technique"]],
                ratio=float(name.split("_", 1)[1]) if name.startswith("acache_") else None,
                depth=depth if name == "bicache" else None,
                **m,
                max_requests_16gib=capacity(engine, items, affix_lens if shared else []),
                **begin,
                serve_flags="dllm-jax serve " + " ".join(serve_flags(args, depths, fraction)),
            )
            compare(row, rows, measured_here)
            measured_here.add(mixed_key(row))
            save(row)
            print(
                f"[{time.perf_counter() - t_start:5.0f}s] mixed {arrival} {name} {transport}: "
                f"{row['tokens_per_s']:8.1f} tok/s p50 {row['p50_s']:.2f}s p99 {row['p99_s']:.2f}s ttfb p99 "
                f"{row['ttfb_p99_s']:.2f}s peak KV {row['peak_kv_bytes'] / GIB:.2f} GiB "
                f"x{row.get('speedup_vs_off', 1):.2f} probe {row['probe_ms_per_request'] or 0:.1f} ms "
                f"compiles {row['compiles_after_warmup']}",
                flush=True,
            )
        del engine  # its pool goes before the next engine's is allocated
        gc_module.collect()
    save()
    plot_mixed([r for r in rows if r["arrival"] != "start"], path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def closed_name(args) -> str:
    return f"closed{args.concurrency}"


def compare(row: dict, rows: list[dict], here: set[tuple]) -> None:
    """The same-run ratios: to sharing off at the same arrival and transport, and http to python (`baseline`: this
    command's row, or one of an earlier command with this --run label)."""

    def same(r: dict, *fields: str) -> bool:
        return all(r.get(f) == row.get(f) for f in ("arrival", "batch_invariant", "weights", *fields))

    off = next((r for r in rows if r["row"] == "off" and same(r, "transport", "audit_fraction")), None)
    if off is not None and row["row"] != "off":
        row["speedup_vs_off"] = row["tokens_per_s"] / off["tokens_per_s"]
        row["p99_vs_off"] = row["p99_s"] / off["p99_s"]
        row["ttfb_p99_vs_off"] = row["ttfb_p99_s"] / off["ttfb_p99_s"]
        row["peak_kv_vs_off"] = row["peak_kv_bytes"] / off["peak_kv_bytes"] if off["peak_kv_bytes"] else None
        row["baseline"] = "this command" if mixed_key(off) in here else "an earlier command of this run"
    py = next((r for r in rows if r["transport"] == "python" and same(r, "row")), None)
    if row["transport"] == "http" and py is not None:
        row["vs_python"] = row["tokens_per_s"] / py["tokens_per_s"]
    unaudited = next((r for r in rows if r.get("audit_fraction") == 0 and same(r, "row", "transport")), None)
    if row.get("audit_fraction") and unaudited is not None:  # what the audit costs: tokens/s against none
        row["vs_unaudited"] = row["tokens_per_s"] / unaudited["tokens_per_s"]


def mixed_path(args) -> Path:
    return Path(args.out) / ("serve_mixed_h200.json" if not common.SMOKE_ON_CPU else "serve_mixed_cpu_smoke.json")


def previous_rows(path: Path, run: str) -> list[dict]:
    if not path.is_file():
        return []
    return [
        {k: v for k, v in r.items() if k != "run"} for r in json.loads(path.read_text())["rows"] if r.get("run") == run
    ]


def plot_mixed(rows: list[dict], path: Path) -> None:
    """Tokens/s and p99 latency of each row at each arrival (this run's rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def kind(r: dict) -> str:
        name = {"off": "off (own copy)", "bicache": f"BiCache depth {r.get('depth')}"}.get(r["row"])
        weights = "" if r.get("weights", "bf16") == "bf16" else f" {r['weights']}"
        return (name or f"ACache r{r['ratio']:g}") + weights + (" http" if r["transport"] == "http" else "")

    arrivals = list(dict.fromkeys(r["arrival"] for r in rows))
    kinds = list(dict.fromkeys(kind(r) for r in rows))
    value = {(r["arrival"], kind(r)): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.6 * len(arrivals) * max(1, len(kinds)) / 2), 4.5))
    x = np.arange(len(arrivals))
    width = 0.8 / max(1, len(kinds))
    for ax, field, label in ((axes[0], "tokens_per_s", "tokens / s"), (axes[1], "p99_s", "p99 latency (s)")):
        for i, k in enumerate(kinds):
            ys = [value[(a, k)][field] if (a, k) in value else 0 for a in arrivals]
            ax.bar(x + width * (i - (len(kinds) - 1) / 2), ys, width, label=k)
        ax.set_xticks(x, arrivals, fontsize=8)
        ax.set_ylabel(label)
        ax.set_xlabel("arrivals (requests/s) or closed loop")
    axes[0].legend(fontsize=7)
    fig.suptitle("serving engine, mixed workload: six shared affixes, per-request settings", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command line ------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-8b", choices=list(common.MODELS))
    ap.add_argument("--workloads", nargs="+", default=["closed16"], help="closed16 and/or poisson_RATE, or mixed")
    ap.add_argument("--requests", type=int, default=None, help="default: 64 (closed16 / poisson_R), 200 (mixed)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight in a closed loop")
    ap.add_argument("--block-len", type=int, default=32)
    ap.add_argument("--bicache-depth", type=int, default=None, help="BiCache's depth (default: the paper's table)")
    ap.add_argument("--http", action="store_true", help="rows through the HTTP server and the openai client too")
    g = ap.add_argument_group("the engine: `dllm-jax serve` flags (serve's defaults otherwise)")
    g.add_argument("--max-batch", type=int, default=16)
    g.add_argument("--kv-budget-gib", type=float, default=16.0, help="the KV pool (the same in every row)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--compile-cache", default=DEFAULT_CACHE, help="the persistent compilation cache")
    g.add_argument("--admission-wait", type=float, default=None, help="the HTTP rows' hold for arrivals")
    g.add_argument("--compiler-option", action="append", metavar="NAME=VALUE", help="XLA options of the programs")
    g.add_argument("--window-chunk", type=int, default=None, help="tokens a row a window forward runs at a time")
    g.add_argument(
        "--audit-fraction",
        type=float,
        nargs="+",
        default=None,
        help="the HTTP rows' audit (serve's default: 0.02); mixed: several run every HTTP row once per fraction, in "
        "this order, on one warm engine (e.g. 0 0.02: what auditing costs, same engine and process)",
    )
    g.add_argument("--batch-invariant", action="store_true", help="serve --batch-invariant")
    g.add_argument(
        "--weights", choices=["bf16", "fp8_ffn", "fp8_all"], default="bf16", help="serve --weights (rows keyed by it)"
    )
    g = ap.add_argument_group("closed16 / poisson_R")
    g.add_argument("--placements", nargs="+", default=["prefix", "infix", "suffix"])
    g.add_argument("--ratios", nargs="+", type=float, default=[0.0, 0.2, 1.0], help="ACache ratios (sharing on)")
    g.add_argument("--no-off", action="store_true", help="skip the sharing-off rows")
    g.add_argument("--no-generate", action="store_true", help="skip the per-call generate reference")
    g.add_argument("--bicache", action="store_true", help="BiCache rows too")
    g.add_argument("--affix-len", type=int, default=1024)
    g.add_argument("--question-len", type=int, default=64)
    g.add_argument("--output-len", type=int, default=256)
    g.add_argument("--steps-per-block", type=int, default=8)
    g = ap.add_argument_group("mixed")
    g.add_argument(
        "--arrivals",
        nargs="*",
        default=None,
        help="poisson_RATE and/or closed (a loop of --concurrency); default: poisson_2 poisson_4 poisson_8 closed",
    )
    g.add_argument("--rows", nargs="*", default=list(MIXED_ROWS), choices=MIXED_ROWS)
    g.add_argument("--starts", action="store_true", help="measure a first and a second start in fresh processes")
    g.add_argument("--starts-only", action="store_true", help="only the starts (no rows)")
    g.add_argument("--start-timeout-s", type=float, default=900.0)
    g.add_argument("--hf-dir", default=None, help="an HF LLaDA directory to load (load_s; written when missing)")
    g.add_argument("--mixed-affix-lens", nargs="+", type=int, default=[128, 256, 512, 1024, 1024, 2048])
    g.add_argument("--mixed-question-lens", nargs=2, type=int, default=[16, 256], metavar=("MIN", "MAX"))
    g.add_argument("--mixed-max-tokens", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--start-child", default=None, help=argparse.SUPPRESS)
    common.output_args(ap, budget_s=540.0)
    args = ap.parse_args(argv)
    if args.start_child is not None:
        return start_child(json.loads(args.start_child))
    if "mixed" in args.workloads:
        if len(args.workloads) > 1:
            ap.error("--workloads mixed runs alone")
        arrivals = args.arrivals if args.arrivals is not None else ["poisson_2", "poisson_4", "poisson_8", "closed"]
        args.arrivals = [closed_name(args) if a.startswith("closed") else a for a in arrivals]
        return run_mixed(args)
    return run_closed(args)


if __name__ == "__main__":
    raise SystemExit(main())
