"""Dream (v0 7B Base/Instruct): Qwen2 names (`model.layers.{i}.self_attn...`), q/k/v biases, GQA."""

from __future__ import annotations

from typing import Any

from dllm_jax.config import ModelConfig
from dllm_jax.models.base import ParamMapping
from dllm_jax.models.base import TensorRule as R

_L = "model.layers.{i}."


def rules(c: ModelConfig) -> tuple[R, ...]:
    t = [
        R("model.embed_tokens.weight", ("embed",), False),
        R("model.norm.weight", ("final_norm", "scale"), False),
        R(_L + "input_layernorm.weight", ("layers", "attn_norm", "scale"), False),
        R(_L + "self_attn.q_proj.weight", ("layers", "q_proj", "kernel"), True),
        R(_L + "self_attn.k_proj.weight", ("layers", "k_proj", "kernel"), True),
        R(_L + "self_attn.v_proj.weight", ("layers", "v_proj", "kernel"), True),
        R(_L + "self_attn.q_proj.bias", ("layers", "q_proj", "bias"), False),
        R(_L + "self_attn.k_proj.bias", ("layers", "k_proj", "bias"), False),
        R(_L + "self_attn.v_proj.bias", ("layers", "v_proj", "bias"), False),
        R(_L + "self_attn.o_proj.weight", ("layers", "o_proj", "kernel"), True),
        R(_L + "post_attention_layernorm.weight", ("layers", "ffn_norm", "scale"), False),
        R(_L + "mlp.gate_proj.weight", ("layers", "mlp", "gate_proj", "kernel"), True),
        R(_L + "mlp.up_proj.weight", ("layers", "mlp", "up_proj", "kernel"), True),
        R(_L + "mlp.down_proj.weight", ("layers", "mlp", "down_proj", "kernel"), True),
    ]
    if not c.tie_embeddings:
        t.append(R("lm_head.weight", ("lm_head",), True))
    return tuple(t)


def hf_config(c: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "Dream",
        "architectures": ["DreamModel"],
        "hidden_act": "silu",
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "intermediate_size": c.mlp_hidden,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "max_position_embeddings": c.max_seq_len,
        "mask_token_id": c.mask_token_id,
        "pad_token_id": c.pad_token_id,
        "eos_token_id": c.eos_token_id,
        "rope_scaling": None,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        **({"bos_token_id": c.bos_token_id} if c.bos_token_id is not None else {}),
    }


CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FAMILY = ParamMapping("dream", rules, hf_config, CHAT_TEMPLATE, oracle="Qwen2ForCausalLM")
