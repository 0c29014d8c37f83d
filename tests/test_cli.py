"""The `dllm-jax` and `dllm-convert` command lines as a user meets them: the README's main command on the bundled
model, and every kind of bad input answered by one line on stderr naming the flag or file, exit status 2, no
traceback, before any device work."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from convert.cli import main as convert_main
from dllm_jax import cli
from dllm_jax.engine import EngineConfig
from dllm_jax.io.loading import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parents[1]


def test_readme_main_command_on_the_bundled_model(capsys):
    """No flags: the model's generation_config.json sets gen_length 8; only the answer on stdout, nothing on
    stderr unless --verbose. The process's own compilation cache (the suite's) stays: the default gives way to it."""
    import jax

    cache = jax.config.jax_compilation_cache_dir
    assert cli.main(["generate", cli.DEMO_PROMPT]) == 0
    assert jax.config.jax_compilation_cache_dir == cache
    out, err = capsys.readouterr()
    assert out.strip() == "1 0 4"  # 9 - digit, learned from the examples in the prompt
    assert err == ""
    assert cli.main(["generate", cli.DEMO_PROMPT, "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "1 0 4" and "demo model" in err and "NFE 8" in err
    assert cli.main(["generate", cli.DEMO_PROMPT, "--weights", "fp8_all"]) == 0  # every GEMM past layer 1 in FP8
    assert capsys.readouterr().out.strip() == "1 0 4"


def test_generate_keeps_its_programs_in_the_compile_cache(tmp_path):
    """`dllm-jax generate` in a new process stores its programs under the user's cache directory; the next run loads
    them all (no file is written) and answers the same; --no-compile-cache writes nothing; where the default
    directory cannot be made, it answers without one."""
    import fixtures

    env = dict(fixtures.subprocess_env(), HOME=str(tmp_path))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # jax's own setting, which the default gives way to
    cache = tmp_path / ".cache" / "dllm-jax" / "xla"

    def run(*flags: str) -> str:
        argv = [sys.executable, "-m", "dllm_jax.cli", "generate", cli.DEMO_PROMPT, *flags]
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    assert run("--no-compile-cache") == "1 0 4" and not cache.exists()
    assert run() == "1 0 4"
    stored = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert stored
    assert run() == "1 0 4"
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stored  # all loaded: none compiled, rewritten
    (tmp_path / "file").write_text("")
    env["HOME"] = str(tmp_path / "file")  # a home where no cache can be made: the answer all the same
    assert run() == "1 0 4"


def test_flags_override_the_model_defaults(capsys):
    assert (
        cli.main(
            ["generate", cli.DEMO_PROMPT, "--gen-length", "16", "--block-length", "8", "--cache", "none", "--verbose"]
        )
        == 0
    )
    assert "NFE 16" in capsys.readouterr().err
    assert cli.main(["generate", cli.DEMO_PROMPT, "--threshold", "0.9", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "1 0 4" and "NFE" in err
    assert cli.main(["generate", cli.DEMO_PROMPT, "--factor", "1", "--top-p", "1", "--verbose"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "1 0 4" and int(re.search(r"NFE (\d+)", err).group(1)) < 8  # parallel: < a step a token


def test_model_generation_defaults(tmp_path):
    assert cli.model_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": 64, "steps": 16, "block_length": "x"})
    )
    assert cli.model_generation_defaults(tmp_path) == {"gen_length": 64, "steps": 16}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(cli.UsageError, match="generation_config.json is not valid JSON"):
        cli.model_generation_defaults(tmp_path)


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    bad_json = root / "bad_json"
    shutil.copytree(DEFAULT_MODEL_DIR, bad_json)
    (bad_json / "config.json").write_text('{"model_type": "llada", ')
    bad_gen = root / "bad_generation_config"
    shutil.copytree(DEFAULT_MODEL_DIR, bad_gen)
    (bad_gen / "generation_config.json").write_text("[1, 2")
    not_dir = root / "a_file"
    not_dir.write_text("x")
    return {"bad_json": bad_json, "bad_gen": bad_gen, "not_dir": not_dir}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["--gen-length", "0"], "argument --gen-length: must be a positive integer, got 0"),
        (["--block-length", "0"], "argument --block-length: must be a positive integer, got 0"),
        (["--gen-length", "-8"], "argument --gen-length: must be a positive integer, got -8"),
        (["--steps", "four"], "argument --steps: 'four' is not an integer"),
        (["--threshold", "1.5"], "argument --threshold: must be in (0, 1], got 1.5"),
        (["--temperature", "-1"], "argument --temperature: must be >= 0, got -1.0"),
        (
            ["--gen-length", "10", "--block-length", "4"],
            "argument --gen-length: 10 is not a multiple of the block length",
        ),
        (["--gen-length", "8", "--block-length", "4", "--steps", "3"], "argument --steps: 3 must be a multiple"),
        (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
        (["--attention", "cudnn"], "argument --attention: attention='cudnn' needs a GPU"),
        (["--cache", "paged"], "argument --cache: invalid choice: 'paged'"),
        (["--model", "/nonexistent/model"], "model directory /nonexistent/model does not exist"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--tensor-parallel", "0"], "argument --tensor-parallel: must be a positive integer, got 0"),
        (["--tensor-parallel", "64"], "argument --tensor-parallel: tensor_parallel=64 needs 1.."),
        (["--tensor-parallel", "2", "--attention", "pallas"], "argument --attention: --tensor-parallel runs XLA's"),
        (["--batch-invariant", "--cache", "first_layer"], "argument --batch-invariant: not with --cache first_layer"),
        (["--fp8-first-layer"], "argument --weights: fp8_first_layer quantises layer 1 beside FP8 weights"),
        (["--compile-cache", "/dev/null/xla"], "argument --compile-cache: /dev/null is not a directory"),
        (["--threshold", "0.9", "--factor", "1"], "argument --factor: not allowed with argument --threshold"),
        (["--factor", "0"], "argument --factor: must be positive, got 0.0"),
        (["--top-k", "0"], "argument --top-k: must be a positive integer, got 0"),
        # the bundled model is a LLaDA: its remasking sampler has no top-p / top-k filter to apply them to
        (["--top-p", "0.9"], "top_p=0.9 would be ignored: this request decodes with LLaDA's remasking sampler"),
    ],
)
def test_bad_flags(argv, message, capsys):
    if "cudnn" in argv and cli_gpu():
        pytest.skip("this machine has a GPU: cuDNN is available")
    assert cli.main(["generate", "input : 1 2 3", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("dllm-jax: error: ") and message in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kv-budget-gib", "0"], "argument --kv-budget-gib: must be positive, got 0.0"),
        (["--kv-budget-gib", "1000000"], "argument --kv-budget-gib: a KV budget of 1000000.00 GiB is more than"),
        (["--anchor-ratio", "1.5"], "argument --anchor-ratio: must be in [0, 1], got 1.5"),
        (["--shallow-depth", "-1"], "argument --shallow-depth: must be >= 0, got -1"),
        (["--shallow-depth", "9"], "argument --shallow-depth: 9 exceeds the model's"),
        (["--affix-technique", "shallow"], "argument --shallow-depth: --affix-technique shallow needs it"),
        (["--shallow-depth", "auto"], "argument --shallow-depth: auto calibrates among the served depths: name them"),
        (["--shallow-depth", "auto", "--shallow-depths", "0"], "argument --shallow-depth: auto needs a depth >= 1"),
        (["--max-batch", "0"], "argument --max-batch: must be a positive integer, got 0"),
        (["--tensor-parallel", "64"], "argument --tensor-parallel: tensor_parallel=64 needs 1.."),
        (["--compile-cache", "/dev/null/xla"], "argument --compile-cache: /dev/null is not a directory"),
        (["--compile-cache", ""], "argument --compile-cache: expected a directory, got ''"),
        (
            ["--compile-cache", "/tmp/xla", "--no-compile-cache"],
            "argument --no-compile-cache: not allowed with argument --compile-cache",
        ),
        (["--block-lengths", "0"], "argument --block-lengths: must be a positive integer, got 0"),
        (["--window-chunk", "0"], "argument --window-chunk: must be a positive integer, got 0"),
        (
            ["--batch-sizes", "2", "4", "--max-batch", "8"],
            "argument --batch-sizes: EngineConfig.batch_sizes=(2, 4): positive sizes ending at max_batch=8",
        ),
        (["--block-lengths", "8", "x"], "argument --block-lengths: 'x' is not an integer"),
        (["--block-lengths"], "argument --block-lengths: expected at least one argument"),
        (
            ["--block-lengths", "8", "64", "--max-model-len", "64"],
            "argument --block-lengths: EngineConfig.block_lengths=(8, 64) must be < max_model_len=64",
        ),
        (["--shallow-depths", "-1"], "argument --shallow-depths: must be >= 0, got -1"),
        (["--shallow-depths", "2", "9"], "argument --shallow-depths: 9 exceeds the model's 6 layers"),
        (["--shallow-depths", "2", "--shallow-depth", "3"], "argument --shallow-depth: 3 is not among --shallow-de"),
        (["--compiler-option", "fast=1"], "argument --compiler-option: expected NAME=VALUE with an XLA option name"),
        (["--compiler-option", "xla_no_such_option=1"], "argument --compiler-option: EngineConfig.compiler_options="),
        (["--compiler-option", "xla_cpu_enable_fast_math=maybe"], "not a valid bool value"),
        (["--audit-fraction", "1.5"], "argument --audit-fraction: must be in [0, 1], got 1.5"),
        (["--audit-state", "/nonexistent/a.json"], "argument --audit-state: /nonexistent is not a writable directory"),
        (["--agreement-target", "0"], "argument --agreement-target: must be in (0, 1], got 0.0"),
        (["--weights", "fp8_all", "--tensor-parallel", "2"], "argument --weights: fp8_all runs on one device"),
        (["--replicas", "0"], "argument --replicas: must be a positive integer, got 0"),
        (
            ["--replicas", "2", "--replica-memory-fraction", "0"],
            "argument --replica-memory-fraction: must be in (0, 1]",
        ),
        (  # a cluster's flags are checked before Ray starts, as one process's
            ["--replicas", "2", "--batch-sizes", "2", "4", "--max-batch", "8"],
            "argument --batch-sizes: EngineConfig.batch_sizes=(2, 4): positive sizes ending at max_batch=8",
        ),
    ],
)
def test_bad_serve_flags(argv, message, capsys):
    """Refused in one line before anything serves (the port: any free one, closed again)."""
    assert cli.main(["serve", "--port", "0", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("dllm-jax: error: ") and message in err, err


def test_served_shallow_depths_and_compile_cache_follow_the_flags(tmp_path):
    """The BiCache depths warmed are those a request can get by default; the cache directory is checked, not made."""
    from dllm_jax.decoding.caches.bicache import DEPTH_TABLES

    def parse(*argv):
        return cli.build_parser().parse_args(["serve", *argv])

    llada_8b = SimpleNamespace(family="llada", n_layers=32)
    table = tuple(sorted(set(DEPTH_TABLES[("llada", 32)].values())))
    assert cli.shallow_depths(parse(), llada_8b) == ()
    assert cli.shallow_depths(parse("--affix-technique", "shallow"), llada_8b) == table
    assert cli.shallow_depths(parse("--affix-technique", "shallow", "--shallow-depth", "3"), llada_8b) == (3,)
    assert cli.shallow_depths(parse("--shallow-depth", "3"), llada_8b) == (3,)  # a request may still ask for it
    assert cli.shallow_depths(parse("--shallow-depths", "4", "2", "4"), llada_8b) == (2, 4)
    assert cli.shallow_depths(parse("--shallow-depth", "auto"), llada_8b) == table  # calibrated among them
    assert cli.shallow_depths(parse("--shallow-depth", "auto", "--shallow-depths", "2", "4"), llada_8b) == (2, 4)
    assert cli.compile_cache_dir(parse()) == Path.home() / ".cache" / "dllm-jax" / "xla"
    assert cli.compile_cache_dir(parse("--no-compile-cache")) is None
    assert cli.compile_cache_dir(parse("--compile-cache", str(tmp_path / "a" / "b"))) == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists()
    # the engine's tuning flags reach its config; unset, the config's defaults hold
    assert cli.engine_config(parse("--window-chunk", "128", "--batch-sizes", "4", "16")).window_chunk == 128
    assert cli.engine_config(parse()) == EngineConfig()
    assert cli.engine_config(parse("--batch-invariant")) == EngineConfig(batch_invariant=True)


def cli_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def test_no_command_names_the_commands(capsys):
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "{generate,serve}" in err, err


@pytest.mark.parametrize(
    "model,message",
    [
        ("bad_json", "config.json is not valid JSON"),
        ("bad_gen", "generation_config.json is not valid JSON"),
        ("not_dir", "is not a directory"),
    ],
)
def test_bad_model_directories(model, message, broken_models, capsys):
    assert cli.main(["generate", "--model", str(broken_models[model])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and str(broken_models[model]) in err, err


def test_convert_errors_are_one_line(broken_models, tmp_path, capsys):
    assert convert_main([str(broken_models["bad_json"]), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json is not valid JSON" in err
    assert convert_main(["/nonexistent/hf", str(tmp_path / "out"), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_debug_shows_the_traceback():
    with pytest.raises(cli.UsageError, match="must be a positive integer"):
        cli.main(["--debug", "generate", "--steps", "0"])


def test_every_flag_has_help_text():
    parser = cli.build_parser()
    subparsers = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    parsers = [parser] + [p for s in subparsers for p in s.choices.values()]
    for p in parsers:
        for action in p._actions:
            if action.dest != "help":
                assert action.help, f"{p.prog} {action.option_strings or action.dest} has no help text"


def test_every_module_imports_in_a_fresh_interpreter_without_environment():
    """The package reads no environment variable and needs none: every module imports in a new process whose
    environment is empty (bar what finds the interpreter's own libraries)."""
    modules = []
    for root in ("dllm_jax", "pallas_kernels", "convert"):
        for f in sorted((REPO / root).rglob("*.py")):
            rel = f.relative_to(REPO).with_suffix("")
            modules.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    code = (
        "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok', len(sys.argv) - 1)"
    )
    env = {k: v for k, v in os.environ.items() if k in ("SYSTEMROOT",)}  # nothing on Linux
    done = subprocess.run(
        [sys.executable, "-c", code, *modules], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"ok {len(modules)}"
