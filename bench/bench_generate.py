"""How fast does `generate` run? Tokens/s end to end at LLaDA-8B / Dream-7B shapes, and the two forwards it is made of.

Random bf16 weights built on the device (speed does not depend on them); prompt 256, gen 256, block 32, a fixed
schedule (64 steps = 8 block starts + 56 block steps; stop_at_eos off), cache modes dual / prefix / none, batch 1 /
8 / 32, the engine's default layer layout (per-layer weights on a GPU). Per row:
  tokens_per_s, seconds  median of --reps timed generates after a warm-up generate (which compiles: compile_s)
  ms_block_start         one block-start forward of this cache mode (8 fused in a jitted loop, cache donated)
  ms_block_step          one block step of this cache mode, the same way (a call of 8 steps)
  ms_block_step_loop     (--loop L) one more block step inside a jitted loop, (t(L) - t(8)) / (L - 8): what a step
                         costs in generate, which runs a whole generation as one call
  ms_floor_hbm, ms_floor_compute  (dual) the block step's floors: the weights as stored (embedding excluded) and the
                         K/V cache read once at this run's HBM rate; 2 FLOPs per weight per token at its bf16 GEMM
                         rate (the e4m3 weights at its e4m3 rate): `common.measure_floors`, in meta.floors
  floor_ms_block_step / _start  the larger floor of a block step / start; block_step_of_floor / block_start_of_floor
                         the achieved fraction (floor / measured)
  trace_block_step       (--trace) device ms per kernel kind of one block step, busy / span / idle, top kernels
--weights fp8_ffn (--fp8-ffn) runs the FFNs of layers >= 2 in e4m3, fp8_all also q/k/v, o and the head;
--compare-bf16 times every row again with the same weights in bf16 in the same process (comparison row,
speedup_vs_bf16). --twin FIELD=VALUE times every row again with one `GenerationConfig.from_options` option
changed (e.g. attention=cudnn, step_loop=while, rope_write=xla); --set FIELD=VALUE sets one for every row.
Writes bench/results/generate_h200.json (generate_fp8_h200.json with FP8 weights; rows merged by --run label) and
a tokens/s plot beside it. On the CPU: --models tiny (a smoke test of the same code path).

    PYTHONPATH=. python bench/bench_generate.py --modes dual --loop 24 --run NAME      # both models, b 1/8/32
    PYTHONPATH=. python bench/bench_generate.py --fp8-ffn --compare-bf16 --modes dual --batches 1 8 --run NAME
    PYTHONPATH=. python bench/bench_generate.py --weights fp8_all --compare-bf16 --modes dual --batches 1 8 32 --run N
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common, trace  # noqa: E402

# package imports (re-point here when the package moves)
from dllm_jax.decoding.caches import strategy_for  # noqa: E402
from dllm_jax.decoding.config import GenerationConfig  # noqa: E402
from dllm_jax.decoding.generate import compiler_options, generate  # noqa: E402
from dllm_jax.io.loading import Model, resolve_layer_layout  # noqa: E402
from dllm_jax.transformer.params import quantize_params, quantize_projections, unstack_layers  # noqa: E402

PROMPT, GEN, BLOCK = 256, 256, 32
FUSED = 8  # forwards per timed call


def forward_times(model: Model, gc: GenerationConfig, batch: int, loop: int = 0, traced: bool = False) -> dict:
    """ms of one block-start forward and one block step of gc.cache (calls of FUSED in a jitted loop, compiled with
    the options generate uses for this program); with loop, also the step's slope inside a longer loop."""
    cfg = model.config
    x, inp = common.decode_inputs(model, gc, [[7] * PROMPT] * batch)
    strat = strategy_for(gc.cache.mode)
    bs = inp.prompt_len + 2 * gc.schedule.block_length  # a block in the middle of the generation region
    opts = compiler_options(cfg, gc, batch)
    out = {}
    for kind, fn in (("start", strat.block_start), ("step", strat.step)):
        call = common.fused_loop(
            lambda p, st, fn=fn: fn(p, cfg, inp, st, x, bs), model.params, strat.init(model.params, cfg, inp, x), opts
        )
        t8, _ = common.time_call(lambda call=call: call(FUSED), reps=3)
        out[f"ms_block_{kind}"] = 1e3 * t8 / FUSED
        if kind == "step" and loop > FUSED:
            t_long, _ = common.time_call(lambda call=call: call(loop), reps=3)
            out.update(ms_block_step_loop=1e3 * (t_long - t8) / (loop - FUSED), loop_steps=loop)
        if kind == "step" and traced:
            out["trace_block_step"] = trace.kernel_breakdown(lambda call=call: call(FUSED), per=FUSED)
    return out


