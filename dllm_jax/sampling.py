"""Per-step sampling and commit rules of LLaDA, Fast-dLLM and Dream (see README "Decoding").

All functions work on the current block only: logits [B, L, V] (fp32), masked [B, L] bool (still [MASK]).
They return candidate tokens x0 [B, L], a confidence [B, L] (-inf where not masked) and, from a commit rule,
a boolean [B, L] of positions to commit now.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
NEG_INF = -jnp.inf


# --------------------------------------------------------------------------------------- candidates
def exclude_token(logits: Array, token_id: int) -> Array:
    """logits with one vocabulary entry at -inf (decode_loop: [MASK] is never a prediction). XLA fuses the scatter
    into the reductions that read the logits (bench/NOTES.md v16: a select on the vocabulary index was slower)."""
    return logits.at[..., token_id].set(NEG_INF)


def llada_candidates(logits: Array, masked: Array, key: Array, temperature: float, remasking: str):
    """LLaDA: x0 = argmax of Gumbel-perturbed logits (exp(l)/(-log u)^T == argmax(l + T*gumbel)).

    Confidence: softmax probability of x0 under the UNperturbed logits (low_confidence) or uniform noise (random).
    """
    k_noise, k_rand = jax.random.split(key)
    logits = logits.astype(jnp.float32)
    if temperature > 0:
        gumbel = jax.random.gumbel(k_noise, logits.shape, jnp.float32)
        x0 = jnp.argmax(logits + temperature * gumbel, axis=-1)
    else:
        x0 = jnp.argmax(logits, axis=-1)
    if remasking == "low_confidence":
        probs = jax.nn.softmax(logits, axis=-1)
        conf = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    elif remasking == "random":
        conf = jax.random.uniform(k_rand, masked.shape, jnp.float32)
    else:
        raise ValueError(f"unknown remasking {remasking!r}")
    return x0.astype(jnp.int32), jnp.where(masked, conf, NEG_INF)


def _top_p_filter(logits: Array, top_p: float) -> Array:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # HF/Dream: remove token i (sorted) when the mass before it exceeds top_p; the first is always kept
    remove_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) > top_p
    cutoff = jnp.min(jnp.where(remove_sorted, jnp.inf, sorted_logits), axis=-1, keepdims=True)
    return jnp.where(logits < cutoff, NEG_INF, logits)


def _top_k_filter(logits: Array, top_k: int) -> Array:
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
    return jnp.where(logits < kth, NEG_INF, logits)


def dream_candidates(logits: Array, masked: Array, key: Array, temperature: float, top_p: float | None,
                     top_k: int | None, alg: str):
    """Dream's sample_tokens: temperature, top-p/top-k filtering, then x0 and the alg's confidence."""
    logits = logits.astype(jnp.float32)
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = _top_p_filter(logits, top_p)
    if top_k is not None:
        logits = _top_k_filter(logits, top_k)
    probs = jax.nn.softmax(logits, axis=-1)
    if temperature > 0:
        x0 = jax.random.categorical(key, logits, axis=-1)
        conf = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
    else:
        x0 = jnp.argmax(probs, axis=-1)
        conf = jnp.max(probs, axis=-1)
    if alg == "topk_margin":
        top2 = jax.lax.top_k(probs, 2)[0]
        conf = top2[..., 0] - top2[..., 1]
    elif alg == "entropy":
        conf = jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)  # negative entropy: higher = more certain
    return x0.astype(jnp.int32), jnp.where(masked, conf, NEG_INF)


# ------------------------------------------------------------------------------------------ commits
def rank_desc(conf: Array) -> Array:
    """0 for the most confident position of each row, 1 for the next, ... (stable: lower index first on ties)."""
    order = jnp.argsort(-conf, axis=-1, stable=True)
    return jnp.argsort(order, axis=-1, stable=True)


def commit_top_k(conf: Array, masked: Array, k: Array) -> Array:
    """Commit the k[b] most confident masked positions of each row."""
    return masked & (rank_desc(conf) < k[:, None])


def commit_threshold(conf: Array, masked: Array, threshold: float) -> Array:
    """Fast-dLLM: every masked position with confidence >= threshold, and always the single most confident."""
    best = masked & (rank_desc(conf) == 0)
    return (masked & (conf >= threshold)) | best


def commit_factor(conf: Array, masked: Array, factor: float) -> Array:
    """Fast-dLLM factor rule: the n-th most confident (1-based) passes if conf > 1 - factor/(n+1), the first
    always; commit the leading run of passes (as the reference's loop does)."""
    rank = rank_desc(conf)
    n = jnp.arange(conf.shape[-1], dtype=jnp.float32) + 1.0
    sorted_conf = -jnp.sort(-conf, axis=-1)
    passes = (sorted_conf >= 1.0 - factor / (n + 1.0)) | (n == 1)
    n_commit = jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=-1), axis=-1)
    # the reference loop's quirk (Fast-dLLM get_transfer_index_dynamic): when only the LAST masked position
    # fails, it commits all of them
    n_masked = masked.sum(axis=-1)
    n_commit = jnp.where(n_commit == n_masked - 1, n_masked, n_commit)
    return masked & (rank < n_commit[:, None])


def commit_random(masked: Array, key: Array, prob: Array) -> Array:
    """Dream 'origin': each masked position is revealed with probability prob."""
    return masked & (jax.random.uniform(key, masked.shape) < prob)


def commit_first_masked(masked: Array) -> Array:
    """The leftmost masked position of each row (Fast-dLLM Dream's block-start rule)."""
    first = jnp.argmax(masked, axis=-1)
    return masked & (jnp.arange(masked.shape[-1])[None, :] == first[:, None])


def llada_schedule(n_masked: Array, steps: int) -> Array:
    """Tokens per step when a block with n_masked [B] masks is finished in `steps` steps: [B, steps]."""
    base = n_masked // steps
    rem = n_masked % steps
    return base[:, None] + (jnp.arange(steps)[None, :] < rem[:, None]).astype(n_masked.dtype)


def dream_transfer_count(n_masked: Array, step: Array, steps: int, eps: float) -> tuple[Array, Array]:
    """Dream: timesteps linspace(1, eps, steps+1); reveal int(n * (1 - s/t)), all at the last step.
    Returns (count [B], the reveal probability 1 - s/t)."""
    t = 1.0 - step.astype(jnp.float32) * (1.0 - eps) / steps
    s = 1.0 - (step.astype(jnp.float32) + 1.0) * (1.0 - eps) / steps
    prob = jnp.where(step < steps - 1, 1.0 - s / t, 1.0)
    count = jnp.where(step < steps - 1, jnp.floor(n_masked.astype(jnp.float32) * prob).astype(jnp.int32), n_masked)
    return count, prob
