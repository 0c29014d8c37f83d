"""The layer layouts of the forward against each other: the unrolled layer loop over per-layer (fused) weights
against the scan over stacked weights, loading in either layout, and the FP8 FFN in both."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.config import ModelConfig
from dllm_jax.decoding.config import GenerationConfig
from dllm_jax.decoding.generate import generate
from dllm_jax.io.loading import Model
from dllm_jax.transformer import CacheWrite, KVCache, WindowChunks, forward
from dllm_jax.transformer.params import (
    fuse_projections,
    init_params,
    is_fused,
    quantize_params,
    split_projections,
    stack_layers,
    unstack_layers,
)

opts = GenerationConfig.from_options

# Kernel-friendly tiny shapes (d_model and mlp_hidden multiples of 16), both families: LLaDA MHA, Dream GQA+bias.
CONFIGS = {
    "llada": ModelConfig(
        family="llada",
        vocab_size=80,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=4,
        head_dim=16,
        mlp_hidden=96,
        rms_eps=1e-5,
        rope_theta=10000.0,
        rope_fp32=True,
        qkv_bias=False,
        tie_embeddings=False,
        max_seq_len=256,
        mask_token_id=79,
        eos_token_id=78,
        pad_token_id=78,
        bos_token_id=77,
        dtype="float32",
    ),
    "dream": ModelConfig(
        family="dream",
        vocab_size=72,
        d_model=48,
        n_layers=2,
        n_heads=6,
        n_kv_heads=2,
        head_dim=8,
        mlp_hidden=80,
        rms_eps=1e-6,
        rope_theta=1e6,
        rope_fp32=False,
        qkv_bias=True,
        tie_embeddings=True,
        max_seq_len=256,
        mask_token_id=71,
        eos_token_id=70,
        pad_token_id=70,
        dtype="float32",
    ),
}
PROMPTS = [[5, 17, 3, 44, 9, 12, 30], [8, 2, 61]]


@pytest.fixture(scope="module")
def models():
    # std 0.2: logits far from ties, so argmax comparisons test the paths, not rounding luck
    return {k: Model(c, init_params(c, jax.random.key(i), std=0.2)) for i, (k, c) in enumerate(CONFIGS.items())}


def _close(got, ref, tol=1e-5):
    """max |got - ref| <= tol * max |ref|: fp32 reordering (XLA fuses a scan body and an unrolled loop
    differently), not bit equality."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.max(np.abs(got - ref)) <= tol * np.max(np.abs(ref))


def _window(config, b=2, n=8, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (b, n), 0, config.vocab_size - 3)
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    return tokens, positions


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("fuse", [False, True])
def test_unrolled_layers_equal_scan(name, fuse, models):
    """Per-layer weights (fused q/k/v and gate/up or not) and per-layer cache buffers give the scan's results."""
    m = models[name]
    unrolled = unstack_layers(m.params, fuse=fuse)
    assert is_fused(unrolled["layers"]) == fuse and "qkv_proj" not in m.params["layers"]  # caller's tree intact
    tokens, positions = _window(m.config)
    a = forward(m.params, m.config, tokens, positions, return_kv=True)
    b = forward(unrolled, m.config, tokens, positions, return_kv=True)
    _close(b.logits, a.logits)
    _close(b.kv[0], a.kv[0])
    _close(b.kv[1], a.kv[1])
    cache = KVCache.zeros(m.config, 2, 16)
    per_layer = KVCache.for_params(unrolled, m.config, 2, 16)
    assert per_layer.per_layer and len(per_layer.k) == m.config.n_layers and per_layer.length == 16
    ca = forward(m.params, m.config, tokens, positions + 4, cache=cache, write=CacheWrite.at(4))
    for c in (cache, per_layer):  # the unrolled loop takes either cache layout
        cb = forward(unrolled, m.config, tokens, positions + 4, cache=c, write=CacheWrite.at(4))
        assert cb.cache.per_layer == c.per_layer
        _close(cb.logits, ca.logits)
        _close(cb.cache.stacked().k, ca.cache.k)
        _close(cb.cache.stacked().v, ca.cache.v)
    with pytest.raises(ValueError, match="per-layer KVCache"):
        forward(m.params, m.config, tokens, positions, cache=per_layer, write=CacheWrite.at(4))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("unroll", [False, True])
