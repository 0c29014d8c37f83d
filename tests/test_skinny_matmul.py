"""The weight-streaming Pallas GEMM against its pure-jnp reference (interpreted on the CPU, compiled on a GPU).

In interpret mode Pallas fills outputs with NaN before the kernel runs, so the finiteness check also proves every
output element is written.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import skinny_matmul as sm

INTERPRET = jax.default_backend() != "gpu"

# (M, K, N, block sizes or None = defaults): ragged M (1, 5, 100 -> padded), split-K, M blocks, single K step
CASES = [
    (1, 256, 128, None),
    (5, 512, 256, sm.BlockSizes(block_n=64, block_k=64, split_k=2)),
    (32, 384, 64, sm.BlockSizes(block_n=32, block_k=128, split_k=3)),
    (100, 128, 64, sm.BlockSizes(block_n=32, block_k=32, block_m=32)),
    (64, 64, 512, sm.BlockSizes(block_n=128, block_k=64)),
]


def _data(m, k, n, seed, layers=None, dtype=jnp.float32):
    kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
    lead = () if layers is None else (layers,)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, lead + (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    b = jax.random.normal(kb, lead + (n,), jnp.float32).astype(dtype)
    return x, w, b


@pytest.mark.parametrize("m,k,n,bs", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(m, k, n, bs, with_bias):
    x, w, b = _data(m, k, n, seed=m + k + n)
    b = b if with_bias else None
    y = sm.skinny_matmul(x, w, b, block_sizes=bs, interpret=INTERPRET)
    ref = sm.skinny_matmul_reference(x, w, b)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert np.all(np.isfinite(np.asarray(y)))
    tol = 1e-5 if INTERPRET else 2e-2  # GPU: fp32 inputs go through TF32 dots
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=tol, atol=tol)


@pytest.mark.parametrize("m,k,n,bs", CASES[1:3])
def test_stacked_layers_select_the_right_layer(m, k, n, bs):
    x, w, b = _data(m, k, n, seed=7, layers=3)
    for layer in (0, 2):
        y = sm.skinny_matmul(x, w, b, jnp.int32(layer), block_sizes=bs, interpret=INTERPRET)
        ref = sm.skinny_matmul_reference(x, w[layer], b[layer])
        tol = 1e-5 if INTERPRET else 2e-2
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=tol, atol=tol)


def test_stacked_inside_scan_over_layers():
    """The model's use: one GEMM per layer in a lax.scan, the layer index traced."""
    x, w, _ = _data(16, 128, 64, seed=3, layers=4)
    bs = sm.BlockSizes(block_n=32, block_k=64)

    def body(h, i):
        return jnp.tanh(sm.skinny_matmul(h, w, None, i, block_sizes=bs, interpret=INTERPRET)[:, :64]
                        @ jnp.eye(64, 128)), None

    got, _ = jax.lax.scan(body, x, jnp.arange(4, dtype=jnp.int32))
    want = x
    for i in range(4):
        want = jnp.tanh(sm.skinny_matmul_reference(want, w[i]) @ jnp.eye(64, 128))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_bf16_rounds_once():
    x, w, b = _data(32, 256, 128, seed=11, dtype=jnp.bfloat16)
    y = sm.skinny_matmul(x, w, b, block_sizes=sm.BlockSizes(block_n=64, block_k=64, split_k=2),
                         interpret=INTERPRET)
    ref = sm.skinny_matmul_reference(x, w, b)
    assert y.dtype == jnp.bfloat16
    diff = np.abs(np.asarray(y, np.float32) - np.asarray(ref, np.float32))
    assert diff.max() <= 2 ** -7 * np.abs(np.asarray(ref, np.float32)).max()


def test_default_blocks_fill_the_gpu():
    for m, k, n in [(32, 4096, 12288), (32, 12288, 4096), (256, 3584, 512), (64, 18944, 3584)]:
        bs = sm.BlockSizes.get_default(m, k, n)
        assert n % bs.block_n == 0 and k % (bs.block_k * bs.split_k) == 0
        assert (n // bs.block_n) * bs.split_k >= 56  # at least ~half a wave of the 132 SMs


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_n=48), "power of two"),
    (dict(block_k=8), "power of two"),
    (dict(split_k=0), "split_k"),
    (dict(block_m=8), "block_m"),
    (dict(num_warps=3), "num_warps"),
])
def test_block_sizes_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sm.BlockSizes(**kwargs)


def test_shape_errors():
    x, w, b = _data(8, 128, 64, seed=0)
    with pytest.raises(ValueError, match="K mismatch"):
        sm.skinny_matmul(x, w[:64], interpret=INTERPRET)
    with pytest.raises(ValueError, match="multiple of block_n"):
        sm.skinny_matmul(x, w, block_sizes=sm.BlockSizes(block_n=128), interpret=INTERPRET)
    with pytest.raises(ValueError, match="block_k"):
        sm.skinny_matmul(x, w, block_sizes=sm.BlockSizes(block_k=64, split_k=3), interpret=INTERPRET)
    with pytest.raises(ValueError, match="bias"):
        sm.skinny_matmul(x, w, b[:10], interpret=INTERPRET)
    with pytest.raises(ValueError, match="layer"):
        sm.skinny_matmul(x, w[None], interpret=INTERPRET)
    with pytest.raises(ValueError, match="layer"):
        sm.skinny_matmul(x, w, None, jnp.int32(0), interpret=INTERPRET)


def test_benchmark_script_smoke(tmp_path):
    """bench/bench_skinny_matmul.py end to end at a tiny shape (interpreted): JSON rows and the plot."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_skinny_matmul.py"
    spec = importlib.util.spec_from_file_location("bench_skinny_matmul", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = sys.argv
    sys.argv = ["bench_skinny_matmul.py", "--smoke", "--quick", "--out", str(tmp_path)]
    try:
        mod.main()
    finally:
        sys.argv = argv
    rows = json.loads((tmp_path / "skinny_matmul_h200.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["rel_err"] < 1e-2
    assert all(rows[0][f"{v}_us"] > 0 for v in ("xla", "pallas_slice", "pallas_stacked", "mgpu_stacked"))
    assert rows[0]["mgpu_rel_err"] < 1e-2
    assert (tmp_path / "skinny_matmul_h200.png").stat().st_size > 0
