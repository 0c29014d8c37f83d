"""Where the FP8 GEMM's time goes inside one K step (issue 5): Mosaic GPU's in-kernel profiler, per warpgroup.

  python bench/profile_fp8_kernel.py --out bench/results/fp8_kernel_profile_h200.json     (H200, ~1 minute)

Why: traced from outside, the kernel at block-step M streams ~37 GB/s per busy SM whatever its tiling or stage
count (bench/NOTES.md v6), i.e. the limit is the per-step chain of a compute warpgroup, not the bytes in flight.
The kernel's body has named ranges (`issue`: the wgmmas of a stage, `wait<j>`: until group j's wgmma is done,
`promote<j>`: the scaled add into the running sum); the time between a step's last range and the next step's
`issue` is the pipeline's own work (waiting for the stage's TMA data, the consumed-barrier arrival). Each row:
the medians per step over all compute warpgroups (the first step of each warpgroup's trace, the pipeline fill,
skipped; a trace holds the first ~60 steps, i.e. the first work unit at these shapes), and the time span of a
warpgroup's trace.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  (puts the repository on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import fp8_matmul as F  # noqa: E402
from sweep_fp8_small_m import gemms  # noqa: E402


def summarise_trace(events: list[dict]) -> dict:
    """Per-step medians (us) of a Mosaic GPU profiler trace (Chrome 'B'/'E' events, ts in us, one tid per
    warpgroup). A step starts at an `issue` range; `pipeline_gap` is from a step's last range end to the next
    step's `issue` start."""
    by_tid: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    ranges: dict[str, list[float]] = defaultdict(list)
    gaps, periods, spans = [], [], []
    for evs in by_tid.values():
        evs.sort(key=lambda e: e["ts"])
        stack, steps = [], []  # steps: [(issue start, last range end)]
        for e in evs:
            if e["ph"] == "B":
                stack.append(e)
                if e["name"] == "issue":
                    steps.append([e["ts"], e["ts"]])
            elif stack:
                b = stack.pop()
                ranges[b["name"]].append(e["ts"] - b["ts"])
                if steps:
                    steps[-1][1] = e["ts"]
        if len(steps) < 2:
            continue
        spans.append(steps[-1][1] - steps[0][0])
        for (s0, e0), (s1, _) in zip(steps[1:-1], steps[2:]):  # the first step (pipeline fill) skipped
            gaps.append(s1 - e0)
            periods.append(s1 - s0)
    med = lambda xs: statistics.median(xs) if xs else None
    return {"steps_seen": len(periods), "warpgroups": len(spans), "step_period_us": med(periods),
            "pipeline_gap_us": med(gaps), "range_us": {k: med(v) for k, v in sorted(ranges.items())},
            "trace_span_us": med(spans)}


def profile_config(m: int, n: int, k: int, cfg: F.Fp8MatmulConfig, out_dir: Path) -> dict:
    wq, ws = F.quantize_weights((0.02 * jax.random.normal(jax.random.key(1), (n, k), jnp.float32)).astype(jnp.bfloat16))
    xq, xs = F.quantize_activations(jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16))
    mp = F.padded_rows(m, cfg)
    args = (*F.pad_activations(xq, xs, mp), wq, F.kernel_weight_scales(ws, n, cfg))
    d = Path(tempfile.mkdtemp(dir=out_dir))
    fn = jax.jit(lambda a, b, c, e: F.fp8_matmul_padded(a, b, c, e, cfg=cfg, profile_dir=str(d)))
    jax.block_until_ready(fn(*args))  # the trace file is written by the first execution only
    (trace,) = d.glob("*.json")
    return summarise_trace(json.loads(trace.read_text())["traceEvents"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llada-8b"], choices=list(common.MODELS))
    ap.add_argument("--ms", nargs="+", type=int, default=[32])
    ap.add_argument("--groups", nargs="+", type=int, default=[1, 2], help="groups_per_step values to profile")
    ap.add_argument("--out", default=str(common.RESULTS / "fp8_kernel_profile_h200.json"))
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit("profile_fp8_kernel: the in-kernel profiler needs a Hopper GPU (no simulator support)")
    out = Path(args.out)
    meta = common.meta(what="FP8 GEMM in-kernel profile: per-K-step ranges of the compute warpgroups")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for m in args.ms:
                for name, (n, k) in gemms(model).items():
                    base = F.default_config(m, n, k)
                    for g in args.groups:
                        cfg = dataclasses.replace(base, groups_per_step=g)
                        row = {"model": model, "gemm": name, "M": m, "N": n, "K": k, "groups_per_step": g,
                               "cta_tile_n": cfg.cta_tile_n, "split_k": cfg.split_k,
                               "stages": F.fit_stages(cfg, F.model_epilogue_dtype(cfg),
                                                      reserve=F.PROFILE_SMEM_BYTES)}
                        try:
                            row.update(profile_config(m, n, k, cfg, Path(tmp)))
                        except Exception as e:  # noqa: BLE001  (one config that does not fit must not lose the rest)
                            row["error"] = str(e)[:300]
                        rows.append(row)
                        print(row, flush=True)
                        common.write_results(out.name, meta, rows, out.parent)
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    main()
