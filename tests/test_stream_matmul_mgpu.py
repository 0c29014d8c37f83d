"""The Mosaic GPU weight-streaming GEMM against its jnp reference.

On the CPU the kernel runs in jax's GPU simulator (interpret mode) at small shapes, and the real LLaDA/Dream
shapes are lowered for CUDA under an abstract H200 mesh (which also checks the shared-memory budget); on a
Hopper GPU the kernel runs compiled.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import stream_matmul_mgpu as S
from pallas_kernels.gpu_info import abstract_h200_mesh

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def _data(m, k, n, layers=None, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  lead = () if layers is None else (layers,)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, lead + (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  return x, w


def _err(y, ref):
  y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
  return np.max(np.abs(y - ref)) / np.max(np.abs(ref))


# (M, K, N, config): ragged M (1, 5, 64), split-K 1/2/4, both tile widths, one K step per unit
CASES = [
    (1, 256, 128, S.StreamConfig(tile_n=64, tile_k=64, split_k=1, stages=2)),
    (5, 512, 256, S.StreamConfig(tile_n=64, tile_k=64, split_k=2, stages=3)),
    (64, 256, 256, S.StreamConfig(tile_n=128, tile_k=32, split_k=4, stages=2)),
    (32, 128, 128, S.StreamConfig(tile_n=32, tile_k=32, split_k=4, stages=2)),
]


@pytest.mark.parametrize("m,k,n,cfg", CASES)
def test_matches_reference(m, k, n, cfg):
  x, w = _data(m, k, n, seed=m)
  y = S.stream_matmul(x, w, config=cfg, interpret=INTERPRET)
  ref = S.stream_matmul_reference(x, w)
  assert y.shape == (m, n) and y.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(y, np.float32)))
  assert _err(y, ref) <= 2 ** -7  # bf16 output rounding (fp32 accumulation in a different order)


@pytest.mark.parametrize("layer", [0, 2])
def test_stacked_weights_pick_the_layer(layer):
  x, w = _data(8, 256, 256, layers=3, seed=3)
  cfg = S.StreamConfig(tile_n=64, tile_k=64, split_k=2, stages=2)
  y = S.stream_matmul(x, w, jnp.int32(layer), config=cfg, interpret=INTERPRET)
  assert _err(y, S.stream_matmul_reference(x, w, layer)) <= 2 ** -7
  other = S.stream_matmul_reference(x, w, 1 - layer // 2)
  assert _err(y, other) > 0.1  # really a different layer's weights


def test_split_choice_balances_the_grid():
  for k, n in [(4096, 12288), (12288, 4096), (4096, 4096), (3584, 18944), (18944, 3584)]:
    split = S._choose_split(k // 64, n // 128, 132, k)
    assert (k // 64) % split == 0 and (split == 1 or k // 64 // split >= 4)
    units = (n // 128) * split
    assert units / (-(-units // 132) * 132) >= 0.8  # the persistent grid's rounds are >= 80% full
  # Dream's 512-wide K/V projections: 4 N tiles; the finest split that keeps >= 4 K steps per unit
  assert S._choose_split(3584 // 64, 512 // 128, 132, 3584) == 14


@pytest.mark.parametrize("kwargs,message", [
    (dict(tile_n=48), "tile_n"), (dict(tile_n=32, tile_k=64), "multiple of tile_k"), (dict(tile_k=128), "tile_k"), (dict(split_k=0), "split_k"), (dict(stages=1), "stages"),
])
def test_config_validation(kwargs, message):
  with pytest.raises(ValueError, match=message):
    S.StreamConfig(**kwargs)


def test_shape_errors():
  x, w = _data(8, 256, 256)
  with pytest.raises(ValueError, match="K mismatch"):
    S.stream_matmul(x, w[:128], interpret=INTERPRET)
  with pytest.raises(ValueError, match="M=65"):
    S.stream_matmul(jnp.zeros((65, 256), jnp.bfloat16), w, interpret=INTERPRET)
  with pytest.raises(ValueError, match="bf16 or fp16"):
    S.stream_matmul(x.astype(jnp.float32), w, interpret=INTERPRET)
  with pytest.raises(ValueError, match="layer"):
    S.stream_matmul(x, w[None], interpret=INTERPRET)
  with pytest.raises(ValueError, match="multiple"):
    S.stream_matmul(x, w[:, :192], interpret=INTERPRET)


REAL = [(32, 32, 4096, 12288), (32, 32, 12288, 4096), (32, 64, 4096, 4096), (28, 32, 3584, 18944),
        (28, 32, 18944, 3584), (28, 32, 3584, 512)]


@pytest.mark.parametrize("layers,m,k,n", REAL)
def test_cuda_lowering_at_real_shapes(layers, m, k, n):
  """Default config, stacked LLaDA-8B / Dream-7B weights: lowers for CUDA within the H200's shared memory."""
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((layers, k, n), jnp.bfloat16),
          jax.ShapeDtypeStruct((), jnp.int32))
  with jax.sharding.use_abstract_mesh(abstract_h200_mesh()):
    txt = S.stream_matmul.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in txt and f"tensor<{m}x{n}xbf16>" in txt


@pytest.mark.skipif(not ON_GPU, reason="compiled kernel needs a Hopper GPU")
@pytest.mark.parametrize("layers,m,k,n", REAL)
def test_compiled_at_real_shapes(layers, m, k, n):
  x, w = _data(m, k, n, layers=2)
  y = S.stream_matmul(x, w, jnp.int32(1))
  assert _err(y, S.stream_matmul_reference(x, w, 1)) <= 2 ** -7
