"""The engine's pool kernel against the XLA it replaces, at its shapes (issue 39's block-call gaps).

(Run s30 also timed `write`, a Pallas kernel writing a chunk's K and V in place, against XLA's two scatters: it
lost in device time in every row, XLA taking 0.61-0.75x the kernel's time, and was removed; its rows stay in the JSON.)
- `key_weights`: ACache's probe scores of one layer, as the engine's probe program runs them on its pool
  (`PagedKV`): `PagedKV.key_weights` (`pallas_kernels.slot_key_weights`: each row's real shared list through its
  table, from slot_attention's log-sum-exp) against `acache.row_importance_probe` (the XLA path: the gathered keys,
  fp32 scores of each row's [MASK] span at the table's full width). 4 probed rows, a 4096-wide window whose 128
  [MASK] queries sit at 193..320, a 1024-token affix in a 4096-wide table.
LLaDA-8B (32 query / 32 KV heads) and Dream-7B (28 / 4) heads, head_dim 128, bf16 pools of 32768 slots. Each
timed call chains --n layers' worth in one jitted loop (the pools donated, so writes are in place), median of --reps
calls after a warm-up: `us` is a layer's share; on a GPU `device_us` is the kernels' busy time alone (profiler).
Writes bench/results/pool_kernels_<h200|platform>.json (rows merged by --run); on the CPU tiny interpreted shapes.

    PYTHONPATH=. python bench/bench_pool_kernels.py --run NAME
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common, trace  # noqa: E402

from dllm_jax.decoding.caches.acache import row_importance_probe  # noqa: E402
from dllm_jax.engine.kv_pool import PagedKV  # noqa: E402
from dllm_jax.transformer import Kernels  # noqa: E402

MODELS = {"llada-8b": (32, 32), "dream-7b": (28, 4)}  # query heads, KV heads


def weights_loop(impl: str, n: int, interpret: bool):
    """n probe scorings of one layer, each query a little different, summed (nothing hoisted or dropped)."""
    kernels = Kernels(attention="pallas" if impl == "pallas" else "xla", interpret=interpret)

    @jax.jit
    def run(q, kp, table, mask, lens):
        b, w = table.shape
        zeros = jnp.zeros((b,), jnp.int32)
        kv = PagedKV((kp,), (kp,), jnp.zeros((b, 1), jnp.int32), table, lens, zeros, table, zeros, 1e4, False)

        def body(i, acc):
            qi = q * (1 + i.astype(q.dtype) / 64)
            if impl == "pallas":
                return acc + kv.key_weights(0, qi, mask, kernels)
            return acc + row_importance_probe(kv.shared_mask(), mask)(qi, kv, 0)

        return jax.lax.fori_loop(0, n, body, jnp.zeros((b, w), jnp.float32))

    return run


def timed(fn, args: tuple, n: int, reps: int, gpu: bool, carry: int = 0) -> dict:
    """us a layer (wall median) and, on a GPU, the kernels' busy us a layer. carry: how many leading arguments the
    call donates and returns (the next call passes them back)."""
    box = {"args": args}

    def call():
        out = jax.block_until_ready(fn(*box["args"]))
        if carry:
            box["args"] = (*out, *box["args"][carry:])

    median, _ = common.time_call(call, reps=reps)
    device = trace.kernel_breakdown(call, calls=1)["busy_ms"] * 1e3 / n if gpu else None
    return dict(us=median * 1e6 / n, device_us=device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=32, help="layers a timed call chains")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    common.output_args(ap)
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    gpu, smoke = dev.platform == "gpu", common.smoke_on_cpu()
    slots_n, dim, (window, span, affix) = 32768, 128, (4096, (193, 321), 1024)
    if smoke:  # tiny shapes, interpreted
        args.n, args.reps, slots_n, dim, (window, span, affix) = 2, 1, 256, 16, (64, (9, 20), 40)
    name = f"pool_kernels_{'h200' if 'H200' in dev.device_kind else dev.platform}.json"
    meta = common.meta(n=args.n, pool_slots=slots_n, head_dim=dim)
    rng, rows = np.random.default_rng(0), []
    for model in args.models:
        hq, hkv = MODELS[model]
        if smoke:
            hq, hkv = hq // hkv * 2, 2  # the model's grouping, two KV heads
        b = 4
        q = jnp.asarray(rng.normal(size=(b, window, hq, dim)), jnp.bfloat16)
        kp = jnp.asarray(rng.normal(size=(slots_n, hkv, dim)), jnp.bfloat16)
        table = jnp.asarray(np.stack([rng.permutation(slots_n)[:window] for _ in range(b)]).astype(np.int32))
        mask = jnp.asarray(np.broadcast_to((np.arange(window) >= span[0]) & (np.arange(window) < span[1]), (b, window)))
        lens = jnp.full((b,), affix, jnp.int32)
        row = dict(kernel="key_weights", model=model, rows=b, window=window, queries=span[1] - span[0], affix=affix)
        outs = {}
        for impl in ("xla", "pallas"):
            fn = weights_loop(impl, args.n, interpret=not gpu)
            for key, value in timed(fn, (q, kp, table, mask, lens), args.n, args.reps, gpu).items():
                row[f"{impl}_{key}"] = value
            outs[impl] = np.asarray(fn(q, kp, table, mask, lens), np.float32)
        ref = outs["xla"]
        row["rel_err"] = float(np.linalg.norm(outs["pallas"] - ref) / np.linalg.norm(ref))
        row["speedup"] = row["xla_us"] / row["pallas_us"]
        rows.append(row)
        print(f"{model} key weights: xla {row['xla_us']:8.1f} us, pallas {row['pallas_us']:8.1f} us a layer")
        common.write_results(name, meta, rows, args.out, args.run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
