"""A tiny run of the quality benchmark on the CPU through the engine's real `generate`."""

import importlib.util
import json
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[1]


def _bench(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def quality():
    return _bench("quality")


@pytest.fixture(scope="module")
def random_task_model(tmp_path_factory):
    """A tiny random-weight model with the task tokenizer, in the LLaDA HF layout."""
    from dllm_jax import checkpoint
    from dllm_jax.modeling import init_params
    from dllm_jax.tasks import vocab

    train = _bench("train_demo")
    out = tmp_path_factory.mktemp("tiny_task_model")
    config = train.model_config(tiny=True)
    checkpoint.export_hf(init_params(config, jax.random.key(0)), config, out)
    vocab.write(out)
    return out


def test_pipeline_structure(quality, random_task_model, tmp_path):
    out, png = tmp_path / "quality.json", tmp_path / "quality.png"
    res = quality.run(random_task_model, n=2, modes=["none", "naive_affix"], out=out, plot_path=png,
                      progress=False, dtype="float32")
    on_disk = json.loads(out.read_text())
    assert on_disk["rows"] == res["rows"] and png.stat().st_size > 0
    rows = res["rows"]
    assert len(rows) == 3 * 3 * 2
    assert {(r["task"], r["placement"], r["mode"]) for r in rows} == {
        (t, p, m) for t in ("locate", "lookup", "rule") for p in ("prefix", "infix", "suffix")
        for m in ("none", "naive_affix")}
    for r in rows:
        assert set(r) >= {"model", "task", "placement", "mode", "accuracy", "ci95", "n"}
        assert r["n"] == 2 and 0 <= r["ci95"][0] <= r["accuracy"] <= r["ci95"][1] <= 1
    assert res["meta"]["n_per_cell"] == 2 and "none" in res["meta"]["mode_stats"]


def test_wilson_interval(quality):
    lo, hi = quality.wilson(95, 100)
    assert 0.88 < lo < 0.9 and 0.97 < hi < 0.99
    assert quality.wilson(10, 10)[1] == 1.0 and quality.wilson(0, 10)[0] == 0.0

# The accuracy check of the trained demo model belongs with the model: add it when the model is bundled
# (issue 6). A skipped placeholder here would only pretend the feature exists.
