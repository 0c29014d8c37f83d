"""How much faster does tensor parallelism decode? LLaDA-8B shapes, random bf16 weights, the dual cache, --tp devices
(`dllm_jax.load(tensor_parallel=N)`'s split: `dllm_jax/transformer/sharding.py`) against one device in the same run.

Rows: model, tp, batch, mode, attention (the kernels: tp > 1 runs XLA's; tp 1 is timed with XLA's too, and with the
default kernels), tokens_per_s (generated tokens / median wall time of `generate`), ms_block_step (that time over
the forwards it ran, NFE: the mean forward of the denoising loop, block-start refreshes included), nfe, and the
same-run ratios vs_tp1 (tokens/s over tp 1 with the same kernels) and step_vs_tp1 (ms_block_step over tp 1's).
Targets (issue 34, two H200s): batch 32 >= 1.7x, batch-1 block step <= 0.7x.
Writes bench/results/tp_h200x2.json (tp_cpu_smoke.json on the CPU) and a plot.

    PYTHONPATH=. python bench/bench_tp.py --run NAME                   # tp 1 and 2, batch 1, 16, 32
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python bench/bench_tp.py --model tiny \\
        --batches 1 --prompt-len 16 --gen-len 8 --run smoke            # the CPU smoke run (the tests')
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
from tools import common  # noqa: E402

from dllm_jax.decoding.config import GenerationConfig  # noqa: E402
from dllm_jax.decoding.generate import generate  # noqa: E402
from dllm_jax.io.loading import Model, resolve_layer_layout  # noqa: E402
from dllm_jax.transformer.params import unstack_layers  # noqa: E402
from dllm_jax.transformer.sharding import shard_params, tensor_parallel_mesh  # noqa: E402


def model_on(name: str, tp: int) -> Model:
    """Random weights in the device's layout; tp > 1: unfused per-projection weights split over tp devices."""
    cfg = common.MODELS[name]
    params = common.random_params(cfg)
    if resolve_layer_layout("auto") == "unrolled":
        params = unstack_layers(params, fuse=tp == 1)
    return Model(cfg, params if tp == 1 else shard_params(params, cfg, tensor_parallel_mesh(tp)))


def time_generate(model: Model, prompts: list[list[int]], gc: GenerationConfig) -> tuple[float, float, int]:
    """(median seconds, first call's seconds, NFE) of generate on these prompts."""
    nfe = []

    def run():
        out = generate(model, prompts, gc)
        jax.block_until_ready(out.tokens)
        nfe.append(int(out.nfe))

    median, first = common.time_call(run, reps=5, warmup=2)
    return median, first, nfe[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llada-8b", choices=sorted(common.MODELS))
    ap.add_argument("--tp", default="1,2", help="comma-separated device counts (1 is the baseline)")
    ap.add_argument("--batches", default="1,16,32", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--block-len", type=int, default=32)
    ap.add_argument("--steps-per-block", type=int, default=8)
    common.output_args(ap, budget_s=540.0)
    args = ap.parse_args(argv)
    tps = [int(t) for t in args.tp.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if tps[0] != 1 or any(t > len(jax.devices()) for t in tps):
        ap.error(f"--tp must start at 1 and fit the {len(jax.devices())} devices here, got {args.tp}")
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    steps = args.gen_len // args.block_len * args.steps_per_block
    name = "tp_cpu_smoke.json" if common.SMOKE_ON_CPU else "tp_h200x2.json"
    meta = common.meta(devices=len(jax.devices()), **{k: v for k, v in vars(args).items() if k not in ("out",)})
    rows: list[dict] = []
    for tp in tps:
        model = model_on(args.model, tp)
        hi = min(100_000, model.config.vocab_size - 3)
        kernels = ["xla", "auto"] if tp == 1 and not common.SMOKE_ON_CPU else ["xla"]
        for attention in kernels:
            for b in batches:
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"budget: stopping before tp {tp} batch {b}", flush=True)
                    break
                prompts = rng.integers(0, hi, (b, args.prompt_len)).tolist()
                gc = GenerationConfig.from_options(
                    gen_length=args.gen_len,
                    block_length=args.block_len,
                    steps=steps,
                    cache="dual",
                    stop_at_eos=False,
                    attention=attention,
                )
                median, first, nfe = time_generate(model, prompts, gc)
                row = dict(
                    model=args.model,
                    tp=tp,
                    batch=b,
                    mode="dual",
                    attention=attention,
                    tokens_per_s=b * args.gen_len / median,
                    ms_block_step=1e3 * median / nfe,
                    nfe=nfe,
                    first_call_s=first,
                )
                base = next((r for r in rows if (r["tp"], r["batch"], r["attention"]) == (1, b, attention)), None)
                if base is not None and tp > 1:
                    row["vs_tp1"] = row["tokens_per_s"] / base["tokens_per_s"]
                    row["step_vs_tp1"] = row["ms_block_step"] / base["ms_block_step"]
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
                common.write_results(name, meta, rows, args.out, args.run)
        del model  # one model's weights on the devices at a time
    labels = [f"b{b}" for b in batches]
    series = [
        (
            f"tp{tp} {att}",
            [
                next((r["tokens_per_s"] for r in rows if (r["tp"], r["batch"], r["attention"]) == (tp, b, att)), 0.0)
                for b in batches
            ],
        )
        for tp, att in dict.fromkeys((r["tp"], r["attention"]) for r in rows)
    ]
    png = Path(args.out) / name.replace(".json", ".png")
    common.grouped_bars(png, labels, series, "tokens/s", f"{args.model}: dual cache, tensor parallel ({args.run})")
    print(f"wrote {Path(args.out) / name} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