def test_chunked_window_equals_whole_window(name, unroll, models):
    """A window run in chunks (only the live ones) gives the whole window's logits and K/V at its live entries,
    with scattered and contiguous writes; entries past the live chunks write nothing."""
    m = models[name]
    params = unstack_layers(m.params) if unroll else m.params
    tokens, positions = _window(m.config, n=16, seed=3)
    cache = KVCache.for_params(params, m.config, 2, 24)
    slots = jnp.asarray(np.stack([np.random.default_rng(r).permutation(24)[:16] for r in range(2)]), jnp.int32)
    at = jnp.asarray([[0, 5, 8], [1, 2, 8]], jnp.int32)

    def write_of(writes, scatter: bool) -> CacheWrite:
        return CacheWrite.scatter(slots, writes) if scatter else CacheWrite.at(3, writes)

    @functools.partial(jax.jit, static_argnames="scatter")  # the live length as data: one program a write kind
    def chunked(live, writes, scatter):
        chunks = WindowChunks(4, live, half_tail=True)
        return forward(params, m.config, tokens, positions + 3, cache=cache, write=write_of(writes, scatter),
                       logits_at=at, chunks=chunks)  # fmt: skip

    @functools.partial(jax.jit, static_argnames=("live", "scatter"))
    def whole(writes, live, scatter):
        write = _cut(write_of(writes, scatter), live)
        return forward(params, m.config, tokens[:, :live], positions[:, :live] + 3, cache=cache, write=write,
                       logits_at=at)  # fmt: skip

    # chunks of 4: 3 live, the last chunk padding; 2 and a half chunk (unrolled: the tail as a half chunk of 2);
    # 3, the last one partly live (more than half: a whole chunk)
    for live, scatter in itertools.product((12, 10, 11), (True, False)):
        writes = jnp.arange(16)[None] < jnp.asarray([[live], [9]])
        want, got = whole(writes, live, scatter), chunked(jnp.int32(live), writes, scatter)
        _close(got.logits, want.logits)
        _close(got.cache.stacked().k, want.cache.stacked().k)
        _close(got.cache.stacked().v, want.cache.stacked().v)
    with pytest.raises(ValueError, match="multiple of the chunk"):
        forward(params, m.config, tokens, positions, cache=cache, chunks=WindowChunks(5, 12))


def _cut(write: CacheWrite, n: int) -> CacheWrite:
    if write.slots is not None:
        return CacheWrite.scatter(write.slots[:, :n], write.mask[:, :n])
    return CacheWrite.at(write.offset, write.mask[:, :n])


@pytest.mark.parametrize("host", [False, True])
def test_fuse_split_projections_round_trip(host, models):
    """fuse_projections concatenates along the output axis (q|k|v, gate|up) and split_projections undoes it
    exactly, on stacked and per-layer trees; consume=True empties the given dicts (the loader's low-memory path)."""
    m = models["dream"]  # GQA (k/v narrower than q) and q/k/v biases
    layers = jax.tree.map(np.asarray, m.params["layers"]) if host else m.params["layers"]
    fused = fuse_projections(jax.tree.map(lambda a: a, layers))
    c = m.config
    hd = c.head_dim
    assert fused["qkv_proj"]["kernel"].shape == (c.n_layers, c.d_model, (c.n_heads + 2 * c.n_kv_heads) * hd)
    assert fused["qkv_proj"]["bias"].shape == (c.n_layers, (c.n_heads + 2 * c.n_kv_heads) * hd)
    assert fused["mlp"]["gate_up_proj"]["kernel"].shape == (c.n_layers, c.d_model, 2 * c.mlp_hidden)
    assert isinstance(fused["qkv_proj"]["kernel"], np.ndarray) == host
    np.testing.assert_array_equal(
        fused["qkv_proj"]["kernel"][..., c.n_heads * hd : (c.n_heads + c.n_kv_heads) * hd], layers["k_proj"]["kernel"]
    )
    jax.tree.map(np.testing.assert_array_equal, split_projections(fused, c), layers)
    one = fuse_projections(jax.tree.map(lambda a: a[1], layers))  # a single layer's tree
    jax.tree.map(np.testing.assert_array_equal, split_projections(one, c), jax.tree.map(lambda a: a[1], layers))
    owned = jax.tree.map(lambda a: a, layers)
    fuse_projections(owned, consume=True)
    assert not any(k in owned for k in ("q_proj", "k_proj", "v_proj")) and set(owned["mlp"]) == {"down_proj"}


@pytest.mark.parametrize("name,cache", [("llada", "dual"), ("dream", "none")])
def test_generate_fast_paths_give_identical_tokens(name, cache, models):
    """The decoding loop on per-layer fused weights (fp32) commits exactly the stacked path's tokens."""
    m = models[name]
    gc = opts(gen_length=8, block_length=4, steps=8, cache=cache, stop_at_eos=False)
    ref = generate(m, PROMPTS, gc)
    fast = generate(Model(m.config, unstack_layers(m.params)), PROMPTS, gc)
    np.testing.assert_array_equal(fast.tokens, ref.tokens)
    assert fast.nfe == ref.nfe


