"""`dllm-jax` command line: `generate` text with a LLaDA/Dream checkpoint (the bundled default model if none), or
`serve` it over an OpenAI-compatible HTTP API.

Bad input (a flag out of range, a backend this machine cannot run, a missing or malformed model directory) is
one line on stderr naming the flag or file, exit status 2, before any device work; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dllm_jax.config import ModelConfig
    from dllm_jax.engine.engine import EngineConfig
    from dllm_jax.io.loading import Model

# A held-out problem of the bundled demo model's "rule" task (in-context function learning: here 9 - digit).
DEMO_PROMPT = (
    "rule examples : 7 4 0 -> 2 5 9 ; 3 6 8 -> 6 3 1 ; 6 5 2 -> 3 4 7 ; 4 3 4 -> 5 6 5 ; 0 4 1 -> 9 5 8 ; "
    "input : 8 9 5 what does the rule give ?"
)
PROG = "dllm-jax"


class UsageError(Exception):
    """Bad input from the command line: reported as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of argparse's usage + error
        raise UsageError(message)


def _checked(kind: type, bad: Callable[[Any], bool], want: str) -> Callable[[str], Any]:
    """An argparse type: the text as `kind`, refused (as "must be `want`") where `bad` holds."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if bad(value):
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value

    return parse


# `bad` rather than `ok` so that NaN goes where it always went (refused as a probability, taken as >= 0)
positive_int = _checked(int, lambda v: v <= 0, "a positive integer")
probability = _checked(float, lambda v: not 0.0 < v <= 1.0, "in (0, 1]")
non_negative = _checked(float, lambda v: v < 0, ">= 0")
positive = _checked(float, lambda v: not v > 0, "positive")
unit_interval = _checked(float, lambda v: not 0.0 <= v <= 1.0, "in [0, 1]")


def ratio_or_auto(text: str) -> float | str:
    """An anchor ratio in [0, 1], or "auto"."""
    return "auto" if text == "auto" else unit_interval(text)


def depth_or_auto(text: str) -> int | str:
    """A BiCache depth >= 0, or "auto"."""
    return "auto" if text == "auto" else non_negative_int(text)


non_negative_int = _checked(int, lambda v: v < 0, ">= 0")


def compiler_option(text: str) -> tuple[str, Any]:
    """NAME=VALUE as an XLA option: true / false as booleans, numbers as numbers, anything else as text."""
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("xla_"):
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with an XLA option name (xla_...), got {text!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


def default_of(cls: type, field: str) -> Any:
    """A dataclass field's default: the flags that set ServeSettings / EngineConfig fields take theirs from there."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == field)


def default_compile_cache() -> Path:
    return Path.home() / ".cache" / "dllm-jax" / "xla"


def compile_cache_dir(args: argparse.Namespace) -> Path | None:
    """The persistent compilation cache's directory (None: --no-compile-cache). Checked here, not created: a path
    that is a file, or under one, or not writable is one line before any device work."""
    if args.no_compile_cache:
        return None
    if args.compile_cache is not None and not args.compile_cache.strip():
        raise UsageError(f"argument --compile-cache: expected a directory, got {args.compile_cache!r}")
    path = Path(args.compile_cache).expanduser() if args.compile_cache is not None else default_compile_cache()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"argument --compile-cache: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"argument --compile-cache: {existing} is not writable")
    return path


def compile_cache_flags(p: argparse.ArgumentParser, gain: str) -> None:
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help=f"jax's persistent compilation cache: {gain} (default: {default_compile_cache()})",
    )
    cache.add_argument("--no-compile-cache", action="store_true", help="compile every program, keeping nothing on disk")


def use_compile_cache(args: argparse.Namespace) -> None:
    """generate's persistent compilation cache: --compile-cache DIR (one line where it cannot be used); by default
    the user's directory, unless the process has a cache already (jax's own setting) or none can be made there (a
    read-only home: the answer comes without one); --no-compile-cache: none at all."""
    import jax

    from dllm_jax.compilation import enable_compile_cache

    explicit = args.compile_cache is not None
    if args.no_compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if not explicit and jax.config.jax_compilation_cache_dir:
        return
    try:
        enable_compile_cache(compile_cache_dir(args))
    except UsageError:
        if explicit:
            raise
    except OSError as e:  # checked, yet not made (a dangling link on its path, a race)
        if explicit:
            raise UsageError(f"argument --compile-cache: cannot use {args.compile_cache}: {e.strerror or e}") from None


