"""The engine's pool view (`PagedKV.attend`) on the slot kernel against its XLA path: the shared list scored by the
query rotated back by each row's placement, then the row's own list, in one kernel call; with a q_len (a block
start's whole window) the rotation runs only when some row places its affix past 0, and rows before q_len are
those of every other path."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding.caches.acache import row_importance_probe
from dllm_jax.engine.kv_pool import PagedKV
from dllm_jax.transformer.kernels import XLA, Kernels

SLOT = Kernels(attention="pallas", interpret=jax.default_backend() != "gpu")
B, N, A, R, S, HQ, HKV, D = 2, 8, 6, 7, 40, 4, 2, 16


def _pool(delta, seed=0) -> tuple[PagedKV, jax.Array]:
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.standard_normal((S, HKV, D)), jnp.float32) for _ in range(2))
    shared = np.tile(np.arange(A), (B, 1))  # one shared copy in slots 0..A-1
    own = np.stack([rng.permutation(np.arange(A, S))[:R] for _ in range(B)])
    kv = PagedKV(
        k=(k,),
        v=(v,),
        col_slots=jnp.full((B, N), S, jnp.int32),
        shared_slots=jnp.asarray(shared, jnp.int32),
        shared_len=jnp.asarray([A, 4], jnp.int32),
        shared_delta=jnp.asarray(delta, jnp.int32),
        own_slots=jnp.asarray(own, jnp.int32),
        own_len=jnp.asarray([R, 3], jnp.int32),
        rope_theta=10000.0,
        rotate=True,
    )
    return kv, jnp.asarray(rng.standard_normal((B, N, HQ, D)), jnp.float32)


@pytest.mark.parametrize("delta", [(0, 3), (0, 0)], ids=["placed", "prefixes"])
def test_pool_attention_on_the_slot_kernel_equals_xla(delta):
    kv, q = _pool(delta)
    want = np.asarray(kv.attend(0, q, None, XLA))
    whole = np.asarray(kv.attend(0, q, None, SLOT))
    np.testing.assert_allclose(whole, want, atol=2e-5, rtol=2e-5)
    live = np.asarray(kv.attend(0, q, None, SLOT, q_len=jnp.int32(5)))[:, :5]  # rows past 5: not needed
    np.testing.assert_allclose(live, want[:, :5], atol=2e-5, rtol=2e-5)
    unrotated = dataclasses.replace(kv, rotate=False).attend(0, q, None, XLA)
    assert (np.abs(np.asarray(unrotated) - want).max() > 1e-3) == any(delta)  # the placement matters where it is set


@pytest.mark.parametrize("delta", [(0, 3), (0, 0)], ids=["placed", "prefixes"])
def test_probe_key_weights_on_the_slot_kernel_equal_the_xla_probe(delta):
    """ACache's probe scores (`PagedKV.key_weights`, the query rotated back only when some row is placed past 0)
    equal the XLA probe's over the shared keys rotated to each row's placement."""
    kv, q = _pool(delta, seed=1)
    queries = jnp.asarray(np.arange(N)[None] >= np.asarray([[2], [5]]))  # each row's [MASK] span
    want = np.asarray(row_importance_probe(kv.shared_mask(), queries)(q, kv, 0))
    got = np.asarray(kv.key_weights(0, q, queries, SLOT))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    unrotated = np.asarray(dataclasses.replace(kv, rotate=False).key_weights(0, q, queries, SLOT))
    assert (np.abs(unrotated - want).max() > 1e-4) == any(delta)  # the placement matters where it is set
