"""FP8 FFN kernels at block-step sizes (issue 5): device time of each tiling of the Mosaic GPU GEMM, and of the
fused quantisers (`pallas_kernels/fp8_quantize.py`), from a profiler trace (not wall time: at M = 32 a call's
wall time is mostly dispatch, bench/NOTES.md v5).

  python bench/sweep_fp8_small_m.py --out bench/results/fp8_small_m_h200.json      (H200, ~3 minutes)

Why: at M = 32 the gate/up GEMM's 192 work units (128-wide N tiles) are 1.45 waves of 132 SMs, and the down
GEMM's 128 units (split-K 4) one wave with short K loops; both stream e4m3 weights at ~3.1 TB/s where XLA's bf16
GEMMs reach 3.8-4.1. The sweep tries finer N tiles and split-K counts that make whole waves, and (v7) the default
tiling with 2 or 4 K groups per pipeline stage. Each row: model, GEMM,
M, config, us_kernel (the GEMM kernel's device time per call, median of 4 weight copies in one trace), the e4m3
weight TB/s, and whether it is the default. Also the two quantisers alone at each M, and (v10) where the opt-in
two-kernel tail split applies (`fp8_matmul.tail_split_plan`: Dream's gate/up at M <= 64) a `kind: tail_split` row
with the device span per call of both forms.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repository on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernel_trace import kernel_breakdown  # noqa: E402
from pallas_kernels import fp8_matmul as F  # noqa: E402
from pallas_kernels import fp8_quantize as Q  # noqa: E402

C, D = F.Fp8MatmulConfig, F.Dim
INTERPRET = jax.default_backend() != "gpu"  # the CPU smoke test: Mosaic GPU simulator, interpreted Triton


def gemms(model: str) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of the FFN's two FP8 GEMMs (gate/up fused)."""
    c = common.MODELS[model]
    return {"gate_up": (2 * c.mlp_hidden, c.d_model), "down": (c.d_model, c.mlp_hidden)}


