"""Re-runnable: compute the independent-oracle logits the test suite compares against.

The oracle is `transformers`' LlamaForCausalLM (for LLaDA) and Qwen2ForCausalLM (for Dream) in fp32, eager
attention, called with an all-zero additive 4-D mask so that attention is bidirectional. Weights come from the
same deterministic fixtures the tests build (tests/fixtures.py); the renaming below is written from the published
layouts, independently of the engine's own mapping tables.

Needs torch + transformers + numpy + ml_dtypes + safetensors (NOT jax). The CI venv has no torch (its Linux wheel
is several GB), so the outputs are committed under tests/goldens/. Run from the repo root:
    python tests/oracle/make_goldens.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fixtures  # noqa: E402

LLADA_TO_LLAMA = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}


def llada_state_dict(t: dict) -> dict:
    out = {}
    for k, v in t.items():
        k = k.removeprefix("model.transformer.")
        if k == "wte.weight":
            out["model.embed_tokens.weight"] = v
        elif k == "ln_f.weight":
            out["model.norm.weight"] = v
        elif k == "ff_out.weight":
            out["lm_head.weight"] = v
        else:
            _, i, name, param = k.split(".")
            out[f"model.layers.{i}.{LLADA_TO_LLAMA[name]}.{param}"] = v
    return out


def oracle(name: str) -> tuple[np.ndarray, np.ndarray]:
    spec = fixtures.SPECS[name]
    tensors = {k: torch.from_numpy(v.astype(np.float32)) for k, v in fixtures.hf_tensors(spec).items()}
    common = dict(
        vocab_size=spec["vocab"],
        hidden_size=spec["d"],
        intermediate_size=spec["mlp"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv"],
        head_dim=spec["d"] // spec["heads"],
        rms_norm_eps=spec["eps"],
        rope_theta=spec["theta"],
        max_position_embeddings=256,
        tie_word_embeddings=spec["tied"],
        hidden_act="silu",
        attn_implementation="eager",
        torch_dtype=torch.float32,
    )
    if spec["family"] == "llada":
        model = LlamaForCausalLM(LlamaConfig(attention_bias=False, mlp_bias=False, **common))
        sd = llada_state_dict(tensors)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, **common))
        sd = dict(tensors)
    if spec["tied"]:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    model = model.float().eval()
    ids = fixtures.oracle_inputs(spec)
    b, length = ids.shape
    with torch.no_grad():
        mask = torch.zeros(b, 1, length, length, dtype=torch.float32)  # 4-D additive zeros: bidirectional
        logits = model(input_ids=torch.from_numpy(ids), attention_mask=mask).logits
    return ids, logits.numpy().astype(np.float32)


def main() -> None:
    out_dir = Path(__file__).resolve().parents[1] / "goldens"
    out_dir.mkdir(exist_ok=True)
    for name in fixtures.SPECS:
        ids, logits = oracle(name)
        digest = fixtures.tensors_digest(fixtures.hf_tensors(fixtures.SPECS[name]))
        np.savez_compressed(
            out_dir / f"{name}.npz", ids=ids, logits=logits, digest=np.array(digest), torch=np.array(torch.__version__)
        )
        print(f"{name}: logits {logits.shape}, |logits| mean {np.abs(logits).mean():.3f}, digest {digest[:12]}")


if __name__ == "__main__":
    main()
