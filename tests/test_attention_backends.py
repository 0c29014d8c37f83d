"""The model's attention dispatch: the Pallas backend (interpreted on CPU) computes what the XLA reference does,
inside the real model and decoding loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.generate import generate
from dllm_jax.transformer import KernelChoice, Kernels
from dllm_jax.transformer.attention import attend

INTERPRET = jax.default_backend() != "gpu"
opts = GenerationConfig.from_options


@pytest.mark.parametrize("masked", [False, True])
def test_pallas_backend_matches_reference(masked):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(k1, (2, 16, 8, 64), jnp.float32)
    k = jax.random.normal(k2, (2, 48, 2, 64), jnp.float32)
    v = jax.random.normal(k3, (2, 48, 2, 64), jnp.float32)
    mask = jnp.arange(48)[None, :] >= jnp.array([[0], [13]]) if masked else None
    ref = attend(q, k, v, mask, "xla")
    out = attend(q, k, v, mask, "pallas", INTERPRET)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-3, atol=2e-3)


def test_generate_with_pallas_attention(models_fp32):
    m = models_fp32["dream"]
    prompts = [[5, 17, 3, 44, 9, 12, 30], [8, 2, 61]]
    base = dict(gen_length=8, block_length=4, steps=8, cache="dual", stop_at_eos=False)
    ref = generate(m, prompts, opts(**base, attention="xla"))
    out = generate(m, prompts, opts(**base, attention="pallas"))
    # the kernel's fp32 dots may run at reduced internal precision; tokens agree on this tiny model
    assert (out.tokens == ref.tokens).mean() >= 0.9
    assert out.nfe == ref.nfe


def test_cudnn_pallas_sends_block_steps_to_pallas_and_full_forwards_to_cudnn(monkeypatch):
    """ "cudnn_pallas" (the GPU default in bf16): windows up to SHORT_QUERY tokens over at most PALLAS_MAX_ROWS K/V
    streams run the Pallas kernel, the rest cuDNN (recorded here through a stand-in, since cuDNN needs a GPU)."""
    from dllm_jax.config import ModelConfig
    from dllm_jax.transformer import attention

    long_calls = []

    def fake_cudnn(q, k, v, key_mask):
        long_calls.append(q.shape[1])
        return attention.attend_reference(q, k, v, key_mask)

    monkeypatch.setattr(attention, "_attend_cudnn", fake_cudnn)
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    k = jax.random.normal(k2, (1, 96, 2, 64), jnp.float32)
    v = jax.random.normal(k3, (1, 96, 2, 64), jnp.float32)
    for t in (attention.SHORT_QUERY, attention.SHORT_QUERY + 1):
        q = jax.random.normal(k1, (1, t, 4, 64), jnp.float32)
        out = attend(q, k, v, None, "cudnn_pallas", INTERPRET)
        np.testing.assert_allclose(np.asarray(out), np.asarray(attend(q, k, v, None, "xla")), rtol=2e-3, atol=2e-3)
    assert long_calls == [attention.SHORT_QUERY + 1]  # the block-step-sized window never reached cuDNN
    monkeypatch.setattr(attention, "PALLAS_MAX_ROWS", 1)  # 1 row x 2 kv heads: now too many streams for Pallas
    attend(jax.random.normal(k1, (1, 8, 4, 64), jnp.float32), k, v, None, "cudnn_pallas", INTERPRET)
    assert long_calls == [attention.SHORT_QUERY + 1, 8]
    bf16 = ModelConfig(
        family="llada",
        vocab_size=80,
        d_model=64,
        n_layers=1,
        n_heads=4,
        n_kv_heads=4,
        head_dim=16,
        mlp_hidden=96,
        rms_eps=1e-5,
        rope_theta=1e4,
        rope_fp32=True,
        qkv_bias=False,
        tie_embeddings=False,
        max_seq_len=64,
        mask_token_id=79,
        eos_token_id=78,
        pad_token_id=78,
        dtype="bfloat16",
    )
    gpu = jax.default_backend() == "gpu"
    params = {"layers": {}}  # stacked
    assert Kernels.resolve(KernelChoice(), bf16, params, padded=False).attention == ("cudnn_pallas" if gpu else "xla")
    assert Kernels.resolve(KernelChoice(), bf16, params, padded=True).attention == "xla"
    assert Kernels.resolve(KernelChoice(attention="pallas"), bf16, params).attention == "pallas"
    with pytest.raises(ValueError, match="needs a GPU"):
        KernelChoice(attention="cudnn").check_device("cpu")
    with pytest.raises(ValueError, match="attention="):
        KernelChoice(attention="flash")


def test_block_steps_on_the_pallas_kernel_give_the_reference_tokens():
    """The GPU default runs block steps on the Pallas kernel: in fp32 its tokens are the XLA reference's (on the
    CPU the kernel is interpreted with fp32 dots; a GPU's TF32 dots may flip a near tie, hence >= 0.9 there)."""
    from test_layer_loop import CONFIGS, PROMPTS

    from dllm_jax.io.loading import Model
    from dllm_jax.transformer.params import init_params, unstack_layers

    for i, (name, c) in enumerate(CONFIGS.items()):
        m = Model(c, unstack_layers(init_params(c, jax.random.key(i), std=0.2)))
        base = dict(gen_length=16, block_length=8, steps=8, cache="dual", stop_at_eos=False)
        ref = generate(m, PROMPTS, opts(**base, attention="xla")).tokens
        out = generate(m, PROMPTS, opts(**base, attention="pallas")).tokens
        if jax.default_backend() == "gpu":
            assert (out == ref).mean() >= 0.9, name
        else:
            np.testing.assert_array_equal(out, ref, err_msg=name)