def floors(model: Model, batch: int, rates: dict | None = None) -> dict:
    """The block step's and block start's floors: HBM (the weights as stored, embedding excluded, and the K/V cache
    read once) and compute (2 FLOPs per weight per token, the e4m3 ones at the e4m3 rate), at `rates` (this run's
    `common.measure_floors`) or, without them, the H200's nominal figures; a floor is the larger of the two."""
    cfg = model.config
    hbm = rates["hbm_bytes_per_s"] if rates else common.HBM_BYTES_PER_S
    bf16 = rates["bf16_flops_per_s"] if rates else common.BF16_FLOPS_PER_S
    e4m3 = rates["e4m3_flops_per_s"] if rates else common.FP8_FLOPS_PER_S
    stored = common.param_bytes(model.params) - common.param_bytes(model.params["embed"])
    kv = 2 * cfg.n_layers * batch * (PROMPT + GEN) * cfg.n_kv_heads * cfg.head_dim * 2
    fp8 = common.fp8_weight_count(cfg)
    per_token_s = 2 * ((common.weight_count(cfg) - fp8) / bf16 + fp8 / e4m3)  # compute seconds a token

    def floor(tokens: int) -> tuple[float, float]:
        return 1e3 * (stored + kv) / hbm, 1e3 * per_token_s * tokens

    step_hbm, step_compute = floor(batch * BLOCK)
    start_hbm, start_compute = floor(batch * (PROMPT + GEN))
    return {
        "ms_floor_hbm": step_hbm,
        "ms_floor_compute": step_compute,
        "floor_ms_block_step": max(step_hbm, step_compute),
        "floor_ms_block_start": max(start_hbm, start_compute),
        "floor_rates": "this run" if rates else "nominal H200",
    }


def bench_one(
    model: Model,
    name: str,
    mode: str,
    batch: int,
    steps: int,
    reps: int,
    loop: int = 0,
    traced: bool = False,
    rates: dict | None = None,
    **overrides,
) -> dict:
    gc = GenerationConfig.from_options(
        gen_length=GEN, block_length=BLOCK, steps=steps, cache=mode, stop_at_eos=False, **overrides
    )
    rng = np.random.default_rng(batch)  # the same prompts for a row and its twins
    prompts = [rng.integers(0, min(100_000, model.config.vocab_size - 3), PROMPT).tolist() for _ in range(batch)]
    weights = model.config.weights
    tag = f"{name} {mode} b{batch} s{steps}{'' if weights == 'bf16' else ' ' + weights} {overrides or ''}"
    t0 = time.perf_counter()
    out = generate(model, prompts, gc)
    first = time.perf_counter() - t0
    print(f"    {tag}: first generate {first:.1f}s (compile included)", flush=True)
    sec = float(np.median([generate(model, prompts, gc).seconds for _ in range(common.repeats(reps))]))
    row = {
        "model": name,
        "mode": mode,
        "batch": batch,
        "steps": steps,
        "gen_length": GEN,
        "block_length": BLOCK,
        "prompt_length": PROMPT,
        "tokens_per_s": batch * GEN / sec,
        "seconds": sec,
        "ms_per_nfe": 1e3 * sec / out.nfe,
        "nfe": out.nfe,
        "compile_s": max(first - sec, 0.0),
        **forward_times(model, gc, batch, loop, traced),
        **(floors(model, batch, rates) if mode == "dual" else {}),
        "fp8_ffn": bool(model.config.fp8_ffn),
        "weights": weights,
        "attention": common.kernels(model, gc).attention,
        "rope_write": common.kernels(model, gc).rope_write,
        "step_loop": gc.kernels.step_loop,
        "date": common.now(),
        "comparison": None,
    }
    for kind in ("step", "start"):  # the achieved fraction of the floor (1: at the floor)
        if f"floor_ms_block_{kind}" in row and row.get(f"ms_block_{kind}"):
            row[f"block_{kind}_of_floor"] = row[f"floor_ms_block_{kind}"] / row[f"ms_block_{kind}"]
    print(
        f"    {tag}: {row['tokens_per_s']:8.1f} tok/s  step {row['ms_block_step']:6.2f} ms  start "
        f"{row['ms_block_start']:6.2f} ms  loop step {row.get('ms_block_step_loop', float('nan')):6.2f} ms",
        flush=True,
    )
    return row


