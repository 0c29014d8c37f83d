"""One static, hashable model config for both families (LLaDA and Dream).

`ModelConfig.from_hf(config_dict)` parses either family's `config.json` and refuses, naming the key and value,
anything the engine does not implement. The config is a frozen dataclass so that it can be a static argument of
`jax.jit` (changing it recompiles; the same config never does).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp

Family = Literal["llada", "dream"]


class ConfigError(ValueError):
    """A config.json the engine cannot run: the message names the key and its value."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: Family
    vocab_size: int  # rows of the embedding / LM head (LLaDA: embedding_size)
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    rms_eps: float
    rope_theta: float
    rope_fp32: bool  # LLaDA rotates q/k in fp32 (rope_full_precision); Dream (HF Llama style) in the activation dtype
    qkv_bias: bool
    tie_embeddings: bool
    max_seq_len: int
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None = None
    dtype: str = "bfloat16"  # activation/weight dtype the engine runs in ("bfloat16" or "float32")
    fp8_ffn: bool = False  # FFN of layers >= 2 with e4m3 weights/activations (LaCache); layer 1 stays in dtype
    fp8_proj: bool = False  # also q/k/v and o of layers >= 2 and the LM head in e4m3 (with fp8_ffn: "fp8_all")
    fp8_first_layer: bool = False  # layer 1 in e4m3 too (LaCache keeps it in dtype: its activations are the touchiest)

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.fp8_first_layer and not self.fp8_ffn:
            raise ConfigError("fp8_first_layer quantises layer 1 beside FP8 weights: weights='fp8_ffn' or 'fp8_all'")
        if self.fp8_proj and not self.fp8_ffn:
            raise ConfigError("fp8_proj (FP8 projections and head) comes with fp8_ffn: weights='fp8_all'")
        if self.dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"dtype={self.dtype!r}: expected 'bfloat16' or 'float32'")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_hidden", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")

    @property
    def weights(self) -> str:
        """ "bf16" (the config dtype throughout), "fp8_ffn" or "fp8_all" (`dllm_jax.load(weights=...)`)."""
        return "fp8_all" if self.fp8_proj else "fp8_ffn" if self.fp8_ffn else "bf16"

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf(cls, cfg: dict[str, Any], dtype: str = "bfloat16") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no 'model_type' (expected 'llada' or 'Dream')")
        if str(model_type).lower() == "llada":
            return _parse_llada(cfg, dtype)
        if str(model_type).lower() == "dream":
            return _parse_dream(cfg, dtype)
        raise ConfigError(f"model_type={model_type!r} is not supported (expected 'llada' or 'Dream')")

    @classmethod
    def from_file(cls, path: str | Path, dtype: str = "bfloat16") -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_hf(cfg, dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ConfigError(f"unknown ModelConfig keys: {sorted(unknown)}")
        return cls(**d)


def _require(cfg: dict[str, Any], key: str, family: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"{family} config.json is missing required key {key!r}")
    return cfg[key]


def _expect(cfg: dict[str, Any], key: str, allowed: tuple, default: Any, family: str) -> None:
    value = cfg.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{family} config: {key}={value!r} is not supported (supported: {list(allowed)})")


def _parse_llada(cfg: dict[str, Any], dtype: str) -> ModelConfig:
    f = "LLaDA"
    # Features of the OLMo-derived config class that LLaDA checkpoints never use: refuse rather than ignore.
    _expect(cfg, "block_type", ("llama",), "llama", f)
    _expect(cfg, "activation_type", ("silu", "swiglu"), "silu", f)
    _expect(cfg, "layer_norm_type", ("rms",), "rms", f)
    _expect(cfg, "alibi", (False,), False, f)
    _expect(cfg, "rope", (True,), True, f)
    _expect(cfg, "attention_layer_norm", (False,), False, f)
    _expect(cfg, "input_emb_norm", (False,), False, f)
    _expect(cfg, "scale_logits", (False,), False, f)
    _expect(cfg, "include_bias", (False,), False, f)
    _expect(cfg, "bias_for_layer_norm", (False, None), False, f)
    _expect(cfg, "multi_query_attention", (False, None), None, f)
    _expect(cfg, "clip_qkv", (None,), None, f)
    d_model = int(_require(cfg, "d_model", f))
    n_heads = int(_require(cfg, "n_heads", f))
    n_kv_heads = cfg.get("n_kv_heads") or n_heads
    mlp_hidden = cfg.get("mlp_hidden_size")
    if mlp_hidden is None:
        mlp_hidden = int(_require(cfg, "mlp_ratio", f)) * d_model
    vocab = cfg.get("embedding_size") or _require(cfg, "vocab_size", f)
    if d_model % n_heads:
        raise ConfigError(f"LLaDA config: d_model={d_model} is not a multiple of n_heads={n_heads}")
    eos = int(cfg.get("eos_token_id", 126081))
    return ModelConfig(
        family="llada",
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(_require(cfg, "n_layers", f)),
        n_heads=n_heads,
        n_kv_heads=int(n_kv_heads),
        head_dim=d_model // n_heads,
        mlp_hidden=int(mlp_hidden),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_fp32=bool(cfg.get("rope_full_precision", True)),
        qkv_bias=bool(cfg.get("include_qkv_bias", False)),
        tie_embeddings=bool(cfg.get("weight_tying", False)),
        max_seq_len=int(cfg.get("max_sequence_length", 4096)),
        mask_token_id=int(cfg.get("mask_token_id", 126336)),
        eos_token_id=eos,
        pad_token_id=int(cfg.get("pad_token_id", eos)),
        bos_token_id=cfg.get("bos_token_id"),
        dtype=dtype,
    )


def _parse_dream(cfg: dict[str, Any], dtype: str) -> ModelConfig:
    f = "Dream"
    _expect(cfg, "hidden_act", ("silu",), "silu", f)
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling not in (None, {}) and (rope_scaling or {}).get("rope_type", rope_scaling.get("type")) != "default":
        raise ConfigError(f"Dream config: rope_scaling={rope_scaling!r} is not supported")
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"Dream config: use_sliding_window={cfg['use_sliding_window']!r} is not supported")
    d_model = int(_require(cfg, "hidden_size", f))
    n_heads = int(_require(cfg, "num_attention_heads", f))
    if d_model % n_heads:
        raise ConfigError(f"Dream config: hidden_size={d_model} is not a multiple of num_attention_heads={n_heads}")
    head_dim = int(cfg.get("head_dim") or d_model // n_heads)
    eos = cfg.get("eos_token_id", 151643)
    if isinstance(eos, list):
        eos = eos[0]
    return ModelConfig(
        family="dream",
        vocab_size=int(_require(cfg, "vocab_size", f)),
        d_model=d_model,
        n_layers=int(_require(cfg, "num_hidden_layers", f)),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        mlp_hidden=int(_require(cfg, "intermediate_size", f)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_fp32=False,
        qkv_bias=True,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=int(cfg.get("max_position_embeddings", 32768)),
        mask_token_id=int(cfg.get("mask_token_id", 151666)),
        eos_token_id=int(eos),
        pad_token_id=int(cfg.get("pad_token_id", 151643)),
        bos_token_id=cfg.get("bos_token_id"),
        dtype=dtype,
    )
