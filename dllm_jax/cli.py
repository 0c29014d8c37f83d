"""`dllm-jax` command line: `generate` text with a LLaDA/Dream checkpoint (the bundled default model if none).

Bad input (a flag out of range, a backend this machine cannot run, a missing or malformed model directory) is
one line on stderr naming the flag or file, exit status 2, before any device work; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# A held-out problem of the bundled demo model's "rule" task (in-context function learning: here 9 - digit).
DEMO_PROMPT = ("rule examples : 7 4 0 -> 2 5 9 ; 3 6 8 -> 6 3 1 ; 6 5 2 -> 3 4 7 ; 4 3 4 -> 5 6 5 ; 0 4 1 -> 9 5 8 ; "
               "input : 8 9 5 what does the rule give ?")
PROG = "dllm-jax"


class UsageError(Exception):
    """Bad input from the command line: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of argparse's usage + error
        raise UsageError(message)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def model_generation_defaults(path: Path | None) -> dict:
    """gen_length / block_length / steps defaults from the model's generation_config.json (HF's file; we read
    max_new_tokens, block_length and steps): a model trained on short answers (the bundled demo model answers in 8
    tokens) says so there, so the plain command works without flags."""
    f = path / "generation_config.json" if path else None
    if f is None or not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{f} is not valid JSON: {e}") from None
    out = {}
    for ours, theirs in (("gen_length", "max_new_tokens"), ("block_length", "block_length"), ("steps", "steps")):
        if isinstance(cfg.get(theirs), int) and cfg[theirs] > 0:
            out[ours] = cfg[theirs]
    return out


def generation_config(args: argparse.Namespace, defaults: dict):
    """The GenerationConfig the flags ask for (flags over the model's defaults over ours)."""
    from dllm_jax import GenerationConfig

    gen_length = args.gen_length or defaults.get("gen_length", 32)
    block = min(args.block_length or defaults.get("block_length", 32), gen_length)
    steps = args.steps or (defaults.get("steps") if not args.gen_length else None) or gen_length
    if gen_length % block:
        raise UsageError(f"argument --gen-length: {gen_length} is not a multiple of the block length {block}")
    n_blocks = gen_length // block
    if args.threshold is None and (steps % n_blocks or steps > gen_length):
        raise UsageError(f"argument --steps: {steps} must be a multiple of the number of blocks ({n_blocks}) and at "
                         f"most --gen-length {gen_length}")
    return GenerationConfig.from_options(gen_length=gen_length, block_length=block, steps=steps,
                                         threshold=args.threshold, temperature=args.temperature, cache=args.cache,
                                         attention=args.attention)


def run_generate(args: argparse.Namespace) -> int:
    import dllm_jax
    from dllm_jax import KernelChoice, answer_tokens, generate

    try:
        KernelChoice(attention=args.attention).check_device()
    except ValueError as e:
        raise UsageError(f"argument --attention: {e}") from None
    try:
        model = dllm_jax.load(args.model, dtype=args.dtype, progress=True)
    except (dllm_jax.CheckpointError, dllm_jax.ConfigError, FileNotFoundError) as e:
        raise UsageError(str(e).splitlines()[0] if not args.debug else str(e)) from e
    if model.tokenizer is None:
        raise UsageError(f"{model.path} has no tokenizer files (tokenizer.json or vocab.json + merges.txt)")
    notice = model.path / "NOTICE.txt" if model.path else None
    if args.verbose and notice is not None and notice.is_file():
        print(f"note: {notice.read_text().strip()}", file=sys.stderr)
    gc = generation_config(args, model_generation_defaults(model.path))
    texts = args.prompt or [DEMO_PROMPT]
    prompts = [model.tokenizer.encode(t) if args.raw else model.encode_chat(t) for t in texts]
    try:
        out = generate(model, prompts, gc, seed=args.seed)
    except ValueError as e:
        raise UsageError(str(e)) from e
    answers = answer_tokens(out.tokens, model.config, gc)
    for text, ids in zip(texts, answers):
        if len(texts) > 1:
            print(f"> {text}")
        decoded = model.tokenizer.decode(ids)
        print(decoded if decoded.strip() else f"(no printable text; token ids {ids})")
    if args.verbose:
        print(f"[{model.config.family} from {model.path}; cache={gc.cache.mode}; NFE {out.nfe}; "
              f"{out.seconds:.2f} s incl. compile; {sum(map(len, answers))} answer tokens]", file=sys.stderr)
    return 0


def build_parser() -> Parser:
    ap = Parser(prog=PROG, description="Diffusion language model inference in JAX (LLaDA, Dream).")
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser, help="what to run")
    g = sub.add_parser("generate", help="generate an answer for a prompt or chat message")
    g.add_argument("prompt", nargs="*", help="user message(s); several make a batch (default: a demo question)")
    g.add_argument("--model", default=None, help="converted or HF-layout directory (default: the bundled model)")
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, without the chat template")
    g.add_argument("--gen-length", type=positive_int, default=None,
                   help="tokens to generate (default: the model's generation_config.json max_new_tokens, else 32)")
    g.add_argument("--block-length", type=positive_int, default=None,
                   help="semi-autoregressive block length (default: the model's generation_config.json, else 32)")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="denoising steps over the whole answer (default: the model's generation_config.json, else "
                        "--gen-length: one token per step)")
    g.add_argument("--threshold", type=probability, default=None,
                   help="Fast-dLLM parallel decoding: commit every token whose confidence is at least this, e.g. 0.9 "
                        "(--steps is then ignored)")
    g.add_argument("--temperature", type=non_negative, default=0.0, help="sampling temperature of the model family's sampler (0: greedy, the default)")
    g.add_argument("--cache", choices=["none", "first_layer", "prefix", "dual"], default="dual",
                   help="K/V cache: dual (Fast-dLLM, the default), prefix, first_layer (LaCache's exact memo) or none")
    g.add_argument("--attention", choices=["auto", "xla", "cudnn", "pallas", "cudnn_pallas"], default="auto",
                   help="attention kernel (auto: cuDNN + the Pallas kernel on a GPU, XLA elsewhere)")
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and activations")
    g.add_argument("--seed", type=int, default=0, help="random seed (matters only with --temperature > 0)")
    g.add_argument("--verbose", action="store_true", help="print the model's notice and a timing line on stderr")
    g.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return run_generate(args)
    except UsageError as e:
        if debug:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