def parse_twin(arg: str) -> tuple[str, object]:
    """FIELD=VALUE -> (option, value) of GenerationConfig.from_options: ints, floats, true/false/none, else the
    string."""
    field, sep, value = arg.partition("=")
    if not sep or field not in GenerationConfig.option_names():
        raise SystemExit(
            f"--set / --twin: expected FIELD=VALUE with a GenerationConfig.from_options option, got {arg!r}"
        )
    low = value.lower()
    for cast in (int, float):
        try:
            return field, cast(value)
        except ValueError:
            pass
    return field, {"true": True, "false": False, "none": None}.get(low, value)


def plotted_gpu(rows: list[dict], gpus: dict[str, str]) -> str | None:
    """The GPU most of the rows ran on (gpus: each run label's, from meta.runs): one chart never mixes cards."""
    counts = collections.Counter(gpus.get(r.get("run")) for r in rows if gpus.get(r.get("run")))
    return counts.most_common(1)[0][0] if counts else None


def newest_rows(rows: list[dict], steps: int = 64, gpus: dict[str, str] | None = None) -> dict:
    """{(model, mode, batch): the newest row (by date) of the fixed-`steps` schedule}, comparison twins left out;
    with gpus (each run label's GPU), no row of another GPU than `plotted_gpu`'s."""
    gpu = plotted_gpu(rows, gpus) if gpus else None
    sel = [r for r in rows if r["steps"] == steps and not r.get("comparison")]
    sel = [r for r in sel if gpu is None or gpus.get(r.get("run")) in (gpu, None)]  # older rows name no GPU
    return {(r["model"], r["mode"], r["batch"]): r for r in sorted(sel, key=lambda r: r.get("date") or "")}