def shallow_depths(args: argparse.Namespace, mc: ModelConfig) -> tuple[int, ...]:
    """The BiCache depths the engine warms: --shallow-depths, else those the server's default implies
    (--shallow-depth, else every depth of the model's published table when --affix-technique is shallow or
    --shallow-depth is auto)."""
    from dllm_jax.decoding.caches.bicache import DEPTH_TABLES

    auto = args.shallow_depth == "auto"
    fixed = None if auto else args.shallow_depth
    for flag, depths in (("--shallow-depths", args.shallow_depths or ()), ("--shallow-depth", [fixed])):
        for d in depths:
            if d is not None and d > mc.n_layers:
                raise UsageError(f"argument {flag}: {d} exceeds the model's {mc.n_layers} layers")
    table = DEPTH_TABLES.get((mc.family, mc.n_layers))
    if auto and args.shallow_depths is None and table is None:
        raise UsageError(
            f"argument --shallow-depth: auto calibrates among the served depths: name them with --shallow-depths "
            f"(this {mc.n_layers}-layer model has no published depth table)"
        )
    if auto and args.shallow_depths is not None and not any(args.shallow_depths):
        raise UsageError("argument --shallow-depth: auto needs a depth >= 1 among --shallow-depths")
    if args.affix_technique == "shallow" and args.shallow_depth is None and table is None:
        raise UsageError(
            f"argument --shallow-depth: --affix-technique shallow needs it on this {mc.n_layers}-layer model "
            "(BiCache's depth tables cover LLaDA-8B and Dream-7B)"
        )
    if args.shallow_depths is not None:
        if fixed is not None and fixed not in args.shallow_depths:
            served = " ".join(map(str, args.shallow_depths))
            raise UsageError(f"argument --shallow-depth: {fixed} is not among --shallow-depths {served}")
        return tuple(sorted(set(args.shallow_depths)))
    if fixed is not None:
        return (fixed,)
    if args.affix_technique == "shallow" or auto:
        return tuple(sorted(set(table.values())))
    return ()


def model_generation_defaults(path: Path | None) -> dict:
    from dllm_jax.io.checkpoint import CheckpointError
    from dllm_jax.io.loading import generation_defaults

    try:
        return generation_defaults(path)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def generation_config(args: argparse.Namespace, defaults: dict):
    """The GenerationConfig the flags ask for (flags over the model's defaults over ours)."""
    from dllm_jax import GenerationConfig

    gen_length = args.gen_length or defaults.get("gen_length", 32)
    block = min(args.block_length or defaults.get("block_length", 32), gen_length)
    steps = args.steps or (defaults.get("steps") if not args.gen_length else None) or gen_length
    if gen_length % block:
        raise UsageError(f"argument --gen-length: {gen_length} is not a multiple of the block length {block}")
    n_blocks = gen_length // block
    if args.threshold is None and args.factor is None and (steps % n_blocks or steps > gen_length):
        raise UsageError(
            f"argument --steps: {steps} must be a multiple of the number of blocks ({n_blocks}) and at "
            f"most --gen-length {gen_length}"
        )
    return GenerationConfig.from_options(
        gen_length=gen_length,
        block_length=block,
        steps=steps,
        threshold=args.threshold,
        factor=args.factor,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        cache=args.cache,
        attention=args.attention,
        batch_invariant=args.batch_invariant,
    )


def check_attention(args: argparse.Namespace) -> None:
    from dllm_jax import KernelChoice

    try:
        KernelChoice(attention=args.attention).check_device()
    except ValueError as e:
        raise UsageError(f"argument --attention: {e}") from None
    if args.batch_invariant and getattr(args, "cache", None) == "first_layer":
        raise UsageError(
            "argument --batch-invariant: not with --cache first_layer (LaCache's memo); use dual or prefix"
        )


