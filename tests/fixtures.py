"""Tiny checkpoints in the exact HF release layouts of LLaDA and Dream, built deterministically from a seed.

Only numpy, ml_dtypes and safetensors are used here (no jax, no torch), so that the golden-output script
(`tests/oracle/make_goldens.py`, run in an environment with torch) and the test suite build bit-identical
checkpoints. Sizes are deliberately odd (not powers of two) and cover GQA, Dream's q/k/v biases, and tied and
untied heads.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

# name -> family, sizes. head_dim = hidden / heads.
SPECS: dict[str, dict] = {
    "llada": dict(
        family="llada", vocab=101, d=60, heads=5, kv=5, layers=3, mlp=84, tied=False, theta=500000.0, eps=1e-5
    ),
    "llada_gqa_tied": dict(
        family="llada", vocab=97, d=48, heads=6, kv=2, layers=2, mlp=72, tied=True, theta=10000.0, eps=1e-5
    ),
    "dream": dict(family="dream", vocab=103, d=56, heads=7, kv=1, layers=3, mlp=90, tied=False, theta=1e6, eps=1e-6),
    "dream_tied": dict(family="dream", vocab=89, d=48, heads=4, kv=2, layers=2, mlp=66, tied=True, theta=1e6, eps=1e-6),
}
# tensor-parallel fixtures: heads, KV heads, FFN width and vocabulary divisible by 8 (host devices in the tests)
TP_SPECS: dict[str, dict] = {
    "llada_tp": dict(
        family="llada", vocab=128, d=64, heads=8, kv=8, layers=2, mlp=128, tied=False, theta=10000.0, eps=1e-5
    ),
    "dream_tp": dict(
        family="dream", vocab=136, d=64, heads=16, kv=8, layers=2, mlp=96, tied=False, theta=1e6, eps=1e-6
    ),
    "llada_fp8_tp": dict(
        family="llada", vocab=128, d=128, heads=8, kv=8, layers=3, mlp=256, tied=False, theta=10000.0, eps=1e-5
    ),
}
MASK_OFFSET = 1  # mask id = vocab - 1, eos = vocab - 2, bos = vocab - 3


def special_ids(spec: dict) -> dict[str, int]:
    v = spec["vocab"]
    return {"mask": v - 1, "eos": v - 2, "bos": v - 3}


def hf_config(spec: dict) -> dict:
    s, ids = spec, special_ids(spec)
    if s["family"] == "llada":
        return {
            "model_type": "llada",
            "architectures": ["LLaDAModelLM"],
            "block_type": "llama",
            "activation_type": "silu",
            "layer_norm_type": "rms",
            "rms_norm_eps": s["eps"],
            "rope": True,
            "rope_full_precision": True,
            "rope_theta": s["theta"],
            "alibi": False,
            "attention_layer_norm": False,
            "input_emb_norm": False,
            "scale_logits": False,
            "d_model": s["d"],
            "n_heads": s["heads"],
            "n_kv_heads": s["kv"],
            "n_layers": s["layers"],
            "mlp_hidden_size": s["mlp"],
            "mlp_ratio": 4,
            "vocab_size": s["vocab"],
            "embedding_size": s["vocab"],
            "max_sequence_length": 256,
            "weight_tying": s["tied"],
            "include_bias": False,
            "include_qkv_bias": False,
            "bias_for_layer_norm": False,
            "mask_token_id": ids["mask"],
            "eos_token_id": ids["eos"],
            "pad_token_id": ids["eos"],
            "bos_token_id": ids["bos"],
            "precision": "amp_bf16",
        }
    return {
        "model_type": "Dream",
        "architectures": ["DreamModel"],
        "hidden_act": "silu",
        "hidden_size": s["d"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"],
        "intermediate_size": s["mlp"],
        "vocab_size": s["vocab"],
        "rms_norm_eps": s["eps"],
        "rope_theta": s["theta"],
        "tie_word_embeddings": s["tied"],
        "max_position_embeddings": 256,
        "mask_token_id": ids["mask"],
        "pad_token_id": ids["eos"],
        "eos_token_id": ids["eos"],
        "bos_token_id": ids["bos"],
        "rope_scaling": None,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    }


def hf_tensors(spec: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, PyTorch layout [out, in], bf16, in the family's exact key names."""
    s = spec
    rng = np.random.default_rng(seed)
    d, hd = s["d"], s["d"] // s["heads"]
    kvd = s["kv"] * hd

    def w(*shape, std=0.15):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm():
        return (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    if s["family"] == "llada":
        p = "model.transformer."
        t[p + "wte.weight"] = w(s["vocab"], d, std=1.0)
        for i in range(s["layers"]):
            b = f"{p}blocks.{i}."
            t[b + "attn_norm.weight"] = norm()
            t[b + "q_proj.weight"] = w(d, d)
            t[b + "k_proj.weight"] = w(kvd, d)
            t[b + "v_proj.weight"] = w(kvd, d)
            t[b + "attn_out.weight"] = w(d, d)
            t[b + "ff_norm.weight"] = norm()
            t[b + "ff_proj.weight"] = w(s["mlp"], d)
            t[b + "up_proj.weight"] = w(s["mlp"], d)
            t[b + "ff_out.weight"] = w(d, s["mlp"])
        t[p + "ln_f.weight"] = norm()
        if not s["tied"]:
            t[p + "ff_out.weight"] = w(s["vocab"], d)
    else:
        t["model.embed_tokens.weight"] = w(s["vocab"], d, std=1.0)
        for i in range(s["layers"]):
            b = f"model.layers.{i}."
            t[b + "input_layernorm.weight"] = norm()
            t[b + "self_attn.q_proj.weight"] = w(d, d)
            t[b + "self_attn.q_proj.bias"] = w(d, std=0.3)
            t[b + "self_attn.k_proj.weight"] = w(kvd, d)
            t[b + "self_attn.k_proj.bias"] = w(kvd, std=0.3)
            t[b + "self_attn.v_proj.weight"] = w(kvd, d)
            t[b + "self_attn.v_proj.bias"] = w(kvd, std=0.3)
            t[b + "self_attn.o_proj.weight"] = w(d, d)
            t[b + "post_attention_layernorm.weight"] = norm()
            t[b + "mlp.gate_proj.weight"] = w(s["mlp"], d)
            t[b + "mlp.up_proj.weight"] = w(s["mlp"], d)
            t[b + "mlp.down_proj.weight"] = w(d, s["mlp"])
        t["model.norm.weight"] = norm()
        if not s["tied"]:
            t["lm_head.weight"] = w(s["vocab"], d)
    return {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}


def oracle_inputs(spec: dict, seed: int = 1, batch: int = 2, length: int = 13) -> np.ndarray:
    """Token ids the golden logits were computed on (no mask/eos tokens, to keep them ordinary)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, spec["vocab"] - 3, size=(batch, length)).astype(np.int64)


def tensors_digest(tensors: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(np.ascontiguousarray(tensors[k]).view(np.uint8).tobytes())
    return h.hexdigest()


def write_checkpoint(name: str, out_dir: str | Path, shard_bytes: int | None = None, seed: int = 0) -> Path:
    """Write fixture `name` as an HF release directory (config.json + safetensors, sharded if asked)."""
    spec = {**SPECS, **TP_SPECS}[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(spec, seed)
    if shard_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        shards: list[dict] = [{}]
        size = 0
        for k, v in tensors.items():
            if size + v.nbytes > shard_bytes and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += v.nbytes
        weight_map = {}
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(sh, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in sh})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    return out


def write_tokenizer(family: str, out_dir: str | Path) -> None:
    """Byte-level tokenizer files in the family's release layout (its own ids: bytes 0..255, specials 256..)."""
    from dllm_jax.io import byte_tokenizer

    byte_tokenizer.write(out_dir, family)


def fp8_config(**overrides):
    """The tiny ModelConfig of the FP8 tests (d_model and mlp_hidden: multiples of the FP8 kernels' 128 tiles)."""
    from dllm_jax.config import ModelConfig  # imported here, as above: the checkpoint fixtures need no jax

    kw = dict(family="llada", vocab_size=300, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32)
    kw |= dict(mlp_hidden=256, rms_eps=1e-5, rope_theta=1e4, rope_fp32=True, qkv_bias=False, tie_embeddings=False)
    kw |= dict(max_seq_len=128, mask_token_id=299, eos_token_id=298, pad_token_id=298)
    return ModelConfig(**kw | overrides)


def decode_inputs(model, gc, prompts, spans=None):
    """generate's token buffer and fixed inputs for these prompts, on XLA's kernels: what a cache strategy takes."""
    import jax.numpy as jnp

    from dllm_jax.decoding.caches.base import DecodeInputs
    from dllm_jax.decoding.generate import layout
    from dllm_jax.transformer import XLA

    x, positions, key_mask, frozen, p = layout(prompts, model.config, gc, spans)
    shift = 1 if model.config.family == "dream" else 0
    masks = jnp.asarray(positions), jnp.asarray(key_mask), jnp.asarray(frozen)
    return jnp.asarray(x), DecodeInputs(*masks, p, gc.schedule.block_length, shift, XLA)


def solo_text(model, prompt_ids, config, affix_tokens=None, build=None, max_tokens=None) -> str:
    """The answer text of one request decoded alone by `generate` (the server's answers must equal it); affix_tokens:
    shared through `build` (ACache's `build_shared_affix` by default) where they sit in the prompt."""
    from dllm_jax import answer_tokens, generate
    from dllm_jax.decoding.caches import acache

    shared = spans = None
    if affix_tokens is not None:
        shared = (build or acache.build_shared_affix)(model.params, model.config, affix_tokens)
        at = next(i for i in range(len(prompt_ids)) if prompt_ids[i : i + len(affix_tokens)] == affix_tokens)
        spans = [(at, at + len(affix_tokens))]
    out = generate(model, [prompt_ids], config, shared_affix=shared, affix_spans=spans)
    return model.tokenizer.decode(answer_tokens(out.tokens, model.config, config)[0][:max_tokens])


def subprocess_env(optimized: bool = False, host_devices: int = 0) -> dict[str, str]:
    """The environment of a command the tests start: this one's without PYTHONPATH (the installed package runs);
    optimized: with XLA's CPU optimisations back on (conftest turns them off for the suite's compile-bound tests;
    a process that mostly runs its programs, many calls at larger shapes, is about twice as fast with them);
    host_devices: XLA's CPU split into that many devices (the tensor-parallel tests)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if optimized:
        off = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
        env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f not in off)
    if host_devices:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={host_devices}"
    return env


def start_server(*flags: str, optimized: bool = False, env: dict[str, str] | None = None):
    """`dllm-jax serve --port 0 FLAGS` in a subprocess (the installed package, not this checkout's PYTHONPATH):
    (the process, its base URL read from the line it prints at start). Unless FLAGS name one, the server uses the
    run's compilation cache (conftest), not the user's: servers with the same settings load each other's programs.
    optimized: XLA's CPU backend optimises its programs (conftest turns that off for the suite's compile-bound
    tests; a server that runs hundreds of calls is faster with it: 20 s instead of 47 for the soak's). env: variables
    added to its environment."""
    import re
    import subprocess
    import sys

    import jax

    if not any(f in ("--compile-cache", "--no-compile-cache") for f in flags) and jax.config.jax_compilation_cache_dir:
        flags = (*flags, "--compile-cache", jax.config.jax_compilation_cache_dir)

    env = {**subprocess_env(optimized), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dllm_jax.cli", "serve", "--port", "0", *flags],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    seen = ""
    for _ in range(20):  # the line follows the model's loading bar when loading is slow
        line = proc.stderr.readline()
        seen += line
        found = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        if found is not None or not line:
            break
    if found is None:
        proc.kill()
        raise AssertionError(f"dllm-jax serve did not start: {seen[-2000:]}{proc.stderr.read()[-2000:]}")
    proc.start_line = line  # what it printed with the URL (a cluster's also names its Ray cluster's address)
    return proc, found.group(1)


def drain_stderr(proc) -> list[str]:
    """Read a server's stderr as it comes (the warm-up's bar would fill the pipe and block it otherwise): the list
    its lines are appended to."""
    import threading

    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return lines


# a lookup document of the bundled model's task and its keys (the server's and the audit's tests ask about it)
LOOKUP_DOC = (
    "document : the code of rabbit is 6 3 9 . the code of feather is 1 8 5 . the code of yogurt is 4 3 1 . the "
    "code of wizard is 0 3 0 . the code of bottle is 2 1 6 . the code of compass is 4 2 8 ."
)
LOOKUP_KEYS = ["rabbit", "feather", "yogurt", "wizard", "bottle", "compass"]