def candidates(m: int, n: int, k: int, sweep: bool = False, grid: bool = True, overlap: bool = not INTERPRET,
               focus: bool = False, pingpong: bool = not INTERPRET) -> list:
    """The default tiling, the same with 1, 2 or 4 K groups per stage, then with and without two-CTA clusters
    (along M and N at M >= 1024, along M at M >= 256), each grouped tiling with the other epilogue width where that
    changes its stage count, the one-slot epilogue where only it fits 3 stages, (M <= 64) every stage that fits and
    the other tile width; sweep=True adds every split-K count of both widths (runs v6a/v6b); grid=False drops the
    split-K x tile-width grid above M = 64 (timed in v6a/v8a, never a winner); overlap: the overlap_steps twins
    (not on the CPU: the simulator cannot run them); pingpong: every candidate's twin with the other
    `Fp8MatmulConfig.pingpong` schedule (v15); focus: only the default and its twins with 1 or 2 K groups per
    stage (and their pingpong twins). Neither twin set on the CPU by default (the smoke test's time; the
    kernel tests run both schedules in the simulator)."""
    kg = k // F.GROUP
    default = F.default_config(m, n, k)
    out = [default]

    def add(cfg):
        if cfg not in out and not n % cfg.cta_tile_n and not kg % cfg.split_k:
            out.append(cfg)

    def with_pingpong_twins(configs):
        for cfg in list(configs) if pingpong else []:
            if not cfg.overlap_steps:
                add(dataclasses.replace(cfg, pingpong=not cfg.pingpong))
        return out

    for g in (1, 2) if focus else (1, 2, 4):  # K groups per stage (wgmmas in flight during promotions; v7)
        grouped = dataclasses.replace(default, groups_per_step=g)
        if not (kg // default.split_k) % g and F.stages_that_fit(grouped, jnp.float32) >= 2:
            add(grouped)
    if focus:
        return with_pingpong_twins(out)
    # two-CTA clusters multicasting the weight (M) or activation (N) tile (v8): compute bound (M >= 1024) both
    # axes; at M = 256 along M (its two 128-row tiles of a weight tile in one cluster: the weights read once)
    if m >= 256:
        for cluster in (None, D.M, D.N) if m >= 1024 else (None, D.M):  # None: the default's own, if clustered
            for g in (default.groups_per_step, 1):
                cfg = dataclasses.replace(default, cluster_dimension=cluster, groups_per_step=g)
                if not n % cfg.cluster_tile_n and not (kg // default.split_k) % g:
                    add(cfg)
    # (v9) two groups per stage leave room for only 2 stages next to a 64-wide bf16 epilogue at M >= 256; a 32-wide
    # epilogue (half its shared memory) makes room for a third: each grouped tiling with the other width too
    for cfg in list(out):
        other = dataclasses.replace(cfg, epi_tile_n=64 if cfg.epi_tile_n == 32 else 32)
        acc = F.model_epilogue_dtype(cfg)
        if cfg.groups_per_step > 1 and F.stages_that_fit(other, acc) != F.stages_that_fit(cfg, acc):
            add(other)
        # one epilogue slot where two 32-wide ones leave the grouped tiling on 2 stages (split-K's fp32 epilogue: the
        # down GEMMs at M = 256; run v10a: -13%, the default since)
        thin = dataclasses.replace(cfg, epi_tile_n=32)
        one_slot = dataclasses.replace(thin, out_slots=1)
        if cfg.groups_per_step > 1 and F.stages_that_fit(thin, acc) < 3 <= F.stages_that_fit(one_slot, acc):
            add(one_slot)
    # where the default is the one-slot tiling, the v9 default beside it (one group, two 64-wide slots)
    if default.out_slots == 1:
        add(dataclasses.replace(default, out_slots=2, epi_tile_n=64, groups_per_step=1))
    # each stage's last K group promoted in the next step, where 3 stages fit (one is lost to the late release);
    # run v10a: 1.02-3.6x slower, ptxas serialises the wgmmas (bench/NOTES.md v10)
    for cfg in list(out) if overlap else []:
        acc = F.model_epilogue_dtype(cfg)
        if cfg.max_concurrent_steps >= 3 and F.stages_that_fit(cfg, acc) >= 3:
            add(dataclasses.replace(cfg, overlap_steps=True))
    if m <= 64:
        narrow, wide = F._narrow_config(m, n, k), F.wide_small_m_config(m, n, k)
        one_group = dataclasses.replace(default, groups_per_step=1)
        if wide is not None and one_group == wide and not (kg // narrow.split_k) % 2:
            add(dataclasses.replace(narrow, groups_per_step=2))  # grouped stages at 2 stages (wide) or 4 (narrow)
        add(dataclasses.replace(one_group, max_concurrent_steps=8))  # every stage that fits (run v6c: no gain)
        add(narrow)
        if wide is not None:
            add(wide)
        tiles = [(dict(wg_dimension=D.N, wg_tile_n=64), (6,)),
                 (dict(wg_dimension=D.N, wg_tile_n=128, epi_tile_n=32), (3, 4))] if sweep else []
        splits = (1, 2, 3, 4, 6, 7, 8, 12)
    elif grid:
        tiles = [(dict(wg_dimension=D.M, wg_tile_n=128), (4,)), (dict(wg_dimension=D.N, wg_tile_n=64), (4,))]
        splits = (1, 2, 4)
    else:
        tiles, splits = [], ()
    for t, steps in tiles:
        for s in steps:
            for split in splits:
                if kg % split or kg // split < 4:
                    continue
                cfg = C(**t, split_k=split, max_concurrent_steps=s)
                if n % cfg.cta_tile_n:
                    continue
                units = -(-m // cfg.cta_tile_m) * (n // cfg.cta_tile_n) * split
                if units > 900 or units < 48:
                    continue
                add(cfg)
    return with_pingpong_twins(out)


def _trace(fn, args_list) -> dict:
    """kernel_breakdown of fn over the args sets (SETS of them), one jitted call each (warmed up first). On the CPU
    (the smoke test) one traced call: the simulator takes seconds a call and the trace has no device times anyway."""
    f = jax.jit(fn)
    for a in args_list:
        jax.block_until_ready(f(*a))
    return kernel_breakdown(lambda: [jax.block_until_ready(f(*a)) for a in args_list], calls=1 if INTERPRET else 2,
                            top=50)


SETS = 1 if INTERPRET else 4  # rotating operand sets per timing (as bench_fp8_matmul.R: one on the CPU)


def operands(n: int, k: int, m: int) -> tuple[list, list]:
    """SETS sets of quantised weights [(wq, ws)] and activations [(xq, xs)]: the rows time calls rotating over
    them."""
    ws_ = [F.quantize_weights((0.02 * jax.random.normal(jax.random.key(20 + j), (n, k), jnp.float32))
                              .astype(jnp.bfloat16)) for j in range(SETS)]
    xs_ = [F.quantize_activations(jax.random.normal(jax.random.key(30 + j), (m, k), jnp.bfloat16))
           for j in range(SETS)]
    return ws_, xs_


def device_us(fn, args_list, name_part: str) -> float | None:
    """Median device time (us) of the kernels whose name contains name_part, one per args set, in one trace."""
    bd = _trace(fn, args_list)
    hits = [t for t in bd.get("top", []) if name_part in t["name"]]
    if not hits:
        return None
    total = sum(t["ms"] for t in hits)
    count = sum(t["count"] for t in hits)
    return 1e3 * total / count if count else None


def gemm_rows(model: str, name: str, n: int, k: int, m: int, sweep: bool = False, grid: bool = True,
              overlap: bool = not INTERPRET, focus: bool = False, pingpong: bool = not INTERPRET) -> list[dict]:
    rows = []
    ws_, xs_ = operands(n, k, m)
    default = F.default_config(m, n, k)
    ref = F.fp8_matmul_reference(*xs_[0], *ws_[0], out_dtype=jnp.float32)
    for cfg in candidates(m, n, k, sweep, grid, overlap, focus, pingpong):
        mp = F.padded_rows(m, cfg)
        args = []
        for (xq, xs), (wq, ws) in zip(xs_, ws_):
            args.append((*F.pad_activations(xq, xs, mp), wq, F.kernel_weight_scales(ws, n, cfg)))
        row = {"model": model, "gemm": name, "kind": "gemm", "M": m, "N": n, "K": k, "is_default": cfg == default,
               "config": cfg.as_dict(),
               "units": -(-m // cfg.cta_tile_m) * (n // cfg.cta_tile_n) * cfg.split_k,  # CTA tiles (2 per cluster unit)
               "stages": F.fit_stages(cfg, F.model_epilogue_dtype(cfg))}
        row["prefetch_stages"] = row["stages"] - int(cfg.overlap_steps)  # overlap_steps holds one stage a step longer
        try:
            fn = lambda a, b, c, d, cfg=cfg: F.fp8_matmul_padded(a, b, c, d, cfg=cfg, interpret=INTERPRET)
            y = jax.jit(fn)(*args[0])
            y = (y.sum(0) if y.ndim == 3 else y.astype(jnp.float32))[:m]
            row["rel_err"] = float(jnp.abs(y - ref).max() / jnp.abs(ref).max())
            us = device_us(fn, args, "fp8_matmul_kernel")
            row["us_kernel"] = us
            row["weight_TBps"] = n * k / (us * 1e-6) / 1e12 if us else None
        except Exception as e:  # noqa: BLE001  (a config that does not compile must not lose the others)
            row["error"] = str(e)[:300]
        rows.append(row)
        print({k_: v for k_, v in row.items() if k_ != "config"}, cfg.wg_dimension.name, cfg.wg_tile_n,
              cfg.split_k, flush=True)
    return rows


def span_us(fn, args_list) -> dict | None:
    """Device time per call of fn with every kernel it launches and the gaps between them: the span of one
    program that calls fn once per args set, back to back, divided by the sets; and its kernels per call and
    busy time (None on the CPU: the simulator has no device time)."""
    if INTERPRET:
        return None
    program = lambda *sets: [fn(*a) for a in sets]
    bd = _trace(program, [tuple(args_list)])
    per = len(args_list)
    return {"us_span": 1e3 * bd.get("span_ms", 0.0) / per, "us_busy": 1e3 * bd.get("busy_ms", 0.0) / per,
            "kernels": bd.get("kernels_per_call", 0) / per}


def tail_split_rows(model: str, name: str, n: int, k: int, m: int) -> list[dict]:
    """(v10, opt-in) The two-kernel tail split where it applies (`fp8_matmul.tail_split_plan`), beside the one-kernel
    default, both as every kernel of a call with the gaps between them (the split's fp32 sum and concatenation
    included): us_span of each, and ratio = default / split."""
    plan = F.tail_split_plan(m, n, k, force=True)
    if plan is None:
        return []
    ws_, xs_ = operands(n, k, m)
    mp = F.padded_rows(m, plan.main)
    args = [(*F.pad_activations(xq, xs, mp), wq, F.kernel_weight_scales(ws, n, plan.main))
            for (xq, xs), (wq, ws) in zip(xs_, ws_)]
    split = lambda a, b, c, d: F.fp8_matmul_tail_split(a, b, c, d, plan=plan, interpret=INTERPRET)
    one = lambda a, b, c, d: F.fp8_matmul_padded(a, b, c, d, cfg=plan.main, interpret=INTERPRET)
    ref = F.fp8_matmul_reference(*xs_[0], *ws_[0], out_dtype=jnp.float32)
    y = jax.jit(split)(*args[0])[:m].astype(jnp.float32)
    row = {"model": model, "gemm": name, "M": m, "N": n, "K": k, "kind": "tail_split", "n_main": plan.n_main,
           "main": plan.main.as_dict(), "tail": plan.tail.as_dict(),
           "rel_err": float(jnp.abs(y - ref).max() / jnp.abs(ref).max()),
           "tail_split": span_us(split, args), "default": span_us(one, args)}
    row["ratio"] = (row["default"]["us_span"] / row["tail_split"]["us_span"]
                    if row["tail_split"] and row["default"] and row["tail_split"]["us_span"] else None)
    print(row, flush=True)
    return [row]


def swiglu_block_candidates(mp: int, f: int) -> list:
    """(v15) QuantizeBlocks for the SwiGLU quantiser at mp padded rows: the default first, then rows per program x
    warps x 128-wide groups per program."""
    out = [Q.QuantizeBlocks.for_swiglu(mp)]
    for bm in (4, 8, 16, 32, 64):
        for warps in (2, 4, 8):
            for groups in (1, 2, 4):
                b = Q.QuantizeBlocks(block_m=bm, num_warps=warps, groups=groups)
                if bm <= mp and not mp % bm and not (f // F.GROUP) % groups and b not in out:
                    out.append(b)
    return out


def _quantizer_inputs(model: str, m: int):
    """(config, padded rows, gate/up split count, SETS gate/up outputs [S, Mp, 2F] / [Mp, 2F]) of the FFN's quantisers
    at M rows, with the padding and split-K count of the model's FFN plan (`dllm_jax.fp8.ffn_plan`)."""
    from dllm_jax import fp8

    cfg = common.MODELS[model]
    d, f = cfg.d_model, cfg.mlp_hidden
    plan = fp8.ffn_plan(m, 2 * f, d)
    mp = F.padded_rows(m, plan.gate_up, plan.down)
    split = plan.gate_up.split_k
    shape = (split, mp, 2 * f) if split > 1 else (mp, 2 * f)
    gus = [(jax.random.normal(jax.random.key(10 + j), shape, jnp.float32 if split > 1 else jnp.bfloat16),)
           for j in range(SETS)]
    return cfg, mp, split, gus


def quantizer_block_rows(model: str, m: int) -> list[dict]:
    """(v15) Device time of the SwiGLU quantiser for every `swiglu_block_candidates` tiling and of the RMSNorm
    quantiser (with the attention residual, as the FFN runs it) for 1-16 warps, at M rows."""
    cfg, mp, split, gus = _quantizer_inputs(model, m)
    d, f = cfg.d_model, cfg.mlp_hidden
    rows = []
    default = Q.QuantizeBlocks.for_swiglu(mp)
    for b in swiglu_block_candidates(mp, f):
        fn = lambda gu, b=b: Q.swiglu_quantize_t(gu, live_rows=m, blocks=b, interpret=INTERPRET)
        row = {"model": model, "kernel": "swiglu_quantize", "M": m, "F": f, "splits": split,
               "blocks": dataclasses.asdict(b), "is_default": b == default}
        row["us_kernel"] = device_us(fn, gus, "swiglu_quantize")
        rows.append(row)
        print(row, flush=True)
    xs_ = [(jax.random.normal(jax.random.key(j), (m, d), jnp.bfloat16), jnp.ones((d,), jnp.bfloat16),
            jax.random.normal(jax.random.key(40 + j), (m, d), jnp.bfloat16)) for j in range(SETS)]
    for warps in (1, 2, 4, 8, 16):
        b = Q.QuantizeBlocks(num_warps=warps)
        fn = lambda x, w, r, b=b: Q.rmsnorm_quantize(x, w, eps=cfg.rms_eps, m_pad=mp, residual=r, blocks=b,
                                                      interpret=INTERPRET)
        row = {"model": model, "kernel": "rmsnorm_quantize", "M": m, "K": d, "blocks": dataclasses.asdict(b),
               "is_default": b == Q.QuantizeBlocks.for_rmsnorm(d, m), "us_kernel": device_us(fn, xs_, "rmsnorm_quantize")}
        rows.append(row)
        print(row, flush=True)
    return rows


def quantizer_rows(model: str, m: int) -> list[dict]:
    cfg, mp, split, gus = _quantizer_inputs(model, m)
    d, f = cfg.d_model, cfg.mlp_hidden
    xs_ = [(jax.random.normal(jax.random.key(j), (m, d), jnp.bfloat16), jnp.ones((d,), jnp.bfloat16))
           for j in range(SETS)]
    norm = lambda x, w: Q.rmsnorm_quantize(x, w, eps=cfg.rms_eps, m_pad=mp, interpret=INTERPRET)
    swiglu = lambda gu: Q.swiglu_quantize_t(gu, interpret=INTERPRET)
    return [{"model": model, "kernel": "rmsnorm_quantize", "M": m, "K": d,
             "us_kernel": device_us(norm, xs_, "rmsnorm_quantize")},
            {"model": model, "kernel": "swiglu_quantize", "M": m, "F": f, "splits": split,
             "us_kernel": device_us(swiglu, gus, "swiglu_quantize")}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llada-8b", "dream-7b"], choices=list(common.MODELS))
    ap.add_argument("--ms", nargs="+", type=int, default=[32, 256])
    ap.add_argument("--sweep", action="store_true", help="every split-K count of both tile widths (slow)")
    ap.add_argument("--no-grid", action="store_true",
                    help="above M = 64, skip the split-K x tile-width grid (runs v6a/v8a: never a winner)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="skip the overlap_steps twins (e.g. when their GPU bit-identity test has not passed)")
    ap.add_argument("--focus", action="store_true",
                    help="only the default tiling, its 1- and 2-group twins and their pingpong twins")
    ap.add_argument("--no-pingpong", action="store_true", help="skip the pingpong twins (v15)")
    ap.add_argument("--gemms", nargs="+", default=["gate_up", "down"], choices=["gate_up", "down"])
    ap.add_argument("--no-quantizers", action="store_true", help="skip the quantiser rows")
    ap.add_argument("--quantizer-blocks", action="store_true",
                    help="(v15) only the quantisers, over their tilings (swiglu_block_candidates, 1-16 warps)")
    ap.add_argument("--out", default=str(common.RESULTS / "fp8_small_m_h200.json"))
    args = ap.parse_args()
    rows: list[dict] = []
    out = Path(args.out)
    meta = common.meta(what="FP8 FFN kernels at block-step M: device time per GEMM tiling and of the quantisers")
    for model in args.models:
        for m in args.ms:
            if args.quantizer_blocks:
                rows += quantizer_block_rows(model, m)
                common.write_results(out.name, meta, rows, out.parent)
                continue
            for r in [] if args.no_quantizers else quantizer_rows(model, m):
                rows.append(r)
                print(r, flush=True)
            for name, (n, k) in gemms(model).items():
                if name not in args.gemms:
                    continue
                overlap = not args.no_overlap and not INTERPRET and not args.focus
                rows += gemm_rows(model, name, n, k, m, args.sweep, not args.no_grid, overlap, args.focus,
                                  not args.no_pingpong and not INTERPRET)
                rows += [] if args.focus else tail_split_rows(model, name, n, k, m)
                common.write_results(out.name, meta, rows, out.parent)
    path = common.write_results(out.name, meta, rows, out.parent)
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