def test_unrolled_layers_with_fp8_ffn():
    """The FP8 FFN (layer 0 bf16, the rest e4m3) keeps its per-layer choice in the unrolled loop."""
    c = CONFIGS["llada"].replace(d_model=128, head_dim=32, mlp_hidden=256, n_layers=2, fp8_ffn=True)
    params = init_params(c, jax.random.key(5), std=0.2)
    tokens, positions = _window(c)
    a = forward(params, c, tokens, positions)
    unrolled = unstack_layers(params)
    b = forward(unrolled, c, tokens, positions)
    _close(b.logits, a.logits)

    # the unrolled loop picks layer 0's bf16 FFN statically: no conditional in its program
    def program(p):
        return str(jax.make_jaxpr(lambda q: forward(q, c, tokens, positions).logits)(p))

    assert "cond[" not in program(unrolled) and "cond[" in program(params)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_layer_layouts(name, models, tmp_path):
    """`load(..., layer_layout=)`: "unrolled" gives per-layer arrays with the stacked layout's tokens; "auto"
    is stacked off the GPU; export_hf writes the same tensors from either layout; bad values fail early."""
    import dllm_jax
    from dllm_jax.io import checkpoint
    from dllm_jax.io.loading import resolve_layer_layout

    m = models[name]
    checkpoint.export_hf(m.params, m.config, tmp_path / "stacked")
    stacked = dllm_jax.load(tmp_path / "stacked", dtype="float32", layer_layout="stacked")
    unrolled = dllm_jax.load(tmp_path / "stacked", dtype="float32", layer_layout="unrolled")
    assert isinstance(unrolled.params["layers"], tuple) and len(unrolled.params["layers"]) == m.config.n_layers
    assert not isinstance(stacked.params["layers"], tuple)
    assert resolve_layer_layout("auto") == ("unrolled" if jax.default_backend() == "gpu" else "stacked")
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", stop_at_eos=False)
    np.testing.assert_array_equal(generate(unrolled, PROMPTS, gc).tokens, generate(stacked, PROMPTS, gc).tokens)
    checkpoint.export_hf(unrolled.params, m.config, tmp_path / "from_unrolled")
    assert (tmp_path / "from_unrolled" / "model.safetensors").read_bytes() == (
        tmp_path / "stacked" / "model.safetensors"
    ).read_bytes()
    jax.tree.map(np.testing.assert_array_equal, stack_layers(unrolled.params, unrolled.config), stacked.params)
    with pytest.raises(ValueError, match="layer_layout"):
        dllm_jax.load(tmp_path / "stacked", layer_layout="scan")


def test_auto_layout_is_unrolled_on_a_gpu(models, tmp_path, monkeypatch):
    """On a GPU backend "auto" unrolls, from an HF directory (numpy leaves) and from a converted checkpoint
    (restored arrays); the converted format itself stays stacked whatever layout it is written from."""
    import dllm_jax
    from dllm_jax.io import checkpoint

    m = models["dream"]
    checkpoint.export_hf(m.params, m.config, tmp_path / "hf", dtype=np.float32)
    checkpoint.write_converted(unstack_layers(m.params), m.config, tmp_path / "conv")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for src in ("hf", "conv"):
        got = dllm_jax.load(tmp_path / src, dtype="float32")
        assert isinstance(got.params["layers"], tuple) and len(got.params["layers"]) == m.config.n_layers, src
        jax.tree.map(np.testing.assert_array_equal, stack_layers(got.params, got.config), m.params)
    host = stack_layers(jax.tree.map(np.asarray, unstack_layers(m.params)), m.config)  # the numpy branch
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(host["layers"]))


def test_fp8_quantize_keeps_the_unrolled_layout():
    c = CONFIGS["llada"].replace(d_model=128, head_dim=32, mlp_hidden=256, n_layers=2)
    params = init_params(c, jax.random.key(5), std=0.2)
    q_stacked, c8 = quantize_params(params, c)
    q_unrolled, c8u = quantize_params(unstack_layers(params), c)
    assert c8u == c8 and isinstance(q_unrolled["layers"], tuple)
    tokens, positions = _window(c)
    _close(forward(q_unrolled, c8, tokens, positions).logits, forward(q_stacked, c8, tokens, positions).logits)


def test_stacked_layout_on_gpu_warns(models, monkeypatch):
    """generate() tells a GPU user that stacked weights take the slow scan path; unrolled or CPU: silent."""
    import importlib

    gen = importlib.import_module("dllm_jax.decoding.generate")  # the module (also the name of the function)

    params = models["llada"].params
    with pytest.warns(UserWarning, match="layer_layout"):
        assert gen.warn_if_slow_layer_layout(params, backend="gpu")
    assert not gen.warn_if_slow_layer_layout(unstack_layers(params), backend="gpu")
    assert not gen.warn_if_slow_layer_layout(params, backend="cpu")
    seen = []  # generate() itself runs the check on the params it decodes with
    monkeypatch.setattr(gen, "warn_if_slow_layer_layout", lambda p, backend=None: seen.append(p) or False)
    gen.generate(models["llada"], PROMPTS, opts(gen_length=4, block_length=4, steps=4))
    assert len(seen) == 1 and seen[0] is params
