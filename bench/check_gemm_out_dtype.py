"""Does a bf16 GEMM that emits bf16 itself equal fp32-out-then-round? (the `layers.Linear` choice, v4)

For the block-step and block-start GEMM shapes of LLaDA-8B / Dream-7B, compares on this device
`dot(x, w, preferred_element_type=bf16)` with `dot(x, w, preferred_element_type=f32).astype(bf16)` bit for bit,
and times both. Writes bench/results/gemm_out_dtype_h200.json. `python bench/check_gemm_out_dtype.py [--out DIR]`.
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", nargs="+", type=int, default=[32, 256, 1024, 4096])
    ap.add_argument("--tiny", action="store_true", help="shapes divided by 32 (CPU smoke test)")
    ap.add_argument("--out", default=str(common.RESULTS))
    args = ap.parse_args(argv)
    rows = []
    shapes = {"llada-8b": ((4096, 2 * 12288), (12288, 4096), (4096, 3 * 4096)),
              "dream-7b": ((3584, 2 * 18944), (18944, 3584))}
    for model, kns in shapes.items():
        for k, n in kns:
            if args.tiny:
                k, n = k // 32, n // 32
            w = (0.02 * jax.random.normal(jax.random.key(1), (k, n), jnp.float32)).astype(jnp.bfloat16)
            via_f32 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
            direct = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
            for m in args.ms:
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                a, b = np.asarray(via_f32(x, w), np.float32), np.asarray(direct(x, w), np.float32)
                t_a, _ = common.time_call(lambda: via_f32(x, w).block_until_ready(), reps=20)
                t_b, _ = common.time_call(lambda: direct(x, w).block_until_ready(), reps=20)
                rows.append({"model": model, "M": m, "K": k, "N": n, "bitwise_equal": bool(np.array_equal(a, b)),
                             "max_abs_diff": float(np.max(np.abs(a - b))), "us_f32_then_round": 1e6 * t_a,
                             "us_bf16_out": 1e6 * t_b})
                print(rows[-1], flush=True)
                common.write_results("gemm_out_dtype_h200.json", common.meta(what="bf16-out GEMM vs f32-out+round"),
                                     rows, args.out)


if __name__ == "__main__":
    main()
