"""The model's attention dispatch: the Pallas backend (interpreted on CPU) computes what the XLA reference does,
inside the real model and decoding loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.attention import attend
from dllm_jax.generate import GenerationConfig, generate


@pytest.mark.parametrize("masked", [False, True])
def test_pallas_backend_matches_reference(masked):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k1, (2, 16, 8, 64), jnp.float32)
    k = jax.random.normal(k2, (2, 48, 2, 64), jnp.float32)
    v = jax.random.normal(k3, (2, 48, 2, 64), jnp.float32)
    mask = jnp.arange(48)[None, :] >= jnp.array([[0], [13]]) if masked else None
    ref = attend(q, k, v, mask, "xla")
    out = attend(q, k, v, mask, "pallas")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-3, atol=2e-3)


def test_generate_with_pallas_attention(models_fp32):
    m = models_fp32["dream"]
    prompts = [[5, 17, 3, 44, 9, 12, 30], [8, 2, 61]]
    gc = GenerationConfig(gen_length=8, block_length=4, steps=8, cache="dual", stop_at_eos=False,
                          attention_backend="xla")
    ref = generate(m, prompts, gc)
    out = generate(m, prompts, dataclasses.replace(gc, attention_backend="pallas"))
    # the kernel's fp32 dots may run at reduced internal precision; tokens agree on this tiny model
    assert (out.tokens == ref.tokens).mean() >= 0.9
    assert out.nfe == ref.nfe
