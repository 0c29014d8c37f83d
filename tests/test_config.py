import json

import fixtures
import pytest

from dllm_jax.config import ConfigError, ModelConfig


@pytest.mark.parametrize("name", sorted(fixtures.SPECS))
def test_parses_both_families(name):
    spec = fixtures.SPECS[name]
    c = ModelConfig.from_hf(fixtures.hf_config(spec))
    assert c.family == spec["family"]
    assert (c.d_model, c.n_layers, c.n_heads, c.n_kv_heads) == (spec["d"], spec["layers"], spec["heads"], spec["kv"])
    assert c.head_dim == spec["d"] // spec["heads"] and c.mlp_hidden == spec["mlp"]
    assert c.tie_embeddings == spec["tied"] and c.rms_eps == spec["eps"] and c.rope_theta == spec["theta"]
    assert c.qkv_bias == (spec["family"] == "dream")
    assert c.rope_fp32 == (spec["family"] == "llada")
    assert c.mask_token_id == spec["vocab"] - 1
    hash(c)  # static jit argument


def test_llada_8b_instruct_shapes():
    cfg = dict(
        fixtures.hf_config(fixtures.SPECS["llada"]),
        d_model=4096,
        n_heads=32,
        n_kv_heads=32,
        n_layers=32,
        mlp_hidden_size=12288,
        vocab_size=126464,
        embedding_size=126464,
        mask_token_id=126336,
        eos_token_id=126081,
    )
    c = ModelConfig.from_hf(cfg)
    assert (c.head_dim, c.vocab_size, c.mask_token_id) == (128, 126464, 126336)


@pytest.mark.parametrize(
    "key,value",
    [
        ("alibi", True),
        ("block_type", "sequential"),
        ("layer_norm_type", "default"),
        ("activation_type", "gelu"),
        ("rope", False),
        ("scale_logits", True),
        ("attention_layer_norm", True),
        ("include_bias", True),
    ],
)
def test_llada_rejects_unimplemented(key, value):
    cfg = dict(fixtures.hf_config(fixtures.SPECS["llada"]), **{key: value})
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(cfg)
    assert key in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize(
    "key,value",
    [("hidden_act", "gelu"), ("use_sliding_window", True), ("rope_scaling", {"rope_type": "yarn", "factor": 4.0})],
)
def test_dream_rejects_unimplemented(key, value):
    cfg = dict(fixtures.hf_config(fixtures.SPECS["dream"]), **{key: value})
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(cfg)
    assert key in str(e.value)


def test_unknown_model_type_and_missing_keys(tmp_path):
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf({})
    cfg = fixtures.hf_config(fixtures.SPECS["dream"])
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf(cfg)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_file(tmp_path)
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_file(tmp_path / "nope")


def test_gqa_must_divide():
    cfg = dict(fixtures.hf_config(fixtures.SPECS["dream"]), num_key_value_heads=3)
    with pytest.raises(ConfigError, match="multiple of n_kv_heads=3"):
        ModelConfig.from_hf(cfg)


def test_roundtrip_dict():
    c = ModelConfig.from_hf(fixtures.hf_config(fixtures.SPECS["dream"]))
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
