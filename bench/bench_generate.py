"""GPU benchmark of `generate` at LLaDA-8B / Dream-7B shapes (random bf16 weights built on the device).

prompt 256, gen 256, block 32, a fixed schedule (steps 64 = 4 tokens/step, and 256), batch 1/8/32, cache modes
none/prefix/dual. Besides end-to-end tokens/s it times the two kinds of forward separately: the block-start
forward (full sequence, cache refresh) and the block step (the cache mode's per-step forward), each as 8 calls
fused in one jitted fori_loop. Writes bench/results/generate_h200.json and a plot.

    python bench/bench_generate.py [--models llada-8b dream-7b] [--batches 1 8 32] [--budget-s 420]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from dllm_jax.caches import STRATEGIES  # noqa: E402
from dllm_jax.caches.base import DecodeInputs  # noqa: E402
from dllm_jax.generate import GenerationConfig, compiler_options, generate, layout, resolve_backend  # noqa: E402
from dllm_jax.loading import Model, resolve_layer_layout  # noqa: E402
from dllm_jax.modeling import is_unrolled, stack_layers, unstack_layers  # noqa: E402

PROMPT, GEN, BLOCK = 256, 256, 32
FUSED = 8  # forwards per timed jitted loop


def forward_times(model: Model, gc: GenerationConfig, batch: int) -> tuple[float, float]:
    """(ms per block-start forward, ms per block step) for this cache mode, measured in a fused loop."""
    cfg = model.config
    prompts = [[7] * PROMPT] * batch
    x, pos, km, frozen, P = layout(prompts, cfg, gc)
    inp = DecodeInputs(jnp.asarray(pos), jnp.asarray(km), jnp.asarray(frozen), P, gc.block_length,
                       1 if cfg.family == "dream" else 0, resolve_backend(gc, cfg, False), padded=False,
                       ffn_backend=gc.ffn_backend, norm_rope_backend=gc.norm_rope_backend)
    strat = STRATEGIES[gc.cache]
    x = jnp.asarray(x)
    bs = jnp.int32(P + 2 * gc.block_length)  # a block in the middle of the generation region

    def looped(kind):
        def run(params, state):
            def body(i, carry):
                st, acc = carry
                fn = strat.block_start if kind == "start" else strat.step
                logits, st = fn(params, cfg, inp, st, x, bs)
                return st, acc + logits[0, 0, 0].astype(jnp.float32)
            return jax.lax.fori_loop(0, FUSED, body, (state, jnp.float32(0)))
        # the XLA options generate compiles this batch's program with (v15: Triton GEMMs off for FP8 dual-cache
        # programs over 64 tokens a block step)
        return jax.jit(run, donate_argnums=1, compiler_options=compiler_options(cfg, gc, batch))

    out = []
    for kind in ("start", "step"):
        fn = looped(kind)
        state = [strat.init(model.params, cfg, inp, x)]

        def call():
            st, acc = fn(model.params, state[0])
            acc.block_until_ready()
            state[0] = st

        med, _ = common.time_call(call, reps=3)
        out.append(1e3 * med / FUSED)
    return out[0], out[1]


def bench_one(model: Model, name: str, mode: str, batch: int, steps: int, rng: np.random.Generator,
              reps: int, ffn_backend: str = "xla", norm_rope: str = "xla", attention: str = "auto",
              step_loop: str = "auto") -> dict:
    gc = GenerationConfig(gen_length=GEN, block_length=BLOCK, steps=steps, cache=mode, stop_at_eos=False,
                          ffn_backend=ffn_backend, norm_rope_backend=norm_rope, attention_backend=attention,
                          step_loop=step_loop)
    prompts = [rng.integers(0, min(100_000, model.config.vocab_size - 3), PROMPT).tolist() for _ in range(batch)]
    tag = f"{name} {mode} b{batch} s{steps}{' fp8' if model.config.fp8_ffn else ''}"
    t0 = time.perf_counter()
    out = generate(model, prompts, gc)
    first = time.perf_counter() - t0
    print(f"    {tag}: first generate {first:.1f}s (compile included)", flush=True)  # long compiles show up here
    secs = []
    for _ in range(common.repeats(reps)):
        secs.append(generate(model, prompts, gc).seconds)
    sec = float(np.median(secs))
    t1 = time.perf_counter()
    ms_start, ms_step = forward_times(model, gc, batch)
    print(f"    {tag}: {reps} timed generates, median {sec:.3f}s; forward loops {time.perf_counter() - t1:.1f}s",
          flush=True)
    return {"model": name, "mode": mode, "batch": batch, "steps": steps, "gen_length": GEN, "block_length": BLOCK,
            "prompt_length": PROMPT, "tokens_per_s": batch * GEN / sec, "seconds": sec,
            "ms_per_nfe": 1e3 * sec / out.nfe, "ms_block_step": ms_step, "ms_block_start": ms_start,
            "nfe": out.nfe, "compile_s": max(first - sec, 0.0),
            "attention": resolve_backend(gc, model.config, False), "ffn_backend": ffn_backend,
            "norm_rope_backend": gc.norm_rope_backend, "step_loop": gc.step_loop,
            "layer_layout": "unrolled" if is_unrolled(model.params["layers"]) else "stacked"}


def newest_rows(rows: list[dict], steps: int = 64) -> dict:
    """{(model, mode, batch): the newest row (by date) of the fixed-`steps` schedule}, comparison twins left out:
    the plotted bars (the file keeps every run's rows, oldest first; primaries carry comparison=None)."""
    sel = [r for r in rows if r["steps"] == steps and not r.get("comparison")]
    return {(r["model"], r["mode"], r["batch"]): r for r in sorted(sel, key=lambda r: r.get("date") or "")}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latest = newest_rows(rows)
    models = sorted({m for m, _, _ in latest})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        batches = sorted({b for mm, _, b in latest if mm == m})
        series = [(mode, [latest[(m, mode, b)]["tokens_per_s"] if (m, mode, b) in latest else 0 for b in batches])
                  for mode in ("none", "prefix", "dual")]
        runs = sorted({str(r.get("run")) for (mm, _, _), r in latest.items() if mm == m and r.get("run")})
        common.grouped_bars(ax, [f"batch {b}" for b in batches], series, (113, "Fast-dLLM PyTorch (batch 1)"),
                            "tokens / s", f"{m}: gen 256, block 32, 64 steps (H200)"
                            + (f"\nnewest row per bar (runs {', '.join(runs)})" if runs else ""), log=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llada-8b", "dream-7b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--modes", nargs="+", default=["dual", "prefix", "none"])
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new rows after this long")
    ap.add_argument("--fp8-ffn", action="store_true", help="FFNs of layers >= 2 in e4m3 (LaCache's FP8 FFN)")
    ap.add_argument("--steps", nargs="+", type=int, default=[64], help="fixed schedules to time at every batch")
    ap.add_argument("--ffn-backend", choices=["xla", "pallas", "mgpu"], default="xla",
                    help="pallas / mgpu: FFN GEMMs of block steps on a weight-streaming kernel (issue 7)")
    ap.add_argument("--layer-layout", choices=["auto", "stacked", "unrolled"], default="auto",
                    help="stacked: scanned [L, ...] weights; unrolled: per-layer arrays (the GPU default, issue 7); "
                         "auto: what dllm_jax.load picks on this backend")
    ap.add_argument("--compare-stacked", action="store_true",
                    help="also time one row per model (dual, batch 1, 64 steps) with stacked weights, same run")
    ap.add_argument("--compare-bf16", action="store_true",
                    help="with --fp8-ffn: also time every row with the same weights in bf16, in the same run")
    ap.add_argument("--no-steps256", action="store_true", help="skip the fixed steps-256 batch-1 row per model")
    ap.add_argument("--norm-rope", choices=["auto", "xla", "pallas", "pallas_rope"],
                    default=GenerationConfig.norm_rope_backend,
                    help="GenerationConfig.norm_rope_backend of every row (default: the engine's)")
    ap.add_argument("--compare-attention", default=None, metavar="BACKEND",
                    help="also time every row with this attention backend (e.g. cudnn), same run")
    ap.add_argument("--compare-v13", action="store_true",
                    help="also time every row with session 13's default kernels (XLA's RoPE and K/V writes, XLA's "
                    "split-K merge of the block-step attention: norm_rope_backend='xla', MERGE_KERNEL off), same run")
    ap.add_argument("--compare-norm-rope", action="store_true",
                    help="also time every row with norm_rope_backend='xla' (the XLA norms and RoPE), same run")
    ap.add_argument("--compare-triton-gemm", action="store_true",
                    help="(v15) also time every FP8 row compiled with XLA's default options (Triton GEMMs on: "
                    "generate turns them off for FP8 above 64 tokens a block step), same run")
    ap.add_argument("--compare-step-loop", action="store_true",
                    help="(v16) also time every row with GenerationConfig.step_loop='while' (the in-block steps as a "
                    "while loop that checks the block on the host at every step), same run")
    ap.add_argument("--compare-column-tiles", action="store_true",
                    help="(v17) with --fp8-ffn: also time every row without the FP8 GEMM's column tiles "
                    "(fp8_matmul.COLUMN_TILES off: Dream-7B's block-step gate/up on 128-wide tiles), same run")
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args()
    if args.compare_bf16 and not args.fp8_ffn:
        raise SystemExit("--compare-bf16 needs --fp8-ffn")
    layer_layout = resolve_layer_layout(args.layer_layout)
    if args.compare_stacked and layer_layout != "unrolled":
        raise SystemExit(f"--compare-stacked compares against the unrolled layout; this run's layout is "
                         f"{layer_layout} (pass --layer-layout unrolled)")
    t_start = time.perf_counter()
    rows, skipped = [], []
    rng = np.random.default_rng(0)
    plan = []
    for name in args.models:
        for batch in args.batches:
            for mode in args.modes:
                for steps in args.steps:
                    plan.append((name, mode, batch, steps))
        if not args.no_steps256:
            plan.append((name, "dual", 1, 256))
    current = None
    for i, (name, mode, batch, steps) in enumerate(plan):
        if time.perf_counter() - t_start > args.budget_s:
            skipped.append(dict(model=name, mode=mode, batch=batch, steps=steps))
            continue
        if current is None or current.config.replace(fp8_ffn=False) != common.MODELS[name]:
            current = None
            params = common.random_params(common.MODELS[name])
            config = common.MODELS[name]
            bf16 = None
            if args.fp8_ffn:
                from dllm_jax import fp8

                if args.compare_bf16:  # the same weights in bf16, timed in this process for same-run ratios
                    bf16 = Model(config, unstack_layers(params) if layer_layout == "unrolled" else params)
                params, config = fp8.quantize_params(params, config, on_device=True)
            if layer_layout == "unrolled":
                params = unstack_layers(params)
            current = Model(config, params)
            what = "random weights" + (" + FP8 quantisation" if args.fp8_ffn else "")
            print(f"[{time.perf_counter() - t_start:5.0f}s] {name}: {what} ready ({layer_layout})", flush=True)
            if args.compare_stacked:  # one reference row per model: dual, batch 1, 64 steps, stacked weights
                try:
                    stacked = Model(config, stack_layers(params, config))
                    row = bench_one(stacked, name, "dual", 1, 64, rng, 3, args.ffn_backend)
                    row.update(fp8_ffn=bool(args.fp8_ffn), comparison="same-run stacked baseline")
                    rows.append(row)
                    save(args, layer_layout, rows, skipped)
                    print(f"[stacked] {name} dual b1 s64 {row['tokens_per_s']:8.1f} tok/s  step "
                          f"{row['ms_block_step']:6.2f} ms  start {row['ms_block_start']:6.2f} ms", flush=True)
                except Exception as e:  # noqa: BLE001  (the comparison must not lose the run)
                    print(f"FAILED stacked comparison {name}: {type(e).__name__}: {e}", flush=True)
                    skipped.append(dict(model=name, comparison="stacked", error=str(e)[:300]))
                stacked = None
        reps = 1 if (mode == "none" and batch >= 8) or steps == 256 else 3
        try:
            row = bench_one(current, name, mode, batch, steps, rng, reps, args.ffn_backend, args.norm_rope)
        except Exception as e:  # keep going: one failing shape must not lose the rest of the run
            print(f"FAILED {name} {mode} b{batch} s{steps}: {type(e).__name__}: {e}", flush=True)
            skipped.append(dict(model=name, mode=mode, batch=batch, steps=steps, error=str(e)[:300]))
            continue
        row["fp8_ffn"] = bool(args.fp8_ffn)
        rows.append(row)
        def twin(model: Model, kind: str, key: str, label: str, fp8: bool, **kernels) -> None:
            """The same row timed with one choice changed, in this process: a comparison row, and the row's
            speedup_vs_<key> / block_step_speedup_vs_<key> over it."""
            try:
                ref = bench_one(model, name, mode, batch, steps, rng, reps, args.ffn_backend, **kernels)
            except Exception as e:  # noqa: BLE001  (the comparison must not lose the run)
                print(f"FAILED {kind} twin {name} {mode} b{batch} s{steps}: {type(e).__name__}: {e}", flush=True)
                skipped.append(dict(model=name, mode=mode, batch=batch, steps=steps, comparison=kind,
                                    error=str(e)[:300]))
                return
            ref.update(fp8_ffn=fp8, comparison=label)
            rows.append(ref)
            row[f"speedup_vs_{key}"] = ref["seconds"] / row["seconds"]
            row[f"block_step_speedup_vs_{key}"] = ref["ms_block_step"] / row["ms_block_step"]
            print(f"    {label}: {ref['tokens_per_s']:8.1f} tok/s  step {ref['ms_block_step']:6.2f} ms -> "
                  f"{row[f'speedup_vs_{key}']:.3f}x end to end, {row[f'block_step_speedup_vs_{key}']:.3f}x block "
                  f"step", flush=True)

        if bf16 is not None:
            twin(bf16, "bf16", "bf16", "same-run bf16 baseline", False, norm_rope=args.norm_rope)
        if args.compare_attention:
            twin(current, "attention", "attention_twin", f"same-run attention {args.compare_attention}",
                 bool(args.fp8_ffn), norm_rope=args.norm_rope, attention=args.compare_attention)
        if args.compare_v13:  # norm_rope="xla" is a new static config, so the patched merge switch is traced anew
            from pallas_kernels import slot_attention

            with mock.patch.object(slot_attention, "MERGE_KERNEL", False):
                twin(current, "v13", "v13_default", "same-run v13 default kernels", bool(args.fp8_ffn),
                     norm_rope="xla")
        if args.compare_norm_rope:
            twin(current, "norm_rope", "xla_norm_rope", "same-run norm_rope xla", bool(args.fp8_ffn), norm_rope="xla")
        # only where generate changes the options (else the twin would be the same program)
        if args.compare_triton_gemm and compiler_options(current.config, GenerationConfig(block_length=BLOCK,
                                                                                          cache=mode), batch):
            import importlib

            generate_module = importlib.import_module("dllm_jax.generate")  # the module, not the function

            with mock.patch.object(generate_module, "NO_TRITON_GEMM_FP8_ABOVE_TOKENS", None):
                twin(current, "triton_gemm", "triton_gemm_on", "same-run XLA default options (Triton GEMMs on)",
                     True, norm_rope=args.norm_rope)
        if args.compare_step_loop:
            twin(current, "step_loop", "while_step_loop", "same-run step_loop while", bool(args.fp8_ffn),
                 norm_rope=args.norm_rope, step_loop="while")
        if args.compare_column_tiles and args.fp8_ffn:
            from pallas_kernels import fp8_matmul

            # the tiling is chosen when the program is traced: drop the cached traces so the twin is traced anew
            jax.clear_caches()
            with mock.patch.object(fp8_matmul, "COLUMN_TILES", False):
                twin(current, "column_tiles", "no_column_tiles", "same-run FP8 without column tiles", True,
                     norm_rope=args.norm_rope)
            jax.clear_caches()
        print(f"[{i + 1}/{len(plan)} {time.perf_counter() - t_start:5.0f}s] {name:9s} {mode:6s} b{batch:<3d} "
              f"s{steps:<4d} {row['tokens_per_s']:8.1f} tok/s  {row['ms_per_nfe']:6.2f} ms/NFE  "
              f"step {row['ms_block_step']:6.2f} ms  start {row['ms_block_start']:6.2f} ms  "
              f"compile {row['compile_s']:.1f}s", flush=True)
        save(args, layer_layout, rows, skipped)
    path = save(args, layer_layout, rows, skipped)
    plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}")


def save(args, layer_layout: str, rows: list[dict], skipped: list[dict]) -> Path:
    """Write the JSON (after every row too, so a run cut short by a time limit keeps what it measured)."""
    meta = common.meta(prompt_length=PROMPT, gen_length=GEN, block_length=BLOCK, weights="random bf16",
                       schedule="fixed (steps given), stop_at_eos off", skipped=skipped, layer_layout=layer_layout,
                       baseline="Fast-dLLM official PyTorch, same GPU kind (anchors): batch 1, steps 64: "
                                "dual 98-113 tok/s, prefix 130-138, none 125.7; batch > 1 unsupported")
    stem = "generate" + ("_fp8" if args.fp8_ffn else "") \
        + (f"_{args.ffn_backend}_ffn" if args.ffn_backend != "xla" else "") \
        + ("_stacked" if layer_layout == "stacked" and args.layer_layout != "auto" else "") + "_h200"
    return common.write_results(f"{stem}.json", meta, rows, args.out)


if __name__ == "__main__":
    main()
