"""BiCache's offline profile (arXiv 2606.07571): a depth table for a model without a published one.

For held-out problems of the task generators (every task and placement) at several generation lengths (so that the
affix's share r of the sequence varies), compare per layer the affix's K and V computed alone with those computed
in the full prompt + [MASK] generation region (`bicache.kv_similarity`), bucket by r, and keep the depth b(r) =
number of leading layers above the threshold (`bicache.depth_table_from_profile`). Forwards only: runs on the CPU.

    PYTHONPATH=. python bench/profile_bicache.py [--model DIR] [--n 32] [--gen-lengths 8 32 96 256]   (CPU is fine)

Writes bench/results/bicache_profile.json (the paper's table and the strict one, which also asks the depth layer
itself to pass, `depth_table_from_profile(strict=True)`; Shallow(table=...) takes either's items;
and the mean similarity per layer per ratio bucket) and a plot of those curves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402

# package imports (re-point here when the package moves)
import dllm_jax  # noqa: E402  load
from dllm_jax.decoding.caches import bicache  # noqa: E402
from dllm_jax.decoding.config import GenerationConfig  # noqa: E402
from dllm_jax.decoding.generate import layout  # noqa: E402
from dllm_jax.tasks import generators as G  # noqa: E402


def profile(model, n: int, gen_lengths, threshold: float, seed: int = 7):
    vocab = model.tokenizer.hf.get_vocab()
    sim_fn = jax.jit(bicache.kv_similarity, static_argnames=("config",))
    ratios, sims = [], []
    for gen in gen_lengths:
        gc = GenerationConfig.from_options(gen_length=gen, block_length=gen, steps=gen, prompt_bucket=1)
        for task in G.TASKS:
            for pl in G.PLACEMENTS:
                rows = [G.render(p, pl, vocab) for p in G.generate(task, "heldout", n, seed=seed)]
                prompts = [r.prompt for r in rows]
                x, pos, km, frozen, p = layout(prompts, model.config, gc, [r.affix_span for r in rows])
                s = sim_fn(
                    model.params, model.config, jnp.asarray(x), jnp.asarray(pos), jnp.asarray(km), jnp.asarray(frozen)
                )
                sims.append(np.asarray(s))
                ratios += [
                    round(100 * (e - a) / (len(r.prompt) + gen))
                    for r, (a, e) in zip(rows, (r.affix_span for r in rows))
                ]
    sims = np.concatenate(sims)
    return np.asarray(ratios), sims, bicache.depth_table_from_profile(ratios, sims, threshold)


def strict_table(ratios, sims, threshold):
    return bicache.depth_table_from_profile(ratios, sims, threshold, strict=True)


def plot(ratios, sims, table, threshold, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    buckets = sorted(set(ratios.tolist()))
    cmap = plt.get_cmap("viridis")
    for i, r in enumerate(buckets):
        ax.plot(
            range(sims.shape[1]),
            sims[ratios == r].mean(0),
            color=cmap(i / max(1, len(buckets) - 1)),
            label=f"r={r}" if i in (0, len(buckets) - 1) or r in table else None,
        )
    ax.axhline(threshold, color="gray", ls="--", lw=1, label=f"threshold {threshold}")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean cos(alone, in context) of K and V")
    ax.set_title(f"affix K/V similarity per layer (depth table {table})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a converted or HF directory (default: the bundled model)")
    ap.add_argument("--n", type=int, default=32, help="problems per task x placement x generation length")
    ap.add_argument("--gen-lengths", nargs="+", type=int, default=[8, 32, 96, 256])
    ap.add_argument("--threshold", type=float, default=0.97)
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=str(common.RESULTS / "bicache_profile.json"))
    args = ap.parse_args(argv)
    t0 = time.time()
    model = dllm_jax.load(args.model, dtype=args.dtype)
    if model.tokenizer is None:
        raise SystemExit("the profile renders the task generators' prompts: the model needs their tokenizer")
    ratios, sims, table = profile(model, args.n, args.gen_lengths, args.threshold)
    buckets = sorted(set(ratios.tolist()))
    result = {
        "meta": common.meta(
            model=args.model or "bundled default",
            n_per_cell=args.n,
            dtype=args.dtype,
            gen_lengths=args.gen_lengths,
            threshold=args.threshold,
            rows=int(len(ratios)),
        ),
        "table": {str(k): v for k, v in table.items()},
        "table_strict": {str(k): v for k, v in strict_table(ratios, sims, args.threshold).items()},
        "mean_similarity_per_layer": {str(r): np.round(sims[ratios == r].mean(0), 5).tolist() for r in buckets},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(ratios, sims, table, args.threshold, out.with_suffix(".png"))
    print(f"depth table {table} from {len(ratios)} rows in {time.time() - t0:.0f}s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
