"""Quality benchmark: held-out exact-match accuracy of a model per task x placement x decoding mode.

    PYTHONPATH=. python bench/quality.py                       # full run (GPU): 1000 problems per cell
    PYTHONPATH=. python bench/quality.py --n 20 --modes none dual
    PYTHONPATH=. python bench/quality.py --modes dual --weights fp8_all --append   # rows "dual@fp8_all"

Writes bench/results/quality.json ({"meta": {...}, "rows": [{"model", "task", "placement", "mode", "accuracy",
"ci95", "n", "weights", ...}]}) and bench/results/quality.png. ci95 is the Wilson 95% interval [lo, hi].
--weights fp8_ffn / fp8_all (`dllm_jax.load(weights=...)`) labels its rows "<mode>@<weights>", so one file holds
both weights side by side (--append keeps the other label's rows).

Modes (the engine's decoding settings; later techniques add entries to MODES):
  none         no cache (LLaDA's reference loop)
  prefix       Fast-dLLM prefix cache (refreshed at block starts)
  dual         Fast-dLLM dual cache
  dual_thr0.9  dual cache + threshold-0.9 parallel decoding
  naive_affix  dual cache whose shared-part K/V are computed from the shared part ALONE (at its absolute
               positions) once and never refreshed: the naive-reuse baseline the affix cache techniques improve on
  anchors_R    ACache: naive_affix's shared K/V, but the share R of affix tokens most attended by the generation
               region (a one-shot probe, one more NFE) is recomputed with the request at every block start
  shallow_D    BiCache: naive_affix's shared K/V in the first D layers only; the deeper layers recompute the shared
               part with the request at every block start
Every mode decodes the same problems (the held-out split of dllm_jax.tasks, seed --seed), temperature 0,
gen_length 8, block_length 4 (2 blocks), steps 8 unless told otherwise. Prompts are chat-templated; the shared
part sits before the request (prefix), between the request's question and its instruction (infix) or after the
request (suffix); the generation region always follows the prompt (see bench/QUALITY.md).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import dllm_jax  # noqa: E402
from dllm_jax.tasks import generators as G  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "dllm_jax" / "assets" / "default_model"  # the trained demo model
MODES: dict[str, dict] = {
    "none": dict(cache="none"),
    "prefix": dict(cache="prefix"),
    "dual": dict(cache="dual"),
    "dual_thr0.9": dict(cache="dual", threshold=0.9),
    "naive_affix": dict(cache="dual", affix="naive"),
    # ACache (caches/acache.py): the shared K/V of naive_affix, with this share of the affix recomputed as anchors
    "anchors_0.1": dict(cache="dual", affix="anchors", anchor_ratio=0.1),
    "anchors_0.2": dict(cache="dual", affix="anchors", anchor_ratio=0.2),
    "anchors_0.5": dict(cache="dual", affix="anchors", anchor_ratio=0.5),
    # BiCache (caches/bicache.py): the shared part's K/V reused in the first D of the model's layers (the demo
    # model has 6; no published depth table for it)
    "shallow_1": dict(cache="dual", affix="shallow", shallow_depth=1),
    "shallow_3": dict(cache="dual", affix="shallow", shallow_depth=3),
}


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo, hi = max(0.0, c - h), min(1.0, c + h)
    return (0.0 if k == 0 else lo, 1.0 if k == n else hi)


def build_cells(model, tasks, placements, n: int, seed: int):
    """[(task, placement, [Rendered])]: the same held-out problems for every placement of a task."""
    vocab = model.tokenizer.hf.get_vocab()
    cells = []
    for task in tasks:
        probs = G.generate(task, "heldout", n, seed=seed)
        for pl in placements:
            cells.append((task, pl, [G.render(p, pl, vocab) for p in probs]))
    return cells


def run_mode(model, cells, mode: str, gen_kwargs: dict, batch: int, progress: bool):
    """Decode every row of every cell with one mode; returns per-cell correct counts and stats."""
    from dllm_jax.decoding import GenerationConfig, answer_tokens, generate

    gc = GenerationConfig.from_options(**{**gen_kwargs, **MODES[mode]})
    rows = [(ci, r) for ci, (_, _, rs) in enumerate(cells) for r in rs]
    n_chunks = math.ceil(len(rows) / batch)
    bs = math.ceil(len(rows) / n_chunks)  # equal chunk sizes (last one padded): one compiled shape
    correct = np.zeros(len(cells), np.int64)
    nfe, seconds, t0 = [], 0.0, time.time()
    it = range(n_chunks)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc=f"{mode:12s}", unit="batch", leave=True, file=sys.stdout)
    for c in it:
        chunk = rows[c * bs : (c + 1) * bs]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (bs - real)
        out = generate(model, [r.prompt for _, r in chunk], gc, seed=0, affix_spans=[r.affix_span for _, r in chunk])
        answers = answer_tokens(out.tokens, model.config, gc)
        for (ci, r), a in zip(chunk[:real], answers[:real]):
            correct[ci] += int(a == r.answer)
        nfe.append(out.nfe)
        seconds += out.seconds
    return correct, {
        "nfe_per_batch_mean": float(np.mean(nfe)),
        "device_seconds": round(seconds, 3),
        "wall_seconds": round(time.time() - t0, 2),
        "batch": bs,
        "generation_options": {**gen_kwargs, **MODES[mode]},
    }


def plot(rows, modes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted(
        {(r["task"], r["placement"]) for r in rows}, key=lambda c: (G.TASKS.index(c[0]), G.PLACEMENTS.index(c[1]))
    )
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(cells)), 4.5))
    w = 0.8 / max(1, len(modes))
    for mi, mode in enumerate(modes):
        acc, lo, hi = [], [], []
        for c in cells:
            r = next((r for r in rows if (r["task"], r["placement"]) == c and r["mode"] == mode), None)
            a = r["accuracy"] if r else float("nan")
            acc.append(a)
            lo.append(a - r["ci95"][0] if r else 0)
            hi.append(r["ci95"][1] - a if r else 0)
        xs = np.arange(len(cells)) + (mi - (len(modes) - 1) / 2) * w
        ax.bar(xs, acc, w, yerr=[lo, hi], capsize=2, label=mode)
    ax.set_xticks(np.arange(len(cells)))
    ax.set_xticklabels([f"{t}\n{p}" for t, p in cells])
    ax.set_ylabel("exact match (95% Wilson CI)")
    ax.set_ylim(0, 1.05)
    ax.axhline(0.95, color="gray", lw=0.8, ls="--")
    n = rows[0]["n"] if rows else 0
    ax.set_title(f"held-out accuracy per task / placement of the shared part / decoding mode (n={n} per cell)")
    ax.legend(fontsize=8, ncol=len(modes), loc="lower center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(
    model_path=None,
    n: int = 1000,
    modes=None,
    tasks=None,
    placements=None,
    seed: int = 1234,
    batch: int = 1024,
    gen_length: int = 8,
    block_length: int = 4,
    steps: int = 8,
    bucket: int = 160,
    out: Path | None = None,
    plot_path: Path | None = None,
    progress: bool = True,
    dtype: str = "bfloat16",
    append: bool = False,
    weights: str = "bf16",
    fp8_first_layer: bool = False,
):
    """append: keep the rows of other modes already in `out` (same n, seed and dtype), replacing this run's."""
    modes = list(modes or MODES)
    tasks = list(tasks or G.TASKS)
    placements = list(placements or G.PLACEMENTS)
    model_path = Path(model_path or DEFAULT_MODEL)
    model = dllm_jax.load(model_path, dtype=dtype, weights=weights, fp8_first_layer=fp8_first_layer)
    weights += "+layer1" if fp8_first_layer else ""  # the label: layer 1 in FP8 too
    label = {m: m if weights == "bf16" else f"{m}@{weights}" for m in modes}
    if model.tokenizer is None:
        raise SystemExit(f"{model_path} has no tokenizer files: the benchmark needs the task tokenizer")
    gen_kwargs = dict(
        gen_length=gen_length, block_length=block_length, steps=steps, temperature=0.0, prompt_bucket=bucket
    )
    cells = build_cells(model, tasks, placements, n, seed)
    rows, mode_stats, kept, kept_stats, kept_modes = [], {}, [], {}, {}
    if append and out is not None and Path(out).exists():
        old = json.loads(Path(out).read_text())
        om = old["meta"]
        if (om.get("n_per_cell"), om.get("seed"), om.get("dtype")) != (n, seed, dtype):
            raise SystemExit(
                f"--append: {out} has n={om.get('n_per_cell')} seed={om.get('seed')} "
                f"dtype={om.get('dtype')}, this run n={n} seed={seed} dtype={dtype}"
            )
        labels = set(label.values())
        kept = [r for r in old["rows"] if r["mode"] not in labels]
        kept_stats = {m: st for m, st in om.get("mode_stats", {}).items() if m not in labels}
        kept_modes = {m: c for m, c in om.get("modes", {}).items() if m not in labels}
    for mode in modes:
        correct, stats = run_mode(model, cells, mode, gen_kwargs, batch, progress)
        mode_stats[label[mode]] = {**stats, "weights": weights, "device": str(jax.devices()[0].device_kind)}
        for (task, pl, rs), k in zip(cells, correct):
            lo, hi = wilson(int(k), len(rs))
            rows.append(
                {
                    "model": model_path.name,
                    "task": task,
                    "placement": pl,
                    "mode": label[mode],
                    "weights": weights,
                    "accuracy": round(int(k) / len(rs), 4),
                    "ci95": [round(lo, 4), round(hi, 4)],
                    "n": len(rs),
                    "correct": int(k),
                }
            )
        if out is not None:  # partial results after every mode (a killed run keeps what it finished)
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(
                json.dumps(
                    {
                        "meta": {
                            "partial": True,
                            "mode_stats": {**kept_stats, **mode_stats},
                            "n_per_cell": n,
                            "seed": seed,
                            "dtype": dtype,
                            "modes": kept_modes,
                        },
                        "rows": kept + rows,
                    }
                )
            )
    rows, mode_stats = kept + rows, {**kept_stats, **mode_stats}
    modes = list(dict.fromkeys([r["mode"] for r in kept] + [label[m] for m in modes]))
    # the naive-reuse gap: accuracy(dual) - accuracy(naive_affix) per cell
    gaps = {}
    if "dual" in modes and "naive_affix" in modes:
        for task, pl, _ in cells:
            a = {r["mode"]: r["accuracy"] for r in rows if r["task"] == task and r["placement"] == pl}
            gaps[f"{task}/{pl}"] = round(a["dual"] - a["naive_affix"], 4)
    meta = {
        "model": str(model_path.relative_to(REPO) if model_path.is_relative_to(REPO) else model_path),
        "n_per_cell": n,
        "seed": seed,
        "split": "heldout",
        "modes": {**kept_modes, **{label[m]: {**MODES[m], "weights": weights} for m in label}},
        "generation": gen_kwargs,
        "dtype": dtype,
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mode_stats": mode_stats,
        "naive_reuse_gap_dual_minus_naive": gaps,
        "placements": {
            "prefix": "[shared][request][gen]",
            "infix": "[request question][shared][request instruction][gen]",
            "suffix": "[request][shared][gen]",
        },
    }
    result = {"meta": meta, "rows": rows}
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    if plot_path is not None:
        plot(rows, modes, Path(plot_path))
    return result