def load_model(args: argparse.Namespace) -> Model:
    """--model (the bundled model if none) with its tokenizer; a bad directory is one line (all of it with --debug)."""
    import dllm_jax
    from dllm_jax.transformer.sharding import TensorParallelError

    if args.tensor_parallel > 1 and args.attention not in ("auto", "xla"):
        raise UsageError(f"argument --attention: --tensor-parallel runs XLA's attention, not {args.attention!r}")
    if args.weights == "fp8_all" and args.tensor_parallel > 1:
        raise UsageError("argument --weights: fp8_all runs on one device for now (not with --tensor-parallel)")
    try:
        model = dllm_jax.load(
            args.model,
            dtype=args.dtype,
            progress=True,
            tensor_parallel=args.tensor_parallel,
            weights=args.weights,
            fp8_first_layer=args.fp8_first_layer,
        )
    except TensorParallelError as e:
        raise UsageError(f"argument --tensor-parallel: {e}") from None
    except (dllm_jax.CheckpointError, dllm_jax.ConfigError, FileNotFoundError) as e:
        raise UsageError(str(e).splitlines()[0] if not args.debug else str(e)) from e
    except ValueError as e:  # weights the checkpoint cannot give (FP8 stored, bf16 asked)
        raise UsageError(f"argument --weights: {e}") from None
    if model.tokenizer is None:
        raise UsageError(f"{model.path} has no tokenizer files (tokenizer.json or vocab.json + merges.txt)")
    return model


def run_generate(args: argparse.Namespace) -> int:
    from dllm_jax import answer_tokens, generate

    check_attention(args)
    use_compile_cache(args)
    model = load_model(args)
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
        print(
            f"[{model.config.family} from {model.path}; cache={gc.cache.mode}; NFE {out.nfe}; "
            f"{out.seconds:.2f} s incl. compile; {sum(map(len, answers))} answer tokens]",
            file=sys.stderr,
        )
    return 0


def engine_config(args: argparse.Namespace, depths: tuple[int, ...] = ()) -> EngineConfig:
    """serve's EngineConfig; a value it refuses is one line naming the flag."""
    from dllm_jax.engine.engine import EngineConfig

    try:
        return EngineConfig(
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            attention=args.attention,
            kv_budget_bytes=None if args.kv_budget_gib is None else int(args.kv_budget_gib * (1 << 30)),
            max_model_len=args.max_model_len,
            block_lengths=None if args.block_lengths is None else tuple(args.block_lengths),
            shallow_depths=depths,
            batch_sizes=None if args.batch_sizes is None else tuple(args.batch_sizes),
            compiler_options=tuple(args.compiler_option or ()),
            batch_invariant=args.batch_invariant,
            **({} if args.window_chunk is None else dict(window_chunk=args.window_chunk)),
        )
    except ValueError as e:
        raise config_error(e) from None


def config_error(e: ValueError) -> UsageError:
    """An EngineConfig refusal as a usage error naming the flag that sets the field."""
    from dllm_jax.engine.engine import EngineConfig

    field = next((f.name for f in dataclasses.fields(EngineConfig) if f"EngineConfig.{f.name}" in str(e)), None)
    flag = {"kv_budget_bytes": "kv_budget_gib", "compiler_options": "compiler_option"}.get(field, field)
    return UsageError(f"argument --{flag.replace('_', '-')}: {e}" if flag else str(e))


@dataclasses.dataclass(frozen=True)
class ServeParts:
    """What `serve` builds an engine server from, every flag checked and the model loaded (one process, or each
    replica of a cluster: `dllm_jax.cluster`)."""

    model: Model
    config: EngineConfig
    settings: Any  # server.settings.ServeSettings
    options: dict  # server.run.build_service's keyword arguments


def check_serve_flags(args: argparse.Namespace) -> None:
    """What `serve` can refuse before the model loads (one line naming the flag)."""
    from dllm_jax.audit import AuditConfig, check_state

    check_attention(args)
    compile_cache_dir(args)
    engine_config(args)
    try:
        check_state(AuditConfig(fraction=args.audit_fraction, state_path=args.audit_state))
    except ValueError as e:
        raise UsageError(f"argument --audit-state: {e}") from None


def serve_parts(args: argparse.Namespace) -> ServeParts:
    """`serve`'s flags checked, its model loaded, and what `server.run.build_service` takes made from them."""
    from dllm_jax.audit import AuditConfig, CalibrationConfig
    from dllm_jax.server.settings import ServeSettings

    check_serve_flags(args)
    cache = compile_cache_dir(args)
    audit = AuditConfig(fraction=args.audit_fraction, state_path=args.audit_state)
    model = load_model(args)
    # BiCache's depths: checked here, once, rather than as a 400 on every request that takes the default
    config = engine_config(args, shallow_depths(args, model.config))
    name = args.model_name or (model.path.name if args.model else "dllm-jax-demo")
    settings = ServeSettings(
        model_name=name,
        api_key=args.api_key,
        temperature=args.temperature,
        affix_technique=args.affix_technique,
        anchor_ratio=args.anchor_ratio,
        shallow_depth=args.shallow_depth,
        request_timeout=args.request_timeout,
    )
    model_generation_defaults(model.path)  # a broken generation_config.json is one line here, not a 500 later
    options = dict(
        log_level="info" if args.verbose else "warning",
        compile_cache=cache,
        max_consecutive_faults=args.max_consecutive_faults,
        admission_wait=args.admission_wait,
        log_format=args.log_format,
        audit=audit,
        calibration=CalibrationConfig(target=args.agreement_target),
    )
    return ServeParts(model, config, settings, options)


