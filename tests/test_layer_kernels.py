"""RoPE + K/V cache write (pallas_kernels/rope_kv_write.py) against its reference, and the split-K partials that
feed it.

On the CPU the Triton kernels run interpreted; on a GPU compiled (the same tests, both ways)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.transformer.layers import apply_rope, rope_cos_sin
from pallas_kernels import rope_kv_write as K

INTERPRET = jax.default_backend() != "gpu"


def _f32(a):
    return np.asarray(a, np.float32)


def _assert_rounding_close(got, ref, dtype):
    """Equal up to one rounding of the output dtype where the fp32 summation order flips it."""
    got, ref = _f32(got), _f32(ref)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
        return
    assert np.mean(got == ref) > 0.99
    np.testing.assert_allclose(got, ref, rtol=2.0**-7, atol=1e-6)


# ----------------------------------------------------------------------------------- split-K partials
@pytest.mark.parametrize("parts,dtype", [(4, jnp.bfloat16), (3, jnp.float32)])
def test_linear_partials_sum_to_the_product(parts, dtype):
    """`linear_partials`: [S, M, N] fp32 partial products over consecutive K chunks, whose sum is x @ w, which
    `projection_from_partials` rounds once (with a bias: test_rope_kv_write_from_split_k_partials)."""
    m, d, k = 33, 384, 64 * parts
    a = jax.random.normal(jax.random.key(m), (m, k)).astype(dtype)
    w = (0.1 * jax.random.normal(jax.random.key(m + 1), (k, d))).astype(dtype)
    p = K.linear_partials(a, w, parts)
    assert p.shape == (parts, m, d) and p.dtype == jnp.float32
    full = jnp.dot(a.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(_f32(p.sum(0)), _f32(full), rtol=1e-4, atol=1e-4)
    chunk = k // parts  # partial j is the product over K chunk j
    np.testing.assert_allclose(
        _f32(p[1]),
        _f32(
            jnp.dot(
                a[:, chunk : 2 * chunk].astype(jnp.float32),
                w[chunk : 2 * chunk].astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST,
            )
        ),
        rtol=1e-4,
        atol=1e-4,
    )
    y = K.projection_from_partials(p, None, dtype)  # the projection output: the fp32 product rounded once
    assert y.dtype == dtype
    _assert_rounding_close(y, full.astype(dtype), dtype)
    with pytest.raises(ValueError, match="K % splits"):
        K.linear_partials(jnp.zeros((4, 96)), jnp.zeros((96, 8)), 5)


# --------------------------------------------------------------------------------- RoPE + K/V write
# (batch, n, cache S, q heads, kv heads, head_dim, dtype, rope in fp32, write mask, offset)
ROPE_CASES = [
    (2, 5, 12, 4, 4, 64, jnp.bfloat16, True, True, 3),  # MHA, LLaDA's fp32 rotation, a masked write
    (1, 32, 64, 28, 4, 128, jnp.bfloat16, False, False, 20),  # Dream's heads (7:1), bf16 rotation, block step
    (3, 4, 8, 2, 2, 16, jnp.float32, True, True, 9),  # offset past S - n: clamped as dynamic_update_slice
    (2, 8, 8, 6, 3, 32, jnp.float32, False, False, 0),  # the window is the whole cache (a block start)
    (1, 1, 5, 8, 1, 64, jnp.bfloat16, True, True, 4),  # one token, 8 q heads per kv head, the last slot
]


def _rope_inputs(b, n, s, hq, hkv, d, dtype, masked, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    qkv = jax.random.normal(ks[0], (b, n, (hq + 2 * hkv) * d)).astype(dtype)
    cos, sin = rope_cos_sin(jax.random.randint(ks[1], (b, n), 0, 4000), d, 10000.0)
    kc = jax.random.normal(ks[2], (b, s, hkv, d)).astype(dtype)
    vc = jax.random.normal(ks[3], (b, s, hkv, d)).astype(dtype)
    mask = None
    if masked:  # at least one token kept out and one written
        mask = jax.random.bernoulli(ks[4], 0.6, (b, n)).at[0, -1].set(True)
        mask = mask.at[0, 0].set(False) if n > 1 else mask.at[-1, 0].set(b == 1)
    return qkv, cos, sin, kc, vc, mask


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"b{c[0]}n{c[1]}s{c[2]}h{c[3]}-{c[4]}d{c[5]}")
def test_rope_kv_write_matches_reference(case):
    b, n, s, hq, hkv, d, dtype, fp32, masked, offset = case
    qkv, cos, sin, kc, vc, mask = _rope_inputs(b, n, s, hq, hkv, d, dtype, masked)
    kw = dict(q_heads=hq, kv_heads=hkv, rope_fp32=fp32)
    q, k_new, v_new = K.rope_kv_write(qkv, cos, sin, kc, vc, offset, mask, interpret=INTERPRET, **kw)
    qr, kr, vr = K.rope_kv_write_reference(qkv, cos, sin, kc, vc, offset, mask, **kw)
    assert q.shape == (b, n, hq, d) and k_new.shape == kc.shape and k_new.dtype == kc.dtype
    _assert_rounding_close(q, qr, dtype)
    _assert_rounding_close(k_new, kr, dtype)
    np.testing.assert_array_equal(_f32(v_new), _f32(vr))  # v is copied, never rounded
    # every slot outside the written window, and every masked-out token's slot, keeps its old bits
    start = min(offset, s - n)
    written = np.zeros((b, s), bool)
    written[:, start : start + n] = True if mask is None else np.asarray(mask)
    for new, old in ((k_new, kc), (v_new, vc)):
        np.testing.assert_array_equal(_f32(new)[~written], _f32(old)[~written])
    assert not np.array_equal(_f32(k_new)[written], _f32(kc)[written])


# (parts, bias, case index in ROPE_CASES): LLaDA-like without a bias, Dream-like with one, fp32, one token
PARTIAL_CASES = [(4, False, 0), (3, True, 1), (2, True, 2), (1, False, 4)]


@pytest.mark.parametrize("parts,with_bias,idx", PARTIAL_CASES)
def test_rope_kv_write_from_split_k_partials(parts, with_bias, idx):
    """qkv as the projection's split-K partials [S, B, n, W] fp32 (+ bias): the kernel's projection output is
    round(sum + bias) in out_dtype, then everything as from that bf16 projection."""
    b, n, s, hq, hkv, d, dtype, fp32, masked, offset = ROPE_CASES[idx]
    _, cos, sin, kc, vc, mask = _rope_inputs(b, n, s, hq, hkv, d, dtype, masked)
    w = (hq + 2 * hkv) * d
    parts_arr = jax.random.normal(jax.random.key(parts), (parts, b, n, w), jnp.float32)
    bias = (0.5 * jax.random.normal(jax.random.key(9), (w,))).astype(dtype) if with_bias else None
    kw = dict(q_heads=hq, kv_heads=hkv, rope_fp32=fp32)
    q, k_new, v_new = K.rope_kv_write(
        parts_arr, cos, sin, kc, vc, offset, mask, bias=bias, out_dtype=dtype, interpret=INTERPRET, **kw
    )
    assert q.dtype == dtype and q.shape == (b, n, hq, d)
    qkv = K.projection_from_partials(parts_arr, bias, dtype)
    if with_bias and dtype == jnp.bfloat16:  # the bias is part of the one rounding (fp32 sum + bias), as Linear
        assert not np.array_equal(_f32(qkv), _f32(K.projection_from_partials(parts_arr, None, dtype) + bias))  # adds it
    qr, kr, vr = K.rope_kv_write_reference(qkv, cos, sin, kc, vc, offset, mask, **kw)
    q2, k2, v2 = K.rope_kv_write_reference(parts_arr, cos, sin, kc, vc, offset, mask, bias=bias, out_dtype=dtype, **kw)
    for got, ref in ((q, qr), (k_new, kr), (v_new, vr), (q2, qr), (k2, kr), (v2, vr)):
        _assert_rounding_close(got, ref, dtype)


def test_rope_kv_write_rejects_misshapen_partials():
    _, cos, sin, kc, vc, _ = _rope_inputs(1, 4, 8, 4, 2, 16, jnp.bfloat16, False)
    kw = dict(q_heads=4, kv_heads=2, rope_fp32=True, interpret=True)
    p = jnp.zeros((2, 1, 4, 128), jnp.float32)
    with pytest.raises(ValueError, match="out_dtype"):
        K.rope_kv_write(p, cos, sin, kc, vc, 0, **kw)
    with pytest.raises(ValueError, match="bias must be"):
        K.rope_kv_write(p, cos, sin, kc, vc, 0, bias=jnp.zeros((64,), jnp.bfloat16), out_dtype=jnp.bfloat16, **kw)
    with pytest.raises(ValueError, match="partials"):
        K.rope_kv_write(p[0].astype(jnp.bfloat16), cos, sin, kc, vc, 0, out_dtype=jnp.bfloat16, **kw)


@pytest.mark.parametrize("fp32", [True, False])
def test_rope_reference_is_the_models_rotation(fp32):
    """The reference rotates exactly as the model's `apply_rope` (so the kernel is tested against the model)."""
    b, n, hq, hkv, d = 2, 6, 4, 2, 32
    qkv, cos, sin, kc, vc, _ = _rope_inputs(b, n, n, hq, hkv, d, jnp.bfloat16, False, seed=3)
    q, k_new, v_new = K.rope_kv_write_reference(
        qkv, cos, sin, kc, vc, 0, None, q_heads=hq, kv_heads=hkv, rope_fp32=fp32
    )
    qm, km, vm = jnp.split(qkv, [hq * d, (hq + hkv) * d], axis=-1)
    np.testing.assert_array_equal(_f32(q), _f32(apply_rope(qm.reshape(b, n, hq, d), cos, sin, fp32)))
    np.testing.assert_array_equal(_f32(k_new), _f32(apply_rope(km.reshape(b, n, hkv, d), cos, sin, fp32)))
    np.testing.assert_array_equal(_f32(v_new), _f32(vm.reshape(b, n, hkv, d)))


