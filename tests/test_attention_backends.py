"""The model's attention dispatch: the Pallas backend (interpreted on CPU) computes what the XLA reference does,
inside the real model and decoding loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.generate import generate
from dllm_jax.transformer import KernelChoice, Kernels
from dllm_jax.transformer.attention import LOOP_MIN_WIDTH, attend, attend_slot_chunks

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


@pytest.mark.parametrize("key_chunk, width", [(8, 300), (128, 300), (128, LOOP_MIN_WIDTH)])
def test_xla_slot_attention_reads_only_the_chunks_its_longest_list_needs(key_chunk, width):
    """`attend_slot_chunks` (the engine's attention off the GPU) equals a softmax over each row's listed keys, each
    list scored by its own queries; a table wider than LOOP_MIN_WIDTH never runs a chunk past its longest row: those
    entries point at a NaN slot, which would poison every output (0 x NaN) if a chunk holding them ran (a narrower
    table is gathered whole: its entries past a row's count are finite, as the engine's are)."""
    rng = np.random.default_rng(0)
    pool, nan_slot = 64, 63
    k_pool, v_pool = (rng.normal(size=(pool, 2, 16)).astype(np.float32) for _ in range(2))
    k_pool[nan_slot] = v_pool[nan_slot] = np.nan
    lens = [np.array([130, 0, 7, 0]), np.array([3, 20, 0, 0])]  # two lists a row; the last row reads nothing
    lists = []
    for n in lens:
        live = -(-n.max() // key_chunk) * key_chunk if width > LOOP_MIN_WIDTH else width  # past it: the NaN slot
        table = np.full((4, width), nan_slot, np.int32)
        table[:, :live] = rng.integers(0, nan_slot, (4, min(live, width)))
        lists.append((rng.normal(size=(4, 5, 4, 16)).astype(np.float32), table, n))  # 2 query heads a K/V head
    run = jax.jit(lambda k, v, lists: attend_slot_chunks(k, v, lists, key_chunk))
    out = np.asarray(run(k_pool, v_pool, jax.tree.map(jnp.asarray, lists)))
    assert np.isfinite(out).all()
    for b in range(4):
        for h in range(4):
            scores = np.concatenate([q[b, :, h] @ k_pool[t[b, : n[b]], h // 2].T for q, t, n in lists], axis=1) / 4
            values = np.concatenate([v_pool[t[b, : n[b]], h // 2] for _, t, n in lists])
            if not len(values):
                np.testing.assert_array_equal(out[b, :, h], 0)  # no key: zeros
                continue
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            np.testing.assert_allclose(out[b, :, h], p @ values / p.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


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
