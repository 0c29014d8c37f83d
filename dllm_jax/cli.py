"""`dllm-jax` command line: generate text with a LLaDA/Dream checkpoint (the bundled default model if none)."""

from __future__ import annotations

import argparse
import sys


# A held-out problem of the bundled demo model's "rule" task (in-context function learning: here 9 - digit).
DEMO_PROMPT = ("rule examples : 7 4 0 -> 2 5 9 ; 3 6 8 -> 6 3 1 ; 6 5 2 -> 3 4 7 ; 4 3 4 -> 5 6 5 ; 0 4 1 -> 9 5 8 ; "
               "input : 8 9 5 what does the rule give ?")


def _model_generation_defaults(path) -> dict:
    """gen_length / block_length / steps defaults from the model's generation_config.json (HF's file; we read
    max_new_tokens, block_length and steps): a model trained on short answers (the bundled demo model answers in
    8 tokens) says so there, so the plain command works without flags."""
    import json

    f = path / "generation_config.json" if path else None
    if f is None or not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for ours, theirs in (("gen_length", "max_new_tokens"), ("block_length", "block_length"), ("steps", "steps")):
        if isinstance(cfg.get(theirs), int) and cfg[theirs] > 0:
            out[ours] = cfg[theirs]
    return out


def _generate(args: argparse.Namespace) -> int:
    import dllm_jax
    from dllm_jax.generate import GenerationConfig, answer_tokens, generate

    try:
        model = dllm_jax.load(args.model, dtype=args.dtype, progress=True)
    except (dllm_jax.CheckpointError, dllm_jax.ConfigError, FileNotFoundError) as e:
        print(f"dllm-jax: error: {e}", file=sys.stderr)
        return 2
    if model.tokenizer is None:
        print(f"dllm-jax: error: {model.path} has no tokenizer files (tokenizer.json or vocab.json+merges.txt)",
              file=sys.stderr)
        return 2
    notice = model.path / "NOTICE.txt" if model.path else None
    if notice is not None and notice.is_file():
        print(f"note: {notice.read_text().strip()}", file=sys.stderr)
    texts = args.prompt or [DEMO_PROMPT]
    if args.raw:
        prompts = [model.tokenizer.encode(t) for t in texts]
    else:
        prompts = [model.encode_chat(t) for t in texts]
    defaults = _model_generation_defaults(model.path)
    gen_length = args.gen_length or defaults.get("gen_length", 32)
    block = min(args.block_length or defaults.get("block_length", 32), gen_length)
    steps = args.steps or (defaults.get("steps") if not args.gen_length else None) or gen_length
    gc = GenerationConfig(gen_length=gen_length, block_length=block, steps=steps,
                          temperature=args.temperature, threshold=args.threshold, cache=args.cache,
                          attention_backend=args.attention)
    try:
        gc.validate(model.config)
        out = generate(model, prompts, gc, seed=args.seed)
    except ValueError as e:
        print(f"dllm-jax: error: {e}", file=sys.stderr)
        return 2
    for text, ids in zip(texts, answer_tokens(out.tokens, model.config, gc)):
        if len(texts) > 1:
            print(f"> {text}")
        text = model.tokenizer.decode(ids)
        print(text if text.strip() else f"(no printable text; token ids {ids})")
    n_tokens = sum(len(a) for a in answer_tokens(out.tokens, model.config, gc))
    print(f"[{model.config.family} from {model.path}; cache={gc.cache}; NFE {out.nfe}; "
          f"{out.seconds:.2f} s incl. compile; {n_tokens} answer tokens]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dllm-jax", description="Diffusion language model inference in JAX.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate an answer for a prompt or chat message")
    g.add_argument("prompt", nargs="*", help="user message(s); several make a batch (default: a demo question)")
    g.add_argument("--model", default=None, help="converted or HF-layout directory (default: the bundled model)")
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, without the chat template")
    g.add_argument("--gen-length", type=int, default=None,
                   help="tokens to generate (default: the model's generation_config.json max_new_tokens, else 32)")
    g.add_argument("--block-length", type=int, default=None,
                   help="semi-autoregressive block (default: the model's generation_config.json, else 32)")
    g.add_argument("--steps", type=int, default=None,
                   help="denoising steps (default: the model's generation_config.json, else gen-length)")
    g.add_argument("--threshold", type=float, default=None, help="Fast-dLLM parallel decoding threshold, e.g. 0.9")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--cache", choices=["none", "first_layer", "prefix", "dual"], default="dual")
    g.add_argument("--attention", choices=["auto", "xla", "cudnn", "pallas", "cudnn_pallas"], default="auto")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    g.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
