"""CPU probe of the lookup task's key match (issue 6): a small model trained on lookup rows alone, one difficulty.

The bundled model answers lookups with digits of the right shape but from the wrong fact (bench/QUALITY.md): it
never learned to match the asked key with the document's key. This trains the LLaDA objective (train_demo's
`make_step`, fp32 compute) on lookup problems of one curriculum level only and logs the held-out one-shot exact
match (the whole answer masked, one forward, argmax) along the way, to find out whether and when the match forms.

    PYTHONPATH=. python bench/probe_lookup.py --steps 4000                        # 2 facts, ~15 min on 2 cores
    PYTHONPATH=. python bench/probe_lookup.py --eps 1 --full-frac 0 --steps 6000  # the whole answer always masked
    PYTHONPATH=. python bench/probe_lookup.py --levels 4 --level 1 --cut 96       # 3-5 facts

Writes the curve as JSON (--out) after every log line: {"meta": {settings}, "rows": [{"step", "seconds", "loss",
"answer_ce", "one_shot"}]}. Picking one of the two facts at random gives one-shot 0.5 at 2 facts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (puts the repository root on sys.path)
import train_demo as T  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from dllm_jax.modeling import init_params  # noqa: E402
from dllm_jax.tasks import generators as G  # noqa: E402
from dllm_jax.tasks import vocab as V  # noqa: E402


def lookup_rows(levels: int, level: int, cut: int, n: int, seed: int, workers: int):
    """Training rows (tokens [n, cut], length, answer start) of lookup problems at one curriculum level."""
    toks, length, start = T.build_pool(n, seed, workers, levels=levels, tasks=("lookup",))
    lo = level * n  # rows are [level][problem]
    toks, length, start = toks[lo:lo + n], length[lo:lo + n], start[lo:lo + n]
    if length.max() > cut:
        raise SystemExit(f"--cut {cut} is shorter than the longest row ({length.max()} tokens) at this level")
    return toks[:, :cut], length, start


def heldout_rows(levels: int, level: int, cut: int, n: int = 256):
    v = V.vocab()
    difficulty = 1.0 if levels == 1 else float(np.linspace(0.0, 1.0, levels)[level])
    probs = G.generate("lookup", "heldout", n, seed=7, difficulty=difficulty)
    toks = np.full((n, cut), v[V.EOS], np.int32)
    length, start = np.zeros(n, np.int32), np.zeros(n, np.int32)
    for i, p in enumerate(probs):
        r = G.render(p, G.PLACEMENTS[i % 3], v)
        row = r.prompt + r.answer + [v[V.EOS]] * (T.GEN_LENGTH - len(r.answer))
        toks[i, :len(row)], length[i], start[i] = row, len(row), len(r.prompt)
    return jnp.asarray(toks), jnp.asarray(length), jnp.asarray(start)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--full-frac", type=float, default=0.25, help="rows masked over the whole sequence "
                    "(train_demo's default)")
    ap.add_argument("--eps", type=float, default=0.05, help="lowest mask ratio (train_demo's default; 1: the whole "
                    "answer always masked)")
    ap.add_argument("--levels", type=int, default=2, help="curriculum levels of the pool (train_demo's --levels)")
    ap.add_argument("--level", type=int, default=0, help="the level trained on (0: 2 facts)")
    ap.add_argument("--cut", type=int, default=64, help="row length (tokens) kept")
    ap.add_argument("--pool", type=int, default=20000, help="training problems per task and level")
    ap.add_argument("--log-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON curve (default: print only)")
    args = ap.parse_args(argv)
    if not 0 <= args.level < args.levels:
        raise SystemExit(f"--level must be in [0, {args.levels})")

    rows_np = lookup_rows(args.levels, args.level, args.cut, args.pool, args.seed, 1)
    pool = tuple(jnp.asarray(a) for a in rows_np)
    held = heldout_rows(args.levels, args.level, args.cut)
    config = T.model_config(False, d_model=args.d_model, n_layers=args.layers)
    params = init_params(config, jax.random.key(args.seed))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.98, eps=1e-8))
    opt_state = tx.init(params)
    step = T.make_step(config, args.batch, args.full_frac, args.eps, tx, compute_dtype="float32")
    one_shot = T.make_quick_eval(config, compute_dtype="float32")
    meta = {**vars(args), "n_params": int(sum(x.size for x in jax.tree.leaves(params))),
            "backend": jax.default_backend()}
    curve = []
    key = jax.random.key(args.seed + 1)
    t0 = time.time()
    for s in range(args.steps):
        lr = jnp.float32(T.lr_at(s, args.steps, args.lr, args.warmup))
        params, opt_state, loss, ans_ce, _ = step(params, opt_state, pool, jax.random.fold_in(key, s), lr,
                                                  jnp.int32(0))
        if (s + 1) % args.log_every == 0 or s + 1 == args.steps:
            row = {"step": s + 1, "seconds": round(time.time() - t0, 1), "loss": float(loss),
                   "answer_ce": float(ans_ce), "one_shot": float(one_shot(params, *held))}
            curve.append(row)
            print(row, flush=True)
            if args.out:
                common.write_results(Path(args.out).name, meta, curve, Path(args.out).parent)


if __name__ == "__main__":
    main()
