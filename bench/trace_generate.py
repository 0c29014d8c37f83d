"""Trace one whole `generate` call (jax.profiler): where a generation's time goes beyond its forwards.

For a model of bench/common.py (random weights, optionally the FP8 FFN), one batch size and the benchmarks'
schedule (prompt 256, gen 256, block 32, 64 steps, dual cache), it times `generate` (median of 3 after a compile),
traces one more call (device ms by kernel kind, the top kernels, the streams' idle time and the kernels it
precedes: kernel_trace), and searches the optimised HLO of the program for copies of cache-sized buffers (K/V
copied at a loop boundary would cost ~0.7 ms per GB of cache). Writes bench/results/generate_trace_h200.json
(rows appended per model and batch; `--run LABEL --note TEXT` tags the row and adds meta.runs[LABEL], the earlier
runs' entries kept). GPU for meaningful numbers; `--model tiny` runs on the CPU (empty trace).

    python bench/trace_generate.py --model llada-8b --batch 8 --fp8-ffn --run s19a --note "..."
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from kernel_trace import kernel_breakdown  # noqa: E402

from dllm_jax.generate import GenerationConfig, _generate_jit, compiler_options, generate, layout  # noqa: E402
from dllm_jax.loading import Model  # noqa: E402
from dllm_jax.modeling import unstack_layers  # noqa: E402

PROMPT, GEN, BLOCK, STEPS = 256, 256, 32, 64


def cache_copies(hlo_text: str, shape: str) -> list[dict]:
    """Copy instructions of the optimised HLO whose result has this shape (e.g. '[8,512,32,128]'), with the
    computation each sits in."""
    found: collections.Counter = collections.Counter()
    computation = None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = "ENTRY" if line.startswith("ENTRY") else line.split(" ")[0]
        if re.search(r"=\s*\w+" + re.escape(shape) + r"\S*\s+copy(-start)?\(", line):
            found[(computation, line.strip()[:200])] += 1
    return [{"computation": c, "line": l, "n": n} for (c, l), n in found.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llada-8b", choices=sorted(common.MODELS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--fp8-ffn", action="store_true")
    ap.add_argument("--step-loop", choices=["auto", "while"], default=GenerationConfig.step_loop)
    ap.add_argument("--out", default=str(common.RESULTS))
    ap.add_argument("--run", default=None, help="label of this run: the row's `run` and meta.runs[label]")
    ap.add_argument("--note", default="", help="what the run was for (meta.runs[label].note)")
    args = ap.parse_args()
    cfg = common.MODELS[args.model]
    params = common.random_params(cfg)
    if args.fp8_ffn:
        from dllm_jax import fp8

        params, cfg = fp8.quantize_params(params, cfg, on_device=True)
    model = Model(cfg, unstack_layers(params))
    gc = GenerationConfig(gen_length=GEN, block_length=BLOCK, steps=STEPS, cache="dual", stop_at_eos=False,
                          step_loop=args.step_loop)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(100_000, cfg.vocab_size - 3), PROMPT).tolist() for _ in range(args.batch)]
    t0 = time.perf_counter()
    generate(model, prompts, gc)
    first = time.perf_counter() - t0
    seconds = [generate(model, prompts, gc).seconds for _ in range(3)]
    trace = kernel_breakdown(lambda: generate(model, prompts, gc), calls=1, top=40)
    x, pos, km, fr, p = layout(prompts, cfg, gc)
    run = _generate_jit(tuple(sorted((compiler_options(cfg, gc, args.batch) or {}).items())))
    hlo = run.lower(model.params, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(km), jnp.asarray(fr),
                    jax.random.key(0), config=cfg, gc=gc, prompt_len=p, padded=False).compile().as_text()
    shape = f"[{args.batch},{x.shape[1]},{cfg.n_kv_heads},{cfg.head_dim}]"
    copies = cache_copies(hlo, shape)
    row = {"model": args.model, "batch": args.batch, "fp8_ffn": args.fp8_ffn, "step_loop": args.step_loop,
           "seconds": float(np.median(seconds)), "seconds_all": seconds, "first_call_s": first,
           "cache_shape": shape, "cache_copies": copies, "trace": trace}
    path = Path(args.out) / "generate_trace_h200.json"
    old = json.loads(path.read_text()) if path.exists() else {"meta": {}, "rows": []}
    meta = common.meta(prompt_length=PROMPT, gen_length=GEN, block_length=BLOCK, steps=STEPS, cache="dual")
    meta["runs"] = dict(old["meta"].get("runs", {}))  # the earlier runs' notes stay with their rows
    if args.run:
        row = {**row, "run": args.run, "git": meta["git"]}
        meta["runs"][args.run] = {"git": meta["git"], "date": meta["date"], "note": args.note}
    common.write_results(path.name, meta, old["rows"] + [row], args.out)
    print(f"{args.model} b{args.batch}{' fp8' if args.fp8_ffn else ''}: {row['seconds']:.3f} s a generate; busy "
          f"{trace.get('busy_ms', 0):.1f} ms, idle {trace.get('idle_ms', 0):.1f} ms, by kind "
          f"{ {k: round(v, 1) for k, v in trace.get('by_kind_ms', {}).items()} }; cache-sized copies in the HLO: "
          f"{sum(c['n'] for c in copies)}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
