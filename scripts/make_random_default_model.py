"""Write the placeholder bundled model: random weights in the exact LLaDA HF layout + a byte-level tokenizer.

Superseded by the trained demo model (bench/train_demo.py) once it exists; kept because it documents the minimal
LLaDA-layout directory the engine accepts. Run from the repo root: python scripts/make_random_default_model.py OUT
"""

import sys

import jax

from dllm_jax import byte_tokenizer, checkpoint
from dllm_jax.config import ModelConfig
from dllm_jax.modeling import init_params


def main(out: str) -> None:
    tok = byte_tokenizer.build(byte_tokenizer.LLADA_SPECIALS)
    v = tok.get_vocab()
    config = ModelConfig(family="llada", vocab_size=272, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4,
                         head_dim=32, mlp_hidden=384, rms_eps=1e-5, rope_theta=10000.0, rope_fp32=True,
                         qkv_bias=False, tie_embeddings=False, max_seq_len=1024,
                         mask_token_id=v["<|mdm_mask|>"], eos_token_id=v["<|endoftext|>"],
                         pad_token_id=v["<|endoftext|>"], bos_token_id=v["<|startoftext|>"], dtype="float32")
    params = init_params(config, jax.random.key(0))
    checkpoint.export_hf(params, config, out)
    byte_tokenizer.write(out, "llada")


if __name__ == "__main__":
    main(sys.argv[1])
