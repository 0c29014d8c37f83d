"""Tests of the slot write kernel (a chunk's K and V scattered into the pools in place) against its pure-jnp reference
and a numpy loop, its aliasing under jit, and its input checks.

On the CPU the kernel runs interpreted (interpret=True); on a GPU it runs compiled. The pools start random, so
exact equality also proves that slots not written keep their bits and that masked lanes (padded columns, tokens
past N, invalid slots) write nothing.
"""

from __future__ import annotations

import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.gpu_info import abstract_h200_mesh
from pallas_kernels.slot_write import WriteBlocks, slot_write, slot_write_reference

INTERPRET = jax.default_backend() != "gpu"
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


class Case(NamedTuple):
    name: str
    pool: int  # P
    kv_heads: int
    head_dim: int
    n: int
    pool_dtype: str
    in_dtype: str
    pattern: str  # "mixed", "invalid" or "perm"
    blocks: WriteBlocks | None


CASES = [
    # a power-of-two row; N off the token tiles
    Case("bf16_pow2_row", 48, 2, 64, 21, "bfloat16", "bfloat16", "mixed", WriteBlocks(block_n=8)),
    # a 120-element row padded to 128 lanes, default tiles
    Case("fp32_odd_row", 40, 3, 40, 19, "float32", "float32", "mixed", None),
    # fp32 rows rounded into a bf16 pool; the odd row split over two column tiles, the second part masked
    Case("fp32_into_bf16_split_row", 50, 3, 40, 33, "bfloat16", "float32", "mixed", WriteBlocks(block_w=64)),
    Case("all_invalid", 24, 2, 16, 10, "bfloat16", "bfloat16", "invalid", WriteBlocks(block_n=4)),
    # every slot written once, in a shuffled order; the row over four column tiles
    Case("permutation", 36, 4, 32, 36, "float32", "bfloat16", "perm", WriteBlocks(block_n=4, block_w=32)),
]


