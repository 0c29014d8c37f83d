"""Tests of the per-key attention weights kernel (ACache's probe) against its pure-jnp reference, and of the
reference against a direct numpy loop.

On the CPU the kernels run interpreted (interpret=True); on a GPU they run compiled.  Interpret mode fills output
buffers with NaN before a kernel runs, so the finiteness checks also prove every output element is written.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import slot_key_weights as skw

INTERPRET = jax.default_backend() != "gpu"
# Compiled fp32 dots run on TF32 tensor cores (both passes); interpreted ones are exact fp32.
TOL = {"float32": (1e-5, 1e-6) if INTERPRET else (5e-3, 1e-4), "bfloat16": (2e-3, 1e-4)}  # (rtol, atol / weight)


class Case(NamedTuple):
    name: str
    batch: int
    q_len: int
    kv_len: int  # S (table width)
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_lens: tuple
    masks: tuple  # one pattern name per row
    block_q: int | None  # None: the default tiling
    block_k: int | None


# GQA 1/4/7, head_dim 64/128, kv_lens 0, 1, off the tile grid, the full table; T off the query tile grid.
CASES = [
    Case("mha_d128", 4, 24, 80, 2, 2, 128, (80, 1, 0, 37), ("all", "span", "all", "none"), 16, 32),
    Case("gqa4_d64", 3, 40, 100, 8, 2, 64, (100, 37, 64), ("scattered", "span", "last"), 8, 32),
    Case("gqa7_d128", 2, 20, 64, 14, 2, 128, (64, 33), ("scattered", "first"), 2, 16),
    Case("gqa4_d64_default_tiling", 2, 33, 70, 4, 1, 64, (70, 5), ("span", "scattered"), None, None),
]


def _mask_row(pattern: str, T: int, rng) -> np.ndarray:
    m = np.zeros(T, bool)
    if pattern == "all":
        m[:] = True
    elif pattern == "span":  # a generation region in the middle
        m[T // 3 : T // 3 + max(1, T // 4)] = True
    elif pattern == "scattered":
        m[rng.choice(T, size=max(1, T // 3), replace=False)] = True
    elif pattern == "first":
        m[0] = True
    elif pattern == "last":
        m[-1] = True
    else:
        assert pattern == "none"
    return m


def _make_problem(seed, B, T, S, Hq, Hkv, D, kv_lens, masks, dtype=jnp.bfloat16):
    """Random problem: a shared affix at a random offset of each row, private permuted slots, NaN-poisoned unused
    slots, and table entries past kv_lens pointing at poisoned or out-of-range slots."""
    rng = np.random.default_rng(seed)
    shared = S // 3
    n_priv = B * (S - shared)
    P = shared + n_priv + 5  # a few never-referenced slots
    priv = rng.permutation(np.arange(shared, shared + n_priv)).reshape(B, S - shared)
    table = np.empty((B, S), np.int32)
    for b in range(B):
        off = rng.integers(0, S - shared + 1)
        table[b, :off] = priv[b, :off]
        table[b, off : off + shared] = np.arange(shared)
        table[b, off + shared :] = priv[b, off:]
    used = np.zeros(P, bool)
    for b in range(B):
        used[table[b, : kv_lens[b]]] = True
        tail = np.arange(kv_lens[b], S)
        table[b, tail] = rng.choice([P - 1, P + 1000, -7, 2**30], size=tail.size)
    k = rng.standard_normal((P, Hkv, D)).astype(np.float32)
    k[~used] = np.nan
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    q_mask = np.stack([_mask_row(p, T, rng) for p in masks])
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(table),
        jnp.asarray(q_mask),
        jnp.asarray(kv_lens, jnp.int32),
    )


def _check(out, ref, q, q_mask, kv_lens, dtype):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.all(np.isfinite(out)), "NaN/inf in output (unwritten or poisoned values leaked)"
    rtol, atol = TOL[jnp.dtype(dtype).name]
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol * q.shape[2])
    hq = q.shape[2]
    for b, kl in enumerate(np.asarray(kv_lens)):
        assert np.all(out[b, kl:] == 0.0), "keys >= kv_len must be zeros"
        n_q = int(np.asarray(q_mask[b]).sum())
        # each (masked query, head) spreads a total weight of 1 over the row's keys
        want = hq * n_q if kl > 0 else 0.0
        np.testing.assert_allclose(out[b].sum(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kernel_matches_reference(case, dtype):
    args = _make_problem(
        sum(map(ord, case.name)),
        case.batch,
        case.q_len,
        case.kv_len,
        case.q_heads,
        case.kv_heads,
        case.head_dim,
        case.kv_lens,
        case.masks,
        dtype,
    )
    q, k, tbl, qm, kl = args
    bs = None if case.block_q is None else skw.BlockSizes(block_q=case.block_q, block_k=case.block_k)
    out = skw.slot_key_weights(q, k, tbl, qm, kl, block_sizes=bs, interpret=INTERPRET)
    ref = skw.slot_key_weights_reference(q, k, tbl, qm, kl)
    _check(out, ref, q, qm, kl, dtype)
    assert np.asarray(out).max() > 0.1  # real weights, not zeros

    # Table entries past kv_lens are never read: pointing them at slot 0 changes nothing.
    tail = np.arange(case.kv_len)[None, :] >= np.asarray(kl)[:, None]
    clean = jnp.asarray(np.where(tail, 0, np.asarray(tbl)))
    out_clean = skw.slot_key_weights(q, k, clean, qm, kl, block_sizes=bs, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(out_clean), np.asarray(out))


def test_table_permutation_of_slots_is_invisible():
    """Moving the pool's slots and the table with them gives the same weights; permuting the table's keys of a row
    permutes that row's weights."""
    B, T, S, Hq, Hkv, D = 2, 16, 48, 4, 2, 64
    kv_lens = (48, 29)
    q, k, tbl, qm, kl = _make_problem(5, B, T, S, Hq, Hkv, D, kv_lens, ("span", "all"), jnp.float32)
    bs = skw.BlockSizes(block_q=8, block_k=16)
    jitted = jax.jit(functools.partial(skw.slot_key_weights, block_sizes=bs, interpret=INTERPRET))  # traceable
    out = np.asarray(jitted(q, k, tbl, qm, kl))
    rtol, atol = TOL["float32"]

    rng = np.random.default_rng(0)
    P = k.shape[0]
    perm = rng.permutation(P)  # new slot of old slot s: perm[s]
    k2 = jnp.zeros_like(k).at[perm].set(k)
    t_np = np.asarray(tbl)
    live = np.arange(S)[None, :] < np.asarray(kl)[:, None]
    tbl2 = jnp.asarray(np.where(live, perm[np.clip(t_np, 0, P - 1)], t_np).astype(np.int32))
    out2 = np.asarray(skw.slot_key_weights(q, k2, tbl2, qm, kl, block_sizes=bs, interpret=INTERPRET))
    np.testing.assert_allclose(out2, out, rtol=rtol, atol=atol)

    order = np.arange(S)
    order[: kv_lens[0]] = rng.permutation(kv_lens[0])  # row 0's live keys reordered (row 1's kept)
    tbl3 = jnp.asarray(np.where(np.arange(B)[:, None] == 0, t_np[:, order], t_np))
    out3 = np.asarray(skw.slot_key_weights(q, k, tbl3, qm, kl, block_sizes=bs, interpret=INTERPRET))
    np.testing.assert_allclose(out3[0], out[0, order], rtol=rtol, atol=atol)
    np.testing.assert_allclose(out3[1], out[1], rtol=rtol, atol=atol)