def print_table(result) -> None:
    rows = result["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    width = {m: max(14, len(m) + 2) for m in modes}
    print(f"{'task/placement':18s}" + "".join(f"{m:>{width[m]}s}" for m in modes))
    for task, pl in dict.fromkeys((r["task"], r["placement"]) for r in rows):
        acc = {r["mode"]: r for r in rows if r["task"] == task and r["placement"] == pl}
        print(f"{task + '/' + pl:18s}" + "".join(f"{acc[m]['accuracy']:{width[m]}.3f}" for m in modes))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--n", type=int, default=1000, help="held-out problems per task x placement cell")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--tasks", nargs="+", default=list(G.TASKS), choices=list(G.TASKS))
    ap.add_argument("--placements", nargs="+", default=list(G.PLACEMENTS), choices=list(G.PLACEMENTS))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--batch", type=int, default=1024, help="rows per generate call")
    ap.add_argument("--gen-length", type=int, default=8)
    ap.add_argument("--block-length", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bucket", type=int, default=160, help="prompt_bucket (one compiled shape per mode)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8_ffn", "fp8_all"], help="dllm_jax.load's")
    ap.add_argument(
        "--fp8-first-layer", action="store_true", help="layer 1 in FP8 too (rows '<mode>@<weights>+layer1')"
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "quality.json"))
    ap.add_argument("--plot", default=str(REPO / "bench" / "results" / "quality.png"))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the other modes' rows already in --out (same n, seed, dtype); replace this run's",
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    result = run(
        args.model,
        args.n,
        args.modes,
        args.tasks,
        args.placements,
        args.seed,
        args.batch,
        args.gen_length,
        args.block_length,
        args.steps,
        args.bucket,
        Path(args.out),
        Path(args.plot),
        progress=not args.no_progress,
        dtype=args.dtype,
        append=args.append,
        weights=args.weights,
        fp8_first_layer=args.fp8_first_layer,
    )
    print_table(result)
    if result["meta"]["naive_reuse_gap_dual_minus_naive"]:
        print("naive-reuse gap (dual - naive_affix):", result["meta"]["naive_reuse_gap_dual_minus_naive"])
    print(f"wrote {args.out} and {args.plot} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