def plot(rows: list[dict], path: Path, gpus: dict[str, str] | None = None) -> None:
    latest, gpu = newest_rows(rows, gpus=gpus), plotted_gpu(rows, gpus or {})
    keys = sorted({(m, b) for m, _, b in latest})
    series = [
        (mode, [latest[(m, mode, b)]["tokens_per_s"] if (m, mode, b) in latest else 0 for m, b in keys])
        for mode in ("none", "prefix", "dual")
    ]
    common.grouped_bars(
        path,
        [f"{m}\nbatch {b}" for m, b in keys],
        series,
        "tokens / s",
        f"generate{' on ' + gpu if gpu else ''}: prompt 256, gen 256, block 32, 64 steps (newest row per bar)",
        ref=(113, "Fast-dLLM PyTorch, dual, batch 1"),
        log=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llada-8b", "dream-7b"], choices=list(common.MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--modes", nargs="+", default=["dual", "prefix", "none"])
    ap.add_argument("--steps", nargs="+", type=int, default=[64], help="fixed schedules (256: one token a step)")
    ap.add_argument("--reps", type=int, default=3, help="timed generates per row (1 for none at batch >= 8)")
    ap.add_argument("--loop", type=int, default=0, metavar="L", help="also time block steps in a loop of L > 8")
    ap.add_argument("--trace", action="store_true", help="device time of a block step by kernel kind")
    ap.add_argument(
        "--weights",
        choices=["bf16", "fp8_ffn", "fp8_all"],
        default="bf16",
        help="layers >= 2 in e4m3: fp8_ffn the FFNs (LaCache's FP8 FFN), fp8_all also q/k/v, o and the LM head",
    )
    ap.add_argument("--fp8-ffn", action="store_true", help="the same as --weights fp8_ffn")
    ap.add_argument("--compare-bf16", action="store_true", help="with FP8 weights: the same weights in bf16 too")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a GenerationConfig.from_options option for every row (e.g. attention=cudnn)",
    )
    ap.add_argument(
        "--twin",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="also time every row with this option changed, same process",
    )
    ap.add_argument(
        "--layer-layout",
        choices=["auto", "stacked", "unrolled"],
        default="auto",
        help="stacked: scanned [L, ...] weights; unrolled: per-layer arrays (auto: the GPU's default)",
    )
    common.output_args(ap, budget_s=420.0)
    args = ap.parse_args()
    if args.fp8_ffn and args.weights == "bf16":
        args.weights = "fp8_ffn"
    if args.compare_bf16 and args.weights == "bf16":
        ap.error("--compare-bf16 needs FP8 weights (--weights)")
    fixed, twins = dict(parse_twin(t) for t in args.set), [parse_twin(t) for t in args.twin]
    layer_layout = resolve_layer_layout(args.layer_layout)
    stacked = "_stacked" if args.layer_layout == "stacked" else ""
    name_json = f"generate{'_fp8' if args.weights != 'bf16' else ''}{stacked}_h200.json"
    meta = common.meta(
        prompt_length=PROMPT,
        gen_length=GEN,
        block_length=BLOCK,
        weights="random bf16",
        layer_layout=layer_layout,
        schedule="fixed (steps given), stop_at_eos off",
        baseline="Fast-dLLM official PyTorch, same GPU kind, batch 1, steps 64: dual 98-113 tok/s, "
        "prefix 130-138, none 125.7; batch > 1 unsupported",
    )
    t_start = time.perf_counter()
    rates = common.measure_floors()  # this run's HBM and GEMM rates: the floors of every row
    meta["floors"] = rates
    print(f"floors: {rates}", flush=True)
    rows, skipped = [], []
    for name in args.models:
        config, params = common.MODELS[name], common.random_params(common.MODELS[name])
        bf16 = None
        if args.weights != "bf16":
            if args.compare_bf16:
                bf16 = Model(config, unstack_layers(params) if layer_layout == "unrolled" else params)
            params, config = quantize_params(params, config, on_device=True)
            if args.weights == "fp8_all":
                params, config = quantize_projections(params, config)
        model = Model(config, unstack_layers(params) if layer_layout == "unrolled" else params)
        print(f"[{time.perf_counter() - t_start:5.0f}s] {name} ready ({layer_layout})", flush=True)
        for batch in args.batches:
            for mode in args.modes:
                for steps in args.steps:
                    if time.perf_counter() - t_start > args.budget_s:
                        skipped.append(dict(model=name, mode=mode, batch=batch, steps=steps))
                        continue
                    reps = 1 if (mode == "none" and batch >= 8) or steps > 64 else args.reps
                    timed = (
                        [(model, "", {})]
                        + ([(bf16, "bf16", {})] if bf16 else [])
                        + [(model, f"{f}={v}", {f: v}) for f, v in twins]
                    )
                    for m, label, overrides in timed:
                        try:
                            row = bench_one(
                                m,
                                name,
                                mode,
                                batch,
                                steps,
                                reps,
                                args.loop,
                                args.trace,
                                rates,
                                **{**fixed, **overrides},
                            )
                        except Exception as e:  # noqa: BLE001  one failing row must not lose the run
                            print(f"FAILED {name} {mode} b{batch} s{steps} {label}: {type(e).__name__}: {e}")
                            skipped.append(
                                dict(model=name, mode=mode, batch=batch, steps=steps, twin=label, error=str(e)[:300])
                            )
                            continue
                        if label:  # a same-run twin of the row before it
                            row["comparison"] = f"same-run {label}"
                            main_row = next((r for r in reversed(rows) if not r["comparison"]), None)
                            if main_row is not None and (
                                main_row["model"],
                                main_row["mode"],
                                main_row["batch"],
                                main_row["steps"],
                            ) == (name, mode, batch, steps):
                                main_row[f"speedup_vs_{label}"] = row["seconds"] / main_row["seconds"]
                                main_row[f"block_step_speedup_vs_{label}"] = (
                                    row["ms_block_step"] / main_row["ms_block_step"]
                                )
                        rows.append(row)
                        common.write_results(name_json, {**meta, "skipped": skipped}, rows, args.out, args.run)
        del model, bf16, params
    path = common.write_results(name_json, {**meta, "skipped": skipped}, rows, args.out, args.run)
    data = json.loads(path.read_text())
    plot(data["rows"], path.with_suffix(".png"), {k: v.get("gpu") for k, v in data["meta"]["runs"].items()})
    print(f"wrote {path} and its plot")


if __name__ == "__main__":
    main()