def _slots(pattern: str, n: int, p: int, rng) -> np.ndarray:
    if pattern == "perm":
        assert n == p
        return rng.permutation(p).astype(np.int32)
    invalid = np.array([p, p + 1, p + 1000, I32_MAX, -1, -p, I32_MIN], np.int64)
    if pattern == "invalid":
        return rng.choice(invalid, size=n).astype(np.int32)
    assert pattern == "mixed"
    s = rng.permutation(p)[:n].astype(np.int64)  # distinct valid slots...
    bad = rng.choice(n, size=min(n, max(len(invalid), n // 3)), replace=False)
    s[bad] = np.resize(invalid, len(bad))  # ...with every kind of invalid entry mixed in
    return s.astype(np.int32)


def _problem(p, hkv, d, n, pool_dtype, in_dtype, pattern, seed=0):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 4)
    kp, vp = (jax.random.normal(kk, (p, hkv, d), jnp.float32).astype(pool_dtype) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (n, hkv, d), jnp.float32).astype(in_dtype) for kk in keys[2:])
    return kp, vp, k, v, jnp.asarray(_slots(pattern, n, p, rng))


def _numpy_write(kp, vp, k, v, slots):
    """The definition, one row at a time (ml_dtypes rounds fp32 to bf16 to nearest even, as XLA and Triton do)."""
    kp, vp = np.array(kp), np.array(vp)
    for row, s in enumerate(np.asarray(slots)):
        if 0 <= s < kp.shape[0]:
            kp[s] = np.asarray(k[row]).astype(kp.dtype)
            vp[s] = np.asarray(v[row]).astype(vp.dtype)
    return kp, vp


def _assert_written(got, kp, vp, k, v, slots):
    want = _numpy_write(kp, vp, k, v, slots)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_equals_reference_and_numpy(case):
    kp, vp, k, v, slots = _problem(*case[1:8])
    got = slot_write(kp, vp, k, v, slots, blocks=case.blocks, interpret=INTERPRET)
    ref = slot_write_reference(kp, vp, k, v, slots)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    _assert_written(got, kp, vp, k, v, slots)
    s = np.asarray(slots)
    untouched = ~np.isin(np.arange(case.pool), s[(s >= 0) & (s < case.pool)])
    assert untouched.any() == (case.pattern != "perm")
    for g, before in ((got[0], kp), (got[1], vp)):
        np.testing.assert_array_equal(np.asarray(g)[untouched], np.asarray(before)[untouched])


def test_donated_under_jit():
    """The pools donated to an outer jit (the engine's layer loop): same result; the inputs are consumed."""
    kp, vp, k, v, slots = _problem(40, 3, 40, 19, "bfloat16", "float32", "mixed", seed=3)
    want = _numpy_write(kp, vp, k, v, slots)
    step = jax.jit(lambda a, b, *rest: slot_write(a, b, *rest, interpret=INTERPRET), donate_argnums=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a backend that cannot donate only warns
        got = step(kp, vp, k, v, slots)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_empty_chunk_returns_the_pools():
    kp, vp, _, _, _ = _problem(8, 2, 16, 1, "bfloat16", "bfloat16", "invalid")
    k = jnp.zeros((0, 2, 16), jnp.bfloat16)
    got = slot_write(kp, vp, k, k, jnp.zeros((0,), jnp.int32), interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(kp))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(vp))


@pytest.mark.parametrize("hkv,d", [(32, 128), (4, 128), (3, 40)])
def test_lowered_for_cuda_aliases_the_pools(hkv, d):
    """Lowered for an H200 (Triton; no GPU needed) with the pools donated: one Triton custom call whose outputs are
    its pool operands, the donated parameters aliased to the results, and nothing else but free reshapes (no copy,
    no scatter). Whether XLA then keeps them in place is buffer assignment's, checked on a GPU only."""
    p, n = 1024, 2048
    args = [jax.ShapeDtypeStruct((p, hkv, d), jnp.bfloat16)] * 2 + [jax.ShapeDtypeStruct((n, hkv, d), jnp.bfloat16)] * 2
    args.append(jax.ShapeDtypeStruct((n,), jnp.int32))
    with jax.sharding.use_abstract_mesh(abstract_h200_mesh()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Triton backend's deprecation
        text = jax.jit(slot_write, donate_argnums=(0, 1)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1
    aliases = re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d)", text)
    assert sorted(aliases) == [("0", "3"), ("1", "4")]  # (k_pool, v_pool) operands after (slots, k, v)
    assert len(re.findall(r"tf\.aliasing_output = [01] : i32", text)) == 2
    ops = set(re.findall(r"= (stablehlo\.\w+)", text))
    assert ops == {"stablehlo.reshape", "stablehlo.custom_call"}, ops


def _bad(name):
    kp, vp, k, v, slots = _problem(16, 2, 8, 5, "bfloat16", "bfloat16", "mixed")
    args = dict(k_pool=kp, v_pool=vp, k=k, v=v, slots=slots)
    change = {
        "pool rank": dict(k_pool=kp.reshape(16, 16), v_pool=vp.reshape(16, 16)),
        "empty pool": dict(k_pool=kp[:0], v_pool=vp[:0]),
        "int pool": dict(k_pool=kp.astype(jnp.int32), v_pool=vp.astype(jnp.int32)),
        "v_pool shape": dict(v_pool=vp[:8]),
        "v_pool dtype": dict(v_pool=vp.astype(jnp.float32)),
        "k heads": dict(k=k.reshape(5, 1, 16)),
        "k rank": dict(k=k.reshape(5, 16)),
        "int k": dict(k=k.astype(jnp.int32)),
        "v shape": dict(v=v[:4]),
        "slots shape": dict(slots=slots[:4]),
        "slots rank": dict(slots=slots[:, None]),
        "slots dtype": dict(slots=slots.astype(jnp.float32)),
    }[name]
    return {**args, **change}


BAD = {
    "pool rank": "k_pool must be",
    "empty pool": "P >= 1",
    "int pool": "floating point",
    "v_pool shape": "v_pool must match",
    "v_pool dtype": "v_pool must match",
    "k heads": "k must be",
    "k rank": "k must be",
    "int k": "floating point",
    "v shape": "v must have",
    "slots shape": "slots must be",
    "slots rank": "slots must be",
    "slots dtype": "slots must be int32",
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_raise(name):
    args = _bad(name)
    with pytest.raises(ValueError, match=BAD[name]):
        slot_write(**args, interpret=INTERPRET)
    with pytest.raises(ValueError, match=BAD[name]):
        slot_write_reference(**args)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_n=12), "block_n must be a power of two"),
        (dict(block_n=2048), "block_n must be a power of two <= 1024"),
        (dict(block_w=0), "block_w must be a power of two"),
        (dict(num_warps=32), "num_warps must be a power of two <= 16"),
        (dict(block_n=1024, block_w=2048), "exceeds Triton's"),
    ],
)
def test_bad_blocks_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        WriteBlocks(**kw)


def test_blocks_must_be_write_blocks():
    kp, vp, k, v, slots = _problem(16, 2, 8, 5, "bfloat16", "bfloat16", "mixed")
    with pytest.raises(ValueError, match="blocks must be a WriteBlocks"):
        slot_write(kp, vp, k, v, slots, blocks=(16, 4), interpret=INTERPRET)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(1, 24),
    hkv=st.sampled_from([1, 3]),
    d=st.sampled_from([8, 24]),
    n=st.integers(1, 20),
    invalid=st.floats(0.0, 1.0),
    block_n=st.sampled_from([2, 8]),
    seed=st.integers(0, 2**16),
)
def test_property_matches_numpy(p, hkv, d, n, invalid, block_n, seed):
    """Any pool size, chunk length and share of invalid slots (valid ones distinct, possibly fewer than N)."""
    rng = np.random.default_rng(seed)
    kp, vp, k, v, _ = _problem(p, hkv, d, n, "bfloat16", "float32", "invalid", seed=seed)
    valid = rng.permutation(p)[: min(n, p)]
    s = rng.choice(np.array([p, p + 7, -1, I32_MIN], np.int64), size=n)
    keep = rng.random(n) >= invalid
    take = np.flatnonzero(keep)[: len(valid)]
    s[take] = valid[: len(take)]
    slots = jnp.asarray(s.astype(np.int32))
    got = slot_write(kp, vp, k, v, slots, blocks=WriteBlocks(block_n=block_n), interpret=INTERPRET)
    _assert_written(got, kp, vp, k, v, slots)
