import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import fixtures  # noqa: E402


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Every fixture checkpoint written once in its HF release layout (with byte-level tokenizer files)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, spec in fixtures.SPECS.items():
        d = fixtures.write_checkpoint(name, root / name)
        fixtures.write_tokenizer(spec["family"], d)
        out[name] = d
    return out


@pytest.fixture(scope="session")
def models_fp32(hf_dirs):
    import dllm_jax

    return {name: dllm_jax.load(d, dtype="float32") for name, d in hf_dirs.items()}