def test_rope_kv_write_rejects_bad_shapes():
    qkv, cos, sin, kc, vc, _ = _rope_inputs(1, 4, 8, 4, 2, 16, jnp.bfloat16, False)
    kw = dict(q_heads=4, kv_heads=2, rope_fp32=True, interpret=True)
    with pytest.raises(ValueError, match="qkv must be"):
        K.rope_kv_write(qkv[..., :-16], cos, sin, kc, vc, 0, **kw)
    with pytest.raises(ValueError, match="cos must be"):
        K.rope_kv_write(qkv, cos[:, :2], sin, kc, vc, 0, **kw)
    with pytest.raises(ValueError, match="must fit the cache"):
        K.rope_kv_write(
            jnp.concatenate([qkv] * 3, axis=1),
            jnp.concatenate([cos] * 3, 1),
            jnp.concatenate([sin] * 3, 1),
            kc,
            vc,
            0,
            **kw,
        )
    with pytest.raises(ValueError, match="kv_heads"):
        K.rope_kv_write(qkv, cos, sin, kc, vc, 0, q_heads=4, kv_heads=4, rope_fp32=True, interpret=True)
    with pytest.raises(ValueError, match="write_mask"):
        K.rope_kv_write(qkv, cos, sin, kc, vc, 0, jnp.ones((1, 3), bool), **kw)
    with pytest.raises(ValueError, match="two equal"):
        K.rope_kv_write(qkv, cos, sin, kc, vc[:, :4], 0, **kw)
