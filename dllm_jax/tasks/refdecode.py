"""Batching of task problems and a minimal exact LLaDA decoder used during training.

`reference_decode` is LLaDA's `generate` with temperature 0, low-confidence remasking, one block and
steps == gen_length (one token committed per step, no cache): exactly what `dllm_jax.generate` computes with
GenerationConfig(gen_length=G, block_length=G, steps=G, temperature=0, cache="none"). It exists so that training
can evaluate without depending on the engine's loop; the benchmark (bench/quality.py) uses the engine's loop.
Rows are right-padded here (RoPE positions start at 0 at each row's first token, pad keys masked), which is
equivalent to the engine's left padding.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import ModelConfig
from dllm_jax.modeling import forward


def pad_prompts(prompts: Sequence[Sequence[int]], gen_length: int, mask_id: int, pad_id: int,
                multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """[B, T] buffer = prompt + gen_length masks + right padding; and the prompt lengths [B]."""
    plen = np.array([len(p) for p in prompts], np.int32)
    t = int(plen.max()) + gen_length
    t = (t + multiple - 1) // multiple * multiple
    x = np.full((len(prompts), t), pad_id, np.int32)
    for i, p in enumerate(prompts):
        x[i, :len(p)] = p
        x[i, len(p):len(p) + gen_length] = mask_id
    return x, plen


@functools.partial(jax.jit, static_argnames=("config", "gen_length"))
def _decode(params, config: ModelConfig, x, plen, gen_length: int):
    b, t = x.shape
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = pos < (plen[:, None] + gen_length)
    gen = (pos >= plen[:, None]) & valid
    positions = jnp.broadcast_to(pos, (b, t))

    def step(_, x):
        logits = forward(params, config, x, positions, key_mask=valid).logits.astype(jnp.float32)
        p = jax.nn.softmax(logits, axis=-1)
        x0 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        conf = jnp.max(p, axis=-1)
        conf = jnp.where(gen & (x == config.mask_token_id), conf, -jnp.inf)
        j = jnp.argmax(conf, axis=1)
        commit = jax.nn.one_hot(j, t, dtype=bool)
        return jnp.where(commit, x0, x)

    x = jax.lax.fori_loop(0, gen_length, step, x)
    idx = plen[:, None] + jnp.arange(gen_length, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(x, idx, axis=1)


def reference_decode(params, config: ModelConfig, prompts: Sequence[Sequence[int]], gen_length: int) -> np.ndarray:
    x, plen = pad_prompts(prompts, gen_length, config.mask_token_id, config.pad_token_id)
    return np.asarray(_decode(params, config, jnp.asarray(x), jnp.asarray(plen), gen_length))


def strip_answer(tokens: Sequence[int], eos_id: int) -> list[int]:
    """The generated ids up to (not including) the first EOS."""
    out = []
    for t in tokens:
        if int(t) == eos_id:
            break
        out.append(int(t))
    return out
