"""The bundled default model (trained by bench/train_demo.py) and the `dllm-jax generate` command line."""

import importlib.util
import json
from pathlib import Path

import pytest

from dllm_jax import cli
from dllm_jax.loading import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parents[1]


def _quality():
    spec = importlib.util.spec_from_file_location("bench_quality", REPO / "bench" / "quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bundled_model_reads_its_context(tmp_path):
    """Held-out exact match (no cache, 30 problems per task x placement, fixed seed) well above what a model that
    ignores the shared part can do (a random-weight model scores 0 on all three). Floors sit below the measured
    H200 figures (bench/results/quality.json, n=1000: rule 0.74, locate 0.32, lookup 0.10)."""
    res = _quality().run(DEFAULT_MODEL_DIR, n=30, modes=["none"], out=tmp_path / "q.json",
                         plot_path=tmp_path / "q.png", progress=False)
    acc = {}
    for r in res["rows"]:
        acc.setdefault(r["task"], []).append(r["accuracy"])
    acc = {t: sum(v) / len(v) for t, v in acc.items()}
    assert acc["rule"] >= 0.6, acc
    assert acc["locate"] >= 0.2, acc
    assert acc["lookup"] >= 0.02, acc


def test_cli_demo_prompt_on_bundled_model(capsys):
    """The README's main command: no flags, the model's generation_config.json sets gen_length 8."""
    assert cli.main(["generate", cli.DEMO_PROMPT]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == "1 0 4"  # 9 - digit, learned from the examples in the prompt
    assert "demo model" in err and "NFE 8" in err


def test_cli_flags_override_model_defaults(capsys):
    assert cli.main(["generate", cli.DEMO_PROMPT, "--gen-length", "16", "--block-length", "8", "--cache",
                     "none"]) == 0
    assert "NFE 16" in capsys.readouterr().err


def test_model_generation_defaults(tmp_path):
    assert cli._model_generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 64, "steps": 16,
                                                                  "block_length": "x"}))
    assert cli._model_generation_defaults(tmp_path) == {"gen_length": 64, "steps": 16}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert cli._model_generation_defaults(tmp_path) == {}


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--gen-length", "10", "--block-length", "4"], "multiple"),
])
def test_cli_errors(argv, message, capsys):
    assert cli.main(["generate", "input : 1 2 3", *argv]) == 2
    err = capsys.readouterr().err
    assert "dllm-jax: error:" in err and message in err