def _numpy_loop(q, k_pool, table, q_mask, kv_lens, scale):
    """weights[b, j] by the definition: per row, head and masked query, a softmax over the row's keys."""
    B, T, Hq, _ = q.shape
    G = Hq // k_pool.shape[1]
    out = np.zeros(table.shape, np.float64)
    for b in range(B):
        n = int(kv_lens[b])
        if n == 0:
            continue
        keys = k_pool[table[b, :n]].astype(np.float64)  # [n, Hkv, D]
        for t in range(T):
            if not q_mask[b, t]:
                continue
            for h in range(Hq):
                s = scale * keys[:, h // G] @ q[b, t, h].astype(np.float64)
                e = np.exp(s - s.max())
                out[b, :n] += e / e.sum()
    return out


def test_reference_matches_numpy_loop():
    B, T, S, Hq, Hkv, D = 3, 7, 10, 6, 2, 8
    kv_lens = (10, 4, 0)
    rng = np.random.default_rng(11)
    P = 40
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32) * 2
    k = rng.standard_normal((P, Hkv, D)).astype(np.float32)
    table = rng.permutation(P)[: B * S].reshape(B, S).astype(np.int32)
    table[1, 4:] = P + 3  # out of range past kv_len
    q_mask = rng.random((B, T)) < 0.5
    q_mask[0, 0] = True
    want = _numpy_loop(q, k, table, q_mask, kv_lens, 1.0 / math.sqrt(D))
    got = skw.slot_key_weights_reference(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(table), jnp.asarray(q_mask), jnp.asarray(kv_lens, jnp.int32)
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert want[0].sum() > 1.0 and np.all(want[2] == 0)
    scaled = skw.slot_key_weights_reference(
        *(jnp.asarray(x) for x in (q, k, table, q_mask)), jnp.asarray(kv_lens, jnp.int32), scale=0.3
    )
    np.testing.assert_allclose(np.asarray(scaled), _numpy_loop(q, k, table, q_mask, kv_lens, 0.3), rtol=1e-5)


_PROP_SHAPE = (2, 12, 40, 4, 2, 64)  # B, T, S, Hq, Hkv, D: one shape, so every example reuses one program


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kv_lens=st.tuples(st.integers(0, 44), st.integers(0, 44)),  # past S = 40: clipped
    mask_bits=st.tuples(st.integers(0, 2**12 - 1), st.integers(0, 2**12 - 1)),
    seed=st.integers(0, 2**16),
)
def test_property_random_lengths_and_masks(kv_lens, mask_bits, seed):
    B, T, S, Hq, Hkv, D = _PROP_SHAPE
    q, k, tbl, _, kl = _make_problem(seed, B, T, S, Hq, Hkv, D, kv_lens, ("none", "none"), jnp.float32)
    qm = jnp.asarray([[(bits >> t) & 1 == 1 for t in range(T)] for bits in mask_bits])
    bs = skw.BlockSizes(block_q=8, block_k=16)  # 12 queries: two query tiles
    out = skw.slot_key_weights(q, k, tbl, qm, kl, block_sizes=bs, interpret=INTERPRET)
    _check(out, skw.slot_key_weights_reference(q, k, tbl, qm, kl), q, qm, kl, jnp.float32)


