"""The batch-invariant mode (`KernelChoice.batch_invariant`): a row's result is bit-identical whatever shares its
call. Unit level: `attend_segments` (other rows, padding keys, left padding, key segments, query positions) and
the model forward (a row alone against the same row padded among others); engine level: every answer of a mixed
stream equals solo `generate`, bit for bit, in fp32 and bf16, on the tiny models and on the bundled model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.config import ModelConfig
from dllm_jax.transformer import KernelChoice, Kernels, forward, init_params
from dllm_jax.transformer.attention import KEY_CHUNK, QUERY_TILE, KeySegment, attend_reference, attend_segments

RNG = np.random.default_rng(0)


def _qkv(b, n, s, hq=4, hkv=2, d=64, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((b, n, hq, d), (b, s, hkv, d), (b, s, hkv, d))
    )
    return q, k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attend_segments_is_attention(dtype):
    """The same attention as the reference (another summation order: close, not equal), masked keys skipped, a row
    without keys zeros."""
    q, k, v = _qkv(3, 21, 2 * KEY_CHUNK + 37, dtype=dtype)
    mask = jnp.asarray(RNG.random((3, k.shape[1])) < 0.7).at[2].set(False)
    got = attend_segments(q, [KeySegment(k, v, mask)])
    want = attend_reference(q, k, v, mask)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)
    assert not np.asarray(got[2]).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attend_segments_row_result_does_not_depend_on_its_call(dtype):
    """One row's queries over its keys, bit for bit: alone; among other rows; its keys left-padded, right-padded and
    scattered among masked ones; split into an empty shared segment and its own; its queries at other offsets of a
    longer window (another place in the query tiles)."""
    s, n = KEY_CHUNK + 45, QUERY_TILE + 3
    q, k, v = _qkv(1, n, s, dtype=dtype, seed=1)
    alone = np.asarray(attend_segments(q, [KeySegment(k, v)]))

    oq, ok, ov = _qkv(4, n, s, dtype=dtype, seed=2)  # other rows around it
    batch = attend_segments(oq.at[2].set(q[0]), [KeySegment(ok.at[2].set(k[0]), ov.at[2].set(v[0]))])
    np.testing.assert_array_equal(np.asarray(batch[2]), alone[0])

    # scattered among masked keys (any layout), a width of other chunks
    width = 3 * KEY_CHUNK + 11
    where = np.sort(RNG.choice(width, s, replace=False))
    big_k, big_v = (jnp.zeros((1, width) + a.shape[2:], dtype).at[:, where].set(a) for a in (k, v))
    big_k = big_k + jnp.asarray(np.isin(np.arange(width), where, invert=True)[None, :, None, None], dtype) * 7
    mask = jnp.asarray(np.isin(np.arange(width), where))[None]
    np.testing.assert_array_equal(np.asarray(attend_segments(q, [KeySegment(big_k, big_v, mask)])), alone)

    # behind an empty segment (the engine's shared list of a row that shares nothing)
    empty = KeySegment(ok[:1, :40], ov[:1, :40], jnp.zeros((1, 40), bool))
    np.testing.assert_array_equal(np.asarray(attend_segments(q, [empty, KeySegment(k, v)])), alone)

    # the same queries at an offset inside a longer window of other queries
    off = 5
    longer = jnp.concatenate([oq[:1, :off], q, oq[:1, : 2 * QUERY_TILE]], axis=1)
    got = attend_segments(longer, [KeySegment(k, v)])[:, off : off + n]
    np.testing.assert_array_equal(np.asarray(got), alone)


def _model(dtype: str) -> tuple[ModelConfig, dict]:
    """A model wide enough that a GEMM's blocking depends on its row count on the CPU (d_model 256, FFN 704)."""
    config = ModelConfig(
        family="llada", vocab_size=300, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
        mlp_hidden=704, rms_eps=1e-5, rope_theta=10000.0, rope_fp32=True, qkv_bias=False, tie_embeddings=False,
        max_seq_len=512, mask_token_id=299, eos_token_id=298, pad_token_id=297, dtype=dtype,
    )  # fmt: skip
    return config, init_params(config, jax.random.key(0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_row_result_does_not_depend_on_its_batch(dtype):
    """A sequence's logits alone and as one row of a batch (other rows, left padding, a wider window): equal bit
    for bit in the batch-invariant mode."""
    config, params = _model(dtype)
    kernels = Kernels.resolve(KernelChoice(batch_invariant=True), config, params)
    n, width, pad = 37, 70, 9
    tokens = jnp.asarray(RNG.integers(0, 290, (1, n)), jnp.int32)
    alone = forward(params, config, tokens, jnp.arange(n)[None], kernels=kernels).logits

    others = jnp.asarray(RNG.integers(0, 290, (3, width)), jnp.int32)
    batch = others.at[1, pad : pad + n].set(tokens[0])
    positions = jnp.broadcast_to(jnp.arange(width), (3, width)).at[1].set(jnp.arange(width) - pad)
    mask = jnp.ones((3, width), bool).at[1].set((jnp.arange(width) >= pad) & (jnp.arange(width) < pad + n))
    got = forward(params, config, batch, positions, key_mask=mask, kernels=kernels).logits[1, pad : pad + n]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone[0], np.float32))
