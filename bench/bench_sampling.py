"""GPU benchmark of what a decoding step does after the forward: the [MASK] exclusion, the samplers' candidates
and confidences, and the commit rule, on block-step logits [batch, 32, V] in bf16 (what the vocab head writes).

At LLaDA-8B batch 8 the logits are 65 MB; read once at ~3.5 TB/s that is ~19 us a step. This script times the
engine's path (`decode_loop.model_logits`' exclusion of [MASK] and `dllm_jax.sampling`) against an alternative
formulation (`select_*` below: the exclusion as a select, the confidence without a gathered softmax), checks that
both choose the same tokens and commits, and writes bench/results/sampling_h200.json (device time per call from a
trace, wall median, kernels per call).

    python bench/bench_sampling.py [--cases llada-8b:8 llada-8b:32 dream-7b:8] [--reps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from dllm_jax import sampling  # noqa: E402

BLOCK = 32


# ----------------------------------------------------------------- the alternative formulation (a dead end, s16)
# Written on the guess that XLA copies the logits to fp32 for the scatter and materialises the probabilities to
# gather from them; it does neither, and this formulation's reductions ran slower (bench/NOTES.md v16).
def select_exclude_token(logits, token_id):
    """The exclusion as a select on the vocabulary index instead of a scatter."""
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(vocab == token_id, -jnp.inf, logits)


def select_prob_of(logits, index):
    """softmax(logits)[..., index] as exp(l[index] - max) / sum(exp(l - max)): no [..., V] gather operand."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    total = jnp.sum(jnp.exp(logits - top), axis=-1)
    picked = jnp.take_along_axis(logits, index[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.exp(picked - top[..., 0]) / total


def select_llada_candidates(logits, masked, key, temperature, remasking):
    assert temperature == 0 and remasking == "low_confidence"  # the benchmarked setting only
    x0 = jnp.argmax(logits, axis=-1)
    return x0.astype(jnp.int32), jnp.where(masked, select_prob_of(logits, x0), -jnp.inf)


def select_dream_candidates(logits, masked, key, temperature, top_p, top_k, alg):
    assert temperature == 0 and top_p is None and top_k is None and alg == "maskgit_plus"
    x0 = jnp.argmax(jax.nn.softmax(logits, axis=-1), axis=-1)
    return x0.astype(jnp.int32), jnp.where(masked, select_prob_of(logits, x0), -jnp.inf)


# ------------------------------------------------------------------------------------------------- the step
def post_forward(family: str, mask_id: int, formulation: str, alg: str = "maskgit_plus"):
    """jitted (logits [B, n, V] bf16, masked [B, n], k [B]) -> (x0, conf, commit): decode_loop's work after the
    forward of one step at temperature 0 (the benchmarks' and the papers' setting), commit_top_k as its rule."""
    engine = formulation == "engine"
    llada = sampling.llada_candidates if engine else select_llada_candidates
    dream = sampling.dream_candidates if engine else select_dream_candidates

    @jax.jit
    def run(logits, masked, k, key):
        logits = logits.astype(jnp.float32)  # as decode_loop.model_logits
        logits = (sampling.exclude_token if engine else select_exclude_token)(logits, mask_id)
        if family == "llada":
            x0, conf = llada(logits, masked, key, 0.0, "low_confidence")
        else:
            x0, conf = dream(logits, masked, key, 0.0, None, None, alg)
        return x0, conf, sampling.commit_top_k(conf, masked, k)

    return run


def bench_case(model: str, batch: int, reps: int, rng: np.random.Generator) -> dict:
    cfg = common.MODELS[model]
    v = cfg.vocab_size
    # logits of a trained model's scale (std ~3); the argmax is then unique almost surely
    logits = jnp.asarray(rng.standard_normal((batch, BLOCK, v), np.float32) * 3.0, jnp.bfloat16)
    masked = jnp.asarray(rng.random((batch, BLOCK)) < 0.6)
    k = jnp.full((batch,), 4, jnp.int32)
    key = jax.random.key(0)
    row = {"model": model, "batch": batch, "block": BLOCK, "vocab": v, "logits_mb": logits.nbytes / 1e6}
    outs = {}
    for formulation in ("engine", "select"):
        fn = post_forward(cfg.family, cfg.mask_token_id, formulation)
        out = fn(logits, masked, k, key)

        def call():
            jax.block_until_ready(fn(logits, masked, k, key))

        med, _ = common.time_call(call, reps=reps, warmup=2)
        row[f"us_{formulation}"] = 1e6 * med
        if jax.default_backend() == "gpu":
            from kernel_trace import kernel_breakdown

            bd = kernel_breakdown(call, calls=5)
            row[f"device_us_{formulation}"] = 1e3 * bd["busy_ms"]
            row[f"kernels_{formulation}"] = bd["kernels_per_call"]
            row[f"top_{formulation}"] = bd["top"][:6]
        outs[formulation] = jax.tree.map(np.asarray, out)
    # the alternative must choose the same tokens and commits as the engine
    row["same_tokens"] = bool(np.array_equal(outs["engine"][0], outs["select"][0]))
    row["same_commits"] = bool(np.array_equal(outs["engine"][2], outs["select"][2]))
    fin = np.isfinite(outs["engine"][1])
    row["conf_max_abs_diff"] = float(np.max(np.abs(outs["engine"][1][fin] - outs["select"][1][fin]), initial=0.0))
    row["select_speedup"] = row["us_engine"] / row["us_select"]  # > 1: the alternative is faster
    if "device_us_engine" in row and row["device_us_select"] > 0:
        row["select_device_speedup"] = row["device_us_engine"] / row["device_us_select"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["llada-8b:1", "llada-8b:8", "llada-8b:32", "dream-7b:8",
                                                   "dream-7b:32"],
                    help="model:batch pairs (models of bench/common.py; 'tiny' for a CPU smoke test)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args()
    cases = []
    for c in args.cases:
        name, _, b = c.partition(":")
        if name not in common.MODELS or not b.isdigit():
            raise SystemExit(f"--cases: expected model:batch with a model of {sorted(common.MODELS)}, got {c!r}")
        cases.append((name, int(b)))
    rng = np.random.default_rng(0)
    rows = []
    for i, (name, batch) in enumerate(cases):
        row = bench_case(name, batch, args.reps, rng)
        rows.append(row)
        dev = (f", device {row['device_us_engine']:.1f} vs {row['device_us_select']:.1f} us "
               f"({row['kernels_engine']:.0f} vs {row['kernels_select']:.0f} kernels)"
               if "device_us_engine" in row else "")
        print(f"[{i + 1}/{len(cases)}] {name} b{batch}: engine {row['us_engine']:.1f} vs select "
              f"{row['us_select']:.1f} us{dev}; same tokens {row['same_tokens']}", flush=True)
        common.write_results("sampling_h200.json", common.meta(block=BLOCK, reps=args.reps), rows, args.out)
    print(f"wrote {Path(args.out) / 'sampling_h200.json'}")


if __name__ == "__main__":
    main()