def test_validation_errors():
    q = jnp.zeros((2, 8, 4, 64), jnp.bfloat16)
    kp = jnp.zeros((32, 2, 64), jnp.bfloat16)
    tbl = jnp.zeros((2, 16), jnp.int32)
    qm = jnp.ones((2, 8), bool)
    ln = jnp.zeros((2,), jnp.int32)
    call = lambda *a, **kw: skw.slot_key_weights(*a, interpret=True, **kw)
    assert call(q, kp, jnp.zeros((2, 0), jnp.int32), qm, ln).shape == (2, 0)  # no keys: an empty result
    with pytest.raises(ValueError, match="q must be"):
        call(q[0], kp, tbl, qm, ln)
    with pytest.raises(ValueError, match="q must be"):
        call(q.astype(jnp.int32), kp, tbl, qm, ln)
    with pytest.raises(ValueError, match="k_pool must be"):
        call(q, kp[None], tbl, qm, ln)
    with pytest.raises(ValueError, match="head_dim"):
        k128 = jnp.zeros((32, 2, 128), jnp.bfloat16)
        call(q, k128, tbl, qm, ln)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        k3 = jnp.zeros((32, 3, 64), jnp.bfloat16)
        call(q, k3, tbl, qm, ln)
    with pytest.raises(ValueError, match="read_table"):
        call(q, kp, jnp.zeros((3, 16), jnp.int32), qm, ln)
    with pytest.raises(ValueError, match="read_table"):
        call(q, kp, tbl.astype(jnp.float32), qm, ln)
    with pytest.raises(ValueError, match="q_mask"):
        call(q, kp, tbl, qm.astype(jnp.int32), ln)
    with pytest.raises(ValueError, match="q_mask"):
        call(q, kp, tbl, qm[:, :4], ln)
    with pytest.raises(ValueError, match="kv_lens"):
        call(q, kp, tbl, qm, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="block_sizes"):
        call(q, kp, tbl, qm, ln, block_sizes=skw.BlockSizes(block_q=4))  # 4 tokens x 2 heads: 8 rows
    with pytest.raises(ValueError, match="block_sizes must be"):
        call(q, kp, tbl, qm, ln, block_sizes=(16, 16))
    with pytest.raises(ValueError, match="block_k"):
        skw.BlockSizes(block_k=8)
    with pytest.raises(ValueError, match="block_q"):
        skw.BlockSizes(block_q=48)
    with pytest.raises(ValueError, match="num_stages"):
        skw.BlockSizes(num_stages=0)
