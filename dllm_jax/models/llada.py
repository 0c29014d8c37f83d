"""LLaDA (8B Base/Instruct, 1.5): OLMo-style names under `model.transformer.`."""

from __future__ import annotations

from typing import Any

from dllm_jax.config import ModelConfig
from dllm_jax.models.base import ParamMapping
from dllm_jax.models.base import TensorRule as R

_P = "model.transformer."


def rules(c: ModelConfig) -> tuple[R, ...]:
    t = [
        R(_P + "wte.weight", ("embed",), False),
        R(_P + "ln_f.weight", ("final_norm", "scale"), False),
        R(_P + "blocks.{i}.attn_norm.weight", ("layers", "attn_norm", "scale"), False),
        R(_P + "blocks.{i}.q_proj.weight", ("layers", "q_proj", "kernel"), True),
        R(_P + "blocks.{i}.k_proj.weight", ("layers", "k_proj", "kernel"), True),
        R(_P + "blocks.{i}.v_proj.weight", ("layers", "v_proj", "kernel"), True),
        R(_P + "blocks.{i}.attn_out.weight", ("layers", "o_proj", "kernel"), True),
        R(_P + "blocks.{i}.ff_norm.weight", ("layers", "ffn_norm", "scale"), False),
        R(_P + "blocks.{i}.ff_proj.weight", ("layers", "mlp", "gate_proj", "kernel"), True),  # the SiLU gate
        R(_P + "blocks.{i}.up_proj.weight", ("layers", "mlp", "up_proj", "kernel"), True),
        R(_P + "blocks.{i}.ff_out.weight", ("layers", "mlp", "down_proj", "kernel"), True),
    ]
    if c.qkv_bias:
        t += [R(_P + f"blocks.{{i}}.{n}_proj.bias", ("layers", f"{n}_proj", "bias"), False) for n in "qkv"]
    if not c.tie_embeddings:
        t.append(R(_P + "ff_out.weight", ("lm_head",), True))
    return tuple(t)


def hf_config(c: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "llada",
        "architectures": ["LLaDAModelLM"],
        "block_type": "llama",
        "activation_type": "silu",
        "layer_norm_type": "rms",
        "rms_norm_eps": c.rms_eps,
        "rope": True,
        "rope_full_precision": c.rope_fp32,
        "rope_theta": c.rope_theta,
        "alibi": False,
        "attention_layer_norm": False,
        "input_emb_norm": False,
        "scale_logits": False,
        "d_model": c.d_model,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads,
        "n_layers": c.n_layers,
        "mlp_hidden_size": c.mlp_hidden,
        "mlp_ratio": max(1, c.mlp_hidden // c.d_model),
        "vocab_size": c.vocab_size,
        "embedding_size": c.vocab_size,
        "max_sequence_length": c.max_seq_len,
        "weight_tying": c.tie_embeddings,
        "include_bias": False,
        "include_qkv_bias": c.qkv_bias,
        "bias_for_layer_norm": False,
        "mask_token_id": c.mask_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "precision": "amp_bf16",
        **({"bos_token_id": c.bos_token_id} if c.bos_token_id is not None else {}),
    }


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

FAMILY = ParamMapping("llada", rules, hf_config, CHAT_TEMPLATE, oracle="LlamaForCausalLM")
