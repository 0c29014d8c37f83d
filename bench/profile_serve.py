"""Where does a serving engine's block call spend its device time, against per-call `generate`'s block? (issue 39:
closed16 sharing off runs at 0.8x generate at batch 16.)

The closed16 workload's requests (one --affix-len affix as a prefix, --question-len tokens of each request's own,
--output-len tokens, block 32, 8 steps a block) on the engine `dllm-jax serve` builds (bench_serve.serve_engine),
16 in flight: once every row is decoding, `engine.step()` (one block call of the whole batch) runs under the
profiler (ACache rows: also the call before, where --new-requests (4) arrive beside the others decoding and are
probed: 1 profiles the 1-row probe program of lone arrivals; `wall_ms` is a call of all 16 rows decoding since run
s50, a probing call before); then `generate` at batch 16 over the same prompts, whose time is divided by its blocks.
Both are summed by kernel kind (bench/tools/trace.py). A probing row also gives the probe's device time a request
(issue 39's measure; the probe calls carry only probe tokens): what the probing step's kernels take over an ordinary
step's, busy and span, per new request (on a GPU the engine's loops run in XLA's command buffers, whose kernels the
profiler does not see one by one: busy counts only the kernels outside them, so span is the measure there).
Writes bench/results/serve_profile_<h200|platform>.json (rows merged by --run).

    PYTHONPATH=. python bench/profile_serve.py --rows off acache_0.2 --run NAME
    PYTHONPATH=. python bench/profile_serve.py --rows acache_0.2 --no-generate --calls 2 --new-requests 1 --run NAME
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402
from tools import common  # noqa: E402
from tools.trace import kernel_breakdown  # noqa: E402

from dllm_jax.decoding.generate import generate  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-8b", choices=list(common.MODELS))
    ap.add_argument("--rows", nargs="+", default=["off", "acache_0.2"], help="off, acache_RATIO")
    ap.add_argument("--affix-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--calls", type=int, default=3, help="block calls profiled")
    ap.add_argument("--new-requests", type=int, default=4, choices=range(1, 5), help="probed in the profiled step")
    ap.add_argument("--kv-budget-gib", type=float, default=16.0)
    ap.add_argument("--max-model-len", type=int, default=None, help="serve's default: the model's, at most 4096")
    ap.add_argument("--compile-cache", default=bench_serve.DEFAULT_CACHE)
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--compiler-option", action="append", metavar="NAME=VALUE", help="serve's, for the engine")
    common.output_args(ap)
    args = ap.parse_args(argv)
    item_args = SimpleNamespace(output_len=args.output_len, block_len=32, steps_per_block=8, bicache_depth=None)
    model = common.random_model(args.model)
    rng = np.random.default_rng(0)
    hi = min(100_000, model.config.vocab_size - 3)
    affix = rng.integers(0, hi, args.affix_len).tolist()
    prompts = [bench_serve.place("prefix", affix, rng.integers(0, hi, args.question_len).tolist()) for _ in range(16)]
    flags = ["--max-batch", "16", "--kv-budget-gib", f"{args.kv_budget_gib:g}", "--compile-cache", args.compile_cache]
    if args.max_model_len is not None:
        flags += ["--max-model-len", str(args.max_model_len)]
    for option in args.compiler_option or ():
        flags += ["--compiler-option", option]
    engine = bench_serve.serve_engine(model, flags)
    bench_serve.warm(engine, "dllm-jax serve " + " ".join(flags))
    rows = []
    dev = jax.devices()[0]
    name = f"serve_profile_{'h200' if 'H200' in dev.device_kind else dev.platform}.json"

    def save():
        common.write_results(name, common.meta(model=args.model, serve_flags=flags), rows, args.out, args.run)

    for row in args.rows:
        ratio = None if row == "off" else float(row.split("_", 1)[1])
        items = [bench_serve.gen_item(item_args, p, s, ratio, "acache", None, i) for i, (p, s) in enumerate(prompts)]
        n = args.new_requests
        add = lambda its: [engine.add_request(it.prompt, it.config, affix=it.span, seed=it.seed) for it in its]  # noqa: E731
        # 16 - 2n rows first, then n (their step runs the n-row probe program once: a program's first execution
        # carries one-time costs, ~100 ms on an H100, that are not the probe's), then the profiled n
        ids = add(items[: 16 - 2 * n])
        engine.step()
        ids += add(items[16 - 2 * n : 16 - n])
        for _ in range(3):  # the second arrivals' probe and first block, then 2 blocks of every row
            engine.step()
        ids += add(items[16 - n :])
        # the 4th call: the first rows decoding, the new ones (ACache: probed by a call first), under the profiler
        probe_call = kernel_breakdown(engine.step, calls=1) if ratio is not None else None
        t0 = time.perf_counter()  # then every call is one block of all 16 rows
        engine.step()
        wall_ms = (time.perf_counter() - t0) * 1e3
        breakdown = kernel_breakdown(engine.step, calls=args.calls)
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    engine.release(o.request_id)
        rows.append(dict(row=row, what="engine block call", wall_ms=wall_ms, requests=len(ids), **breakdown))
        print(f"{row}: block call {wall_ms:.1f} ms wall, {breakdown['busy_ms']:.1f} ms busy {breakdown['by_kind_ms']}")
        if probe_call is not None:
            what = f"engine block call probing {n} of 16 rows"
            per = {f"probe_{k}_per_request": (probe_call[k] - breakdown[k]) / n for k in ("busy_ms", "span_ms")}
            rows.append(dict(row=row, what=what, requests=len(ids), new_requests=n, **per, **probe_call))
            print(
                f"{row}: probing call {probe_call['busy_ms']:.1f} ms busy, span {probe_call['span_ms']:.1f} ms; {per}"
            )
        save()
    if not args.no_generate:
        gc = bench_serve.gen_item(item_args, prompts[0][0], None, None, "acache", None, 0).config
        batch = [p for p, _ in prompts]
        generate(model, batch, gc)  # compile
        blocks = args.output_len // 32
        breakdown = kernel_breakdown(lambda: generate(model, batch, gc), calls=1, per=blocks)
        rows.append(dict(row="generate", what="generate b16, per block", requests=16, **breakdown))
        print(f"generate: per block {breakdown['busy_ms']:.1f} ms busy {breakdown['by_kind_ms']}")
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
