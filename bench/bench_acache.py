"""What do the shared-affix caches (ACache, BiCache: dllm_jax/caches/) save end to end? LLaDA-8B shapes, random
bf16 weights.

Every request is [shared affix of --affix-len tokens][its own --request-len tokens][generation]; gen 256, block
32, a fixed schedule of 64 steps (8 blocks x 8 steps: random weights never pass a confidence threshold), so every
mode runs the same 64 decoding forwards and differs in what a block start forwards:
  dual          Fast-dLLM dual cache: the whole sequence at every block start (full recompute; the baseline)
  anchors_R     ACache with anchor_ratio R and the affix's K/V built ONCE (`build_shared_affix`, timed apart and
                not per call): block starts forward [anchors | request | generation]; +1 NFE for the probe.
                anchors_0.0 decodes as the naive reuse (identity), anchors_1.0 as dual.
  shallow_D     BiCache at depth D (shallow_table: the paper's depth for this affix share; LLaDA-8B at the
                defaults: r = 76 -> 16 of 32 layers), the prefix's K/V and hidden states built once.
Per row: median seconds of `generate` (after a warm-up call), NFE, tokens/s, the speedup over dual at the same
batch in the same run, and the ms of one block-start forward (the window's forward, 4 fused in a jitted loop).
Writes bench/results/acache_h200.json (rows merged by --run label; acache_cpu_smoke.json on the CPU) and a plot.
Never run on a GPU yet: the first calls to make are

    PYTHONPATH=. python bench/bench_acache.py --batches 1 --budget-s 420 --run NAME
    PYTHONPATH=. python bench/bench_acache.py --batches 8 --budget-s 420 --run NAME
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402

# package imports (re-point here when the package moves)
from dllm_jax.decoding.caches import acache, affix, bicache, strategy_for  # noqa: E402
from dllm_jax.decoding.config import GenerationConfig  # noqa: E402
from dllm_jax.decoding.generate import generate  # noqa: E402
from dllm_jax.io.loading import Model  # noqa: E402

GEN, BLOCK, STEPS = 256, 32, 64
FUSED = 4


def requests(cfg, affix: list[int], batch: int, request_len: int, rng) -> list[list[int]]:
    hi = min(100_000, cfg.vocab_size - 3)
    return [affix + rng.integers(0, hi, request_len).tolist() for _ in range(batch)]


def gen_config(kind: str, value) -> GenerationConfig:
    """kind: "dual", "anchors" (value: the ratio) or "shallow" (value: the depth; None: the published table)."""
    extra = {
        "dual": {},
        "anchors": dict(affix="anchors", anchor_ratio=value),
        "shallow": dict(affix="shallow", shallow_depth=value),
    }[kind]
    return GenerationConfig.from_options(
        gen_length=GEN, block_length=BLOCK, steps=STEPS, cache="dual", stop_at_eos=False, **extra
    )


def block_start_ms(model: Model, gc: GenerationConfig, prompts, shared) -> tuple[float, int | None]:
    """(ms of one block-start forward of this mode from the state generate starts from, a middle block; the
    BiCache depth used)."""
    cfg = model.config
    x, inp = common.decode_inputs(model, gc, prompts)
    depth = None
    if gc.cache.affix is None:
        state = strategy_for(gc.cache.mode).init(model.params, cfg, inp, x)
    else:  # the library's own set-up (caches/affix.py), as generate runs it
        spans, entry, prefix_entry = affix.resolve_spans(gc, cfg, prompts, None, shared)
        a = affix.affix_inputs(
            gc, cfg, prompts, spans, entry, prefix_entry, np.asarray(inp.key_mask), inp.prompt_len, x.shape[1]
        )
        depth = a.depth
        state, _ = jax.jit(affix.initial_state, static_argnames=("config",))(model.params, cfg, inp, x, inp.frozen, a)
    strat = strategy_for(gc.cache.mode, gc.cache.affix_name, depth)
    bs = inp.prompt_len + 2 * gc.schedule.block_length
    call = common.fused_loop(lambda p, st: strat.block_start(p, cfg, inp, st, x, bs), model.params, state)
    return 1e3 * common.time_call(lambda: call(FUSED), reps=3)[0] / FUSED, depth


def bench_row(model: Model, kind: str, value, batch: int, prompts, shared, reps: int) -> dict:
    gc = gen_config(kind, value)
    kw = dict(shared_affix=shared[kind]) if kind != "dual" else {}
    t0 = time.perf_counter()
    out = generate(model, prompts, gc, **kw)
    first = time.perf_counter() - t0
    secs = [generate(model, prompts, gc, **kw).seconds for _ in range(common.repeats(reps))]
    sec = float(np.median(secs))
    ms_start, depth = block_start_ms(model, gc, prompts, kw.get("shared_affix"))
    a_len = len(shared["anchors"])
    own = len(prompts[0]) - a_len + GEN
    window = {
        "dual": out.prompt_len + GEN,
        "anchors": (acache.anchor_count(a_len, value or 0.0) + own),
        "shallow": own,
    }[kind]  # shallow: layers < depth only; the others forward the whole buffer
    mode = "dual" if kind == "dual" else f"{kind}_{'table' if value is None else f'{value:g}'}"
    return {
        "mode": mode,
        "kind": kind,
        "anchor_ratio": value if kind == "anchors" else None,
        "shallow_depth": depth,
        "batch": batch,
        "seconds": sec,
        "nfe": out.nfe,
        "tokens_per_s": batch * GEN / sec,
        "ms_per_nfe": 1e3 * sec / out.nfe,
        "ms_block_start": ms_start,
        "block_start_window_tokens": window,
        "compile_s": max(first - sec, 0.0),
        "attention": common.kernels(model, gc).attention,
    }


def plot(rows: list[dict], path: Path) -> None:
    batches = sorted({r["batch"] for r in rows})
    series = [
        (m, [next((r["tokens_per_s"] for r in rows if r["mode"] == m and r["batch"] == b), 0) for b in batches])
        for m in dict.fromkeys(r["mode"] for r in rows)
    ]
    common.grouped_bars(
        path,
        [f"batch {b}" for b in batches],
        series,
        "tokens / s",
        "shared-affix caches vs dual cache (shared affix built once; this run's rows)",
        log=True,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-8b", choices=list(common.MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.0, 0.2])
    ap.add_argument(
        "--shallow-depths",
        nargs="*",
        default=["table"],
        help="BiCache rows: depths, or 'table' for the paper's table (LLaDA-8B / Dream-7B only)",
    )
    ap.add_argument("--affix-len", type=int, default=1024)
    ap.add_argument("--request-len", type=int, default=64)
    common.output_args(ap, budget_s=420.0)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    model = common.random_model(args.model)
    cfg = model.config
    rng = np.random.default_rng(0)
    affix_ids = rng.integers(0, min(100_000, cfg.vocab_size - 3), args.affix_len).tolist()
    builds = {"anchors": acache.build_shared_affix, "shallow": bicache.build_shared_prefix}
    shared, build_ms = {}, {}
    for kind, build in builds.items():
        build(model.params, cfg, affix_ids)  # compile
        t0 = time.perf_counter()
        shared[kind] = build(model.params, cfg, affix_ids)
        jax.block_until_ready(shared[kind].k if kind == "anchors" else shared[kind].hidden)
        build_ms[kind] = 1e3 * (time.perf_counter() - t0)
    print(
        f"[{time.perf_counter() - t_start:5.0f}s] {args.model} ready; shared affix of {args.affix_len} tokens "
        f"built in {build_ms['anchors']:.1f} ms (K/V) / {build_ms['shallow']:.1f} ms (+ hidden states), once",
        flush=True,
    )
    rows, skipped = [], []
    kinds = (
        [("dual", None)]
        + [("anchors", r) for r in args.ratios]
        + [("shallow", None if d == "table" else int(d)) for d in args.shallow_depths]
    )
    plan = [(b, kind, value) for b in args.batches for kind, value in kinds]
    for batch, kind, value in plan:
        mode = f"{kind} {value}"
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(dict(mode=mode, batch=batch))
            continue
        prompts = requests(cfg, affix_ids, batch, args.request_len, np.random.default_rng(batch))
        try:
            row = bench_row(model, kind, value, batch, prompts, shared, reps=3)
        except Exception as e:  # noqa: BLE001  one failing row must not lose the run
            print(f"FAILED {mode} b{batch}: {type(e).__name__}: {e}", flush=True)
            skipped.append(dict(mode=mode, batch=batch, error=str(e)[:300]))
            continue
        base = next((r for r in rows if r["mode"] == "dual" and r["batch"] == batch), None)
        if base is not None:
            row["speedup_vs_dual"] = base["seconds"] / row["seconds"]
            row["block_start_speedup_vs_dual"] = base["ms_block_start"] / row["ms_block_start"]
        rows.append(row)
        mode = row["mode"]
        print(
            f"[{time.perf_counter() - t_start:5.0f}s] {mode:14s} b{batch:<3d} {row['tokens_per_s']:8.1f} tok/s "
            f"NFE {row['nfe']}  start {row['ms_block_start']:7.2f} ms ({row['block_start_window_tokens']} tokens)"
            f"  x{row.get('speedup_vs_dual', 1.0):.3f} vs dual  compile {row['compile_s']:.0f}s",
            flush=True,
        )
        save(args, rows, skipped, build_ms)
    path = save(args, rows, skipped, build_ms)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def save(args, rows, skipped, build_ms) -> Path:
    meta = common.meta(
        model=args.model,
        weights="random bf16",
        affix_length=args.affix_len,
        request_length=args.request_len,
        gen_length=GEN,
        block_length=BLOCK,
        steps=STEPS,
        placement="prefix",
        shared_build_ms=build_ms,
        skipped=skipped,
        schedule="fixed 64 steps (8 per block), stop_at_eos off, dual cache inside blocks",
        baseline="dual (full recompute at block starts) in the same run",
    )
    name = "acache_h200.json" if not common.SMOKE_ON_CPU else "acache_cpu_smoke.json"
    return common.write_results(name, meta, rows, args.out, args.run)


if __name__ == "__main__":
    raise SystemExit(main())