def engine_start_error(e: ValueError, args: argparse.Namespace) -> UsageError:
    """What building the engine refused, as a usage error naming the flag."""
    from dllm_jax.engine.engine import KVBudgetError
    from dllm_jax.server.run import CompileCacheError

    if isinstance(e, KVBudgetError):
        return UsageError(f"argument --kv-budget-gib: {e}")
    if isinstance(e, CompileCacheError):
        return UsageError(f"argument --compile-cache: {e}")
    return config_error(e)  # what the engine checks against the model (a block as long as max_model_len)


def run_serve(args: argparse.Namespace) -> int:
    if args.replicas > 1:
        from dllm_jax.cluster.run import run_cluster

        return run_cluster(args)
    from dllm_jax.server.run import serve

    parts = serve_parts(args)
    try:
        return serve(
            parts.model,
            parts.config,
            parts.settings,
            args.host,
            args.port,
            drain_timeout=args.drain_timeout,
            **parts.options,
        )
    except ValueError as e:
        raise engine_start_error(e, args) from None
    except OSError as e:
        raise UsageError(f"argument --port: cannot listen on {args.host}:{args.port}: {e.strerror}") from None


def model_flags(p: argparse.ArgumentParser, attention: str, verbose: str) -> None:
    """The flags generate and serve share (their help says what `auto` and --verbose mean there)."""
    p.add_argument(
        "--attention",
        choices=["auto", "xla", "cudnn", "pallas", "cudnn_pallas"],
        default="auto",
        help=f"attention kernel (auto: {attention})",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and activations")
    p.add_argument(
        "--weights",
        choices=["bf16", "fp8_ffn", "fp8_all"],
        default=None,
        help="which linear layers run in FP8 (e4m3, 128x128 block scales; layer 1 stays in --dtype): fp8_ffn the "
        "FFNs, fp8_all also the attention projections and the LM head (default: as the checkpoint stores them)",
    )
    p.add_argument(
        "--fp8-first-layer",
        action="store_true",
        help="with FP8 --weights: layer 1 in FP8 too (by default it stays in --dtype: its activations are the most "
        "sensitive to rounding)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="answers bit-identical whatever shares their batch (token-tiled GEMMs, chunked attention; slower)",
    )
    p.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        help="split the weights and the KV cache over this many devices (heads, FFN width, vocabulary)",
    )
    p.add_argument("--verbose", action="store_true", help=verbose)
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")


