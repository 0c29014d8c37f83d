"""The FP8 FFN model path (LaCache): e4m3 FFNs in layers >= 2, layer 1 in bf16; conversion and loading."""

import fixtures
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dllm_jax
from convert.cli import main as convert_main
from dllm_jax.config import ConfigError
from dllm_jax.io import checkpoint as ckpt
from dllm_jax.transformer import KVCache, forward
from dllm_jax.transformer import params as fp8
from dllm_jax.transformer.params import init_params, param_shapes

CFG = fixtures.fp8_config()


@pytest.fixture(scope="module")
def bf16_params():
    return init_params(CFG, jax.random.key(0), std=0.05)


def logits(params, config, ids):
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return forward(params, config, ids, pos).logits.astype(jnp.float32)


IDS = jax.random.randint(jax.random.key(1), (2, 24), 0, 290)


def test_fp8_close_to_bf16_and_layer1_stays_bf16(bf16_params):
    q, c8 = fp8.quantize_params(bf16_params, CFG)
    assert c8.fp8_ffn and "mlp" not in q["layers"]
    assert q["layers"]["mlp_fp8"]["w_gu"].dtype == jnp.float8_e4m3fn
    assert jax.tree.map(lambda a: a.shape, q) == jax.tree.map(lambda a: a.shape, param_shapes(c8))
    ref, out = logits(bf16_params, CFG, IDS), logits(q, c8, IDS)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    # e4m3 keeps 3 mantissa bits (relative step 1/16 at worst, ~2-3% rms per quantised operand); measured ~3.6%
    assert 1e-4 < rel < 0.08

    # layer 0's FFN is the bf16 mlp_first: entry 0 of the FP8 stack is never read, entry 1 is
    def poke(entry):
        p = jax.tree.map(lambda a: a, q)
        w = jnp.asarray(p["layers"]["mlp_fp8"]["w_gu"])
        p["layers"]["mlp_fp8"] = dict(p["layers"]["mlp_fp8"], w_gu=w.at[entry].set(jnp.zeros_like(w[entry])))
        return logits(p, c8, IDS)

    np.testing.assert_array_equal(np.asarray(poke(0)), np.asarray(out))
    assert float(jnp.abs(poke(1) - out).max()) > 1e-3
    # the cached path runs the same FFNs
    pos = jnp.broadcast_to(jnp.arange(24), IDS.shape)
    cached = forward(q, c8, IDS, pos, cache=KVCache.zeros(c8, 2, 24)).logits.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(out), rtol=2e-2, atol=2e-2)


def test_convert_fp8_ffn_and_load_time_quantisation_agree(bf16_params, tmp_path):
    src = ckpt.export_hf(jax.tree.map(np.asarray, bf16_params), CFG, tmp_path / "hf")
    assert convert_main([str(src), str(tmp_path / "out"), "--fp8-ffn", "--quiet"]) == 0
    converted = dllm_jax.load(tmp_path / "out")
    at_load = dllm_jax.load(src, fp8_ffn=True)
    assert converted.config.fp8_ffn and at_load.config.fp8_ffn
    a = jax.tree_util.tree_leaves_with_path(converted.params)
    b = dict(jax.tree_util.tree_leaves_with_path(at_load.params))
    for path, leaf in a:
        assert leaf.dtype == b[path].dtype, path
        np.testing.assert_array_equal(np.asarray(leaf.astype(jnp.float32)), np.asarray(b[path].astype(jnp.float32)))
    np.testing.assert_array_equal(
        np.asarray(logits(converted.params, converted.config, IDS)),
        np.asarray(logits(at_load.params, at_load.config, IDS)),
    )


def test_fp8_needs_128_multiples(tmp_path, capsys):
    bad = CFG.replace(d_model=96, n_heads=3, head_dim=32, n_kv_heads=3)
    with pytest.raises(ConfigError, match="d_model=96"):
        fp8.quantize_params(init_params(bad, jax.random.key(0)), bad)
    src = ckpt.export_hf(jax.tree.map(np.asarray, init_params(bad, jax.random.key(0))), bad, tmp_path / "hf")
    assert convert_main([str(src), str(tmp_path / "out"), "--fp8-ffn", "--quiet"]) == 2
    assert "multiples of 128" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
