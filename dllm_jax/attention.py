"""Bidirectional attention over contiguous K/V, with a backend switch.

`attend` is what the model calls inside every layer. Backends:
- "xla": the plain-jnp reference (fp32 scores and softmax; probabilities cast to the value dtype for the PV
  product, as both the eager and the flash reference paths do). Runs everywhere.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` (GPU only, bf16).
- "pallas": the slot-addressed Pallas kernel (`pallas_kernels.slot_attention`), GPU; interpreted on CPU in tests.
- "cudnn_pallas": the Pallas kernel for short query windows (q_len <= SHORT_QUERY: block steps) over at most
  PALLAS_MAX_ROWS (batch x kv heads) K/V streams, cuDNN otherwise (full forwards, block starts, large MHA
  batches): each where it was measured faster on the H200. bench/NOTES.md v12: block steps 1.6-3.9% faster
  than with cuDNN at LLaDA-8B / Dream-7B batch 1 and Dream batch 8, even (+-1%) at LLaDA batch 8 (256 streams);
  standalone, cuDNN is 8% faster at LLaDA batch 16 (512 streams) and ~1.5x at full forwards
  (attention_h200.json). The GPU default in bf16.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array
Backend = Literal["xla", "cudnn", "pallas", "cudnn_pallas"]
BACKENDS = ("xla", "cudnn", "pallas", "cudnn_pallas")
SHORT_QUERY = 64  # "cudnn_pallas": query windows up to this long go to the Pallas kernel ...
PALLAS_MAX_ROWS = 256  # ... when batch x kv heads is at most this


def attend_reference(q: Array, k: Array, v: Array, key_mask: Array | None) -> Array:
    """q [B, T, Hq, D], k/v [B, S, Hkv, D], key_mask [B, S] bool (True = attend) -> [B, T, Hq, D] in q.dtype.

    A row whose keys are all masked returns zeros (never NaN).
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=prec)
    scores = scores * (1.0 / (d**0.5))
    if key_mask is not None:
        mask = key_mask[:, None, None, None, :]
        scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=prec)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _attend_cudnn(q: Array, k: Array, v: Array, key_mask: Array | None) -> Array:
    if key_mask is None:
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    # cuDNN rejects a mask broadcast over queries ([B,1,1,S]): materialise [B, 1, T, S]
    mask = jnp.broadcast_to(key_mask[:, None, None, :], (q.shape[0], 1, q.shape[1], k.shape[1]))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


def _attend_pallas(q: Array, k: Array, v: Array, key_mask: Array | None, interpret: bool) -> Array:
    from pallas_kernels import slot_attention as sa  # imported lazily: only this backend needs Pallas

    b, s, hkv, d = k.shape
    t = q.shape[1]
    q_lens = jnp.full((b,), t, jnp.int32)
    if key_mask is None:  # the contiguous fast path: slots computed in-kernel, no table
        kv_lens = jnp.full((b,), s, jnp.int32)
        return sa.slot_attention(q, k, v, None, q_lens, kv_lens, interpret=interpret)
    # Valid keys first: a stable argsort of ~mask lists each row's valid slots in order; kv_len = their count.
    order = jnp.argsort(~key_mask, axis=1, stable=True).astype(jnp.int32)
    table = order + (jnp.arange(b, dtype=jnp.int32) * s)[:, None]
    kv_lens = key_mask.sum(axis=1).astype(jnp.int32)
    return sa.slot_attention(q, k.reshape(b * s, hkv, d), v.reshape(b * s, hkv, d), table, q_lens, kv_lens,
                             interpret=interpret)


def attend(q: Array, k: Array, v: Array, key_mask: Array | None = None, backend: Backend = "xla") -> Array:
    if backend == "cudnn_pallas":  # shapes are static: the choice is made once per traced forward
        short = q.shape[1] <= SHORT_QUERY and q.shape[0] * k.shape[2] <= PALLAS_MAX_ROWS
        backend = "pallas" if short else "cudnn"
    if backend == "xla":
        return attend_reference(q, k, v, key_mask)
    if backend == "cudnn":
        return _attend_cudnn(q, k, v, key_mask)
    if backend == "pallas":
        return _attend_pallas(q, k, v, key_mask, interpret=jax.default_backend() != "gpu")
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