def build_parser() -> Parser:
    from dllm_jax.cluster.routing import RoutingRule
    from dllm_jax.engine.engine import EngineConfig
    from dllm_jax.server.settings import ADMISSION_WAIT, ServeSettings

    ap = Parser(prog=PROG, description="Diffusion language model inference in JAX (LLaDA, Dream).")
    ap.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = ap.add_subparsers(
        dest="command", required=True, parser_class=Parser, metavar="{generate,serve}", help="what to run"
    )
    g = sub.add_parser("generate", help="generate an answer for a prompt or chat message")
    g.add_argument("prompt", nargs="*", help="user message(s); several make a batch (default: a demo question)")
    g.add_argument("--model", default=None, help="converted or HF-layout directory (default: the bundled model)")
    g.add_argument("--raw", action="store_true", help="use the prompt as plain text, without the chat template")
    g.add_argument(
        "--gen-length",
        type=positive_int,
        default=None,
        help="tokens to generate (default: the model's generation_config.json max_new_tokens, else 32)",
    )
    g.add_argument(
        "--block-length",
        type=positive_int,
        default=None,
        help="semi-autoregressive block length (default: the model's generation_config.json, else 32)",
    )
    g.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="denoising steps over the whole answer (default: the model's generation_config.json, else "
        "--gen-length: one token per step)",
    )
    parallel = g.add_mutually_exclusive_group()
    parallel.add_argument(
        "--threshold",
        type=probability,
        default=None,
        help="Fast-dLLM parallel decoding: commit every token whose confidence is at least this, e.g. 0.9 "
        "(--steps is then ignored)",
    )
    parallel.add_argument(
        "--factor",
        type=positive,
        default=None,
        help="Fast-dLLM's factor rule instead: commit the n most confident tokens while the n-th is above "
        "1 - factor / (n + 1), e.g. 1.0 (--steps is then ignored)",
    )
    g.add_argument(
        "--temperature",
        type=non_negative,
        default=0.0,
        help="sampling temperature of the model family's sampler (0: greedy, the default)",
    )
    g.add_argument("--top-p", type=probability, default=None, help="nucleus filter (Dream's sampler; not LLaDA's)")
    g.add_argument("--top-k", type=positive_int, default=None, help="top-k filter (Dream's sampler; not LLaDA's)")
    g.add_argument(
        "--cache",
        choices=["none", "first_layer", "prefix", "dual"],
        default="dual",
        help="K/V cache: dual (Fast-dLLM, the default), prefix, first_layer (LaCache's exact memo) or none",
    )
    g.add_argument("--seed", type=int, default=0, help="random seed (matters only with --temperature > 0)")
    compile_cache_flags(
        g, "the next run with these shapes loads its programs instead of compiling them; jax's own, where set, stays"
    )
    model_flags(
        g,
        attention="cuDNN + the Pallas kernel on a GPU, XLA elsewhere",
        verbose="print the model's notice and a timing line on stderr",
    )

    v = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    v.add_argument("--model", default=None, help="converted or HF-layout directory (default: the bundled model)")
    v.add_argument("--model-name", default=None, help="the name clients send as `model` (default: the directory's)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port (0: any free port, printed at start)")
    v.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/, /tokenize and /detokenize"
    )
    v.add_argument(
        "--max-batch",
        type=positive_int,
        default=default_of(EngineConfig, "max_batch"),
        help="requests decoded together (and at once)",
    )
    v.add_argument(
        "--max-queue",
        type=positive_int,
        default=default_of(EngineConfig, "max_queue"),
        help="requests waiting for admission beyond which the server answers 429",
    )
    v.add_argument(
        "--drain-timeout",
        type=positive,
        default=None,
        help="seconds a shutdown may spend finishing the open requests; then they get a 503 and the server exits "
        "(code 3). Default: as long as they take",
    )
    v.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="log lines on stderr as text or as JSON lines (each names its request: X-Request-Id, or one made)",
    )
    v.add_argument(
        "--max-consecutive-faults",
        type=positive_int,
        default=3,
        help="failed device calls in a row after which GET /health answers 503 (an orchestrator restarts the server)",
    )
    v.add_argument(
        "--admission-wait",
        type=unit_interval,
        default=ADMISSION_WAIT,
        metavar="FRACTION",
        help="after a block call that finished requests, hold the next one up to this fraction of a call for new "
        f"requests to take the freed rows (clients that send their next request on an answer; 0: never; default "
        f"{ADMISSION_WAIT})",
    )
    v.add_argument(
        "--audit-fraction",
        type=unit_interval,
        default=0.02,
        metavar="FRACTION",
        help="of the requests served with an affix technique, the share also decoded exactly in the rows and pages "
        "users leave, to measure what the technique costs in answers (GET /v1/audit, /metrics; 0: none; default 0.02)",
    )
    v.add_argument(
        "--audit-state",
        default=None,
        metavar="FILE",
        help="keep the audit's comparisons and the auto calibrations (anchor ratio, shallow depth) in this JSON file "
        "across restarts "
        "(read at start, written atomically every few seconds and at exit; default: in memory, a restart forgets them)",
    )
    v.add_argument(
        "--kv-budget-gib",
        type=positive,
        default=None,
        help="KV pool size in GiB (default: half the device's free memory; 1 GiB on the CPU)",
    )
    v.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest prompt + answer served (default: the model's maximum, at most 4096)",
    )
    v.add_argument(
        "--batch-sizes",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="batch sizes a call is padded to, the largest = --max-batch (default: 1, 4, 16, ...): each is a set of "
        "compiled programs",
    )
    v.add_argument(
        "--window-chunk",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens a row a window forward (block starts, probes, affix builds) runs at a time (default: 256), "
        "halved so that a chunk of all rows stays <= 2048 tokens, and down to 128 while all rows keep >= 512 "
        "(256, 128, 128 at batch 1, 4, 16): fewer chunks wait less on the host, smaller ones pad less",
    )
    v.add_argument(
        "--compiler-option",
        type=compiler_option,
        action="append",
        metavar="NAME=VALUE",
        help="an XLA option the block programs are compiled with, over the engine's own (on a GPU: "
        "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL); repeatable; "
        "checked at start",
    )
    v.add_argument(
        "--block-lengths",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help="the block lengths served (each is a set of compiled programs; a request for another gets a 400); "
        "the first is the default unless the model's is listed (default: the model's generation_config.json "
        "block_length, else 32)",
    )
    compile_cache_flags(v, "a restart loads the warm-up's programs from it")
    v.add_argument(
        "--affix-technique",
        choices=["none", "naive", "anchors", "shallow"],
        default=default_of(ServeSettings, "affix_technique"),
        help="default reuse of a shared affix (a system prompt or document repeated across requests): "
        "none = exact; anchors = ACache (faster, approximate); shallow = BiCache (a shared prefix's K/V in the "
        "layers below --shallow-depth); requests may override",
    )
    v.add_argument(
        "--request-timeout",
        type=positive,
        default=default_of(ServeSettings, "request_timeout"),
        help="seconds after which a request ends unfinished with a 504 (a request's own timeout field wins)",
    )
    v.add_argument(
        "--anchor-ratio",
        type=ratio_or_auto,
        default=default_of(ServeSettings, "anchor_ratio"),
        help="default ACache anchor ratio: the share of the affix recomputed in each request's context (0..1), or "
        "auto: per affix, the smallest ratio whose answers agree with exact ones at --agreement-target (calibrated "
        "online from shadow requests; exact while it calibrates)",
    )
    v.add_argument(
        "--agreement-target",
        type=_checked(float, lambda v: not 0.0 < v <= 1.0, "in (0, 1]"),
        default=0.95,
        metavar="SHARE",
        help="anchor ratio and shallow depth auto: the share of answers that must equal the exact ones (default 0.95)",
    )
    v.add_argument(
        "--shallow-depth",
        type=depth_or_auto,
        default=None,
        help="default BiCache depth (0 = exact; default: the model's depth table, LLaDA-8B and Dream-7B only), or "
        "auto: per affix, the deepest served depth whose answers agree with exact ones at --agreement-target "
        "(calibrated online like --anchor-ratio auto)",
    )
    v.add_argument(
        "--shallow-depths",
        type=non_negative_int,
        nargs="+",
        default=None,
        metavar="N",
        help="the BiCache depths served (each is a set of compiled programs; a request for another gets a 400; "
        "default: --shallow-depth, else with --affix-technique shallow the depths of the model's table, else none)",
    )
    v.add_argument(
        "--temperature",
        type=non_negative,
        default=default_of(ServeSettings, "temperature"),
        help="default sampling temperature when a request sets none (0: greedy)",
    )
    c = v.add_argument_group("replicas (Ray Serve; `pip install 'dllm-jax[cluster]'`)")
    c.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="engine replicas behind one ingress on Ray Serve, each with its own device and pool; requests that "
        "share an affix go to the replica that stores it (default 1: one process, no Ray)",
    )
    c.add_argument(
        "--spill-queue",
        type=positive_int,
        default=default_of(RoutingRule, "spill_queue"),
        help="requests queued at an affix's replica from which more of that affix go to the least loaded one",
    )
    c.add_argument(
        "--no-affinity",
        action="store_true",
        help="route every request to the least loaded replica (the control: each replica stores every hot affix)",
    )
    c.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster to join, e.g. HOST:6379, ray://head:10001 or auto (default: start one on this "
        "machine for this server, even where another runs)",
    )
    c.add_argument(
        "--gpus-per-replica",
        type=non_negative,
        default=None,
        help="GPUs each replica takes; below 1, replicas share a GPU (default: --tensor-parallel where Ray sees "
        "GPUs, else 0)",
    )
    c.add_argument(
        "--replica-memory-fraction",
        type=probability,
        default=None,
        help="the share of its GPU's memory each replica's XLA may take (replicas that share a GPU; default: "
        "XLA's own, 75%%)",
    )
    model_flags(v, attention="the paged slot kernel on a GPU, XLA elsewhere", verbose="uvicorn's access log")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return run_serve(args) if args.command == "serve" else run_generate(args)
    except UsageError as e:
        if debug:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # `python -m dllm_jax.cli`: the package's own module, whose UsageError is the one other modules raise (this file
    # runs as __main__, a second copy with classes of its own)
    from dllm_jax.cli import main as package_main

    sys.exit(package_main())
