import ctypes.util
import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The Mosaic GPU simulator runs each warpgroup on XLA's CPU thread pool and blocks a pool thread per barrier wait;
# with a 2-core pool (CI) a kernel whose warpgroups wait on each other (the fused SwiGLU epilogue's hand-over)
# deadlocks. Must be set before jax starts its CPU client.
if int(os.environ.get("NPROC") or 0) < 8:  # an inherited NPROC=2 would hang those tests, not fail them
    os.environ["NPROC"] = "8"
# XLA's CPU backend without LLVM's optimisations and its expensive passes: the tests' tiny programs are compile-bound
# (the first cuts about 30% of the suite's time, the second ~15% of a compile-bound test's: the warmed engines 67 ->
# 57 s, the FP8 kernel's references 55 -> 47 s); what they check (paths against references compiled the same way,
# goldens within tolerance; no fast math either way) does not depend on them. Subprocesses the tests start inherit it.
# (XLA's FAST_COMPILE CPU preset, alone or beside these, was slower: README, s47.)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


# The suite's processes (the xdist workers, which this process starts after its conftest loads, and the servers and
# commands the tests start) allocate through jemalloc where the machine has it (Debian's libjemalloc2, which `.ci/run`
# installs): XLA's compiler (MLIR contexts built and torn down per kernel) and jax's tracing spend ~15% of their time
# in glibc's malloc; the warmed engine's compiles took 12.0 -> 9.8 s with it (s52). It must be there when a process
# starts, hence LD_PRELOAD (so not in a run without workers, `-n 0`).
if (lib := ctypes.util.find_library("jemalloc")) and "jemalloc" not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = f"{lib} {os.environ.get('LD_PRELOAD', '')}".strip()
# Tracing makes many short-lived objects: a collection every 700 allocations (CPython's default) spent ~10% of the
# warmed engine's compile time in the collector (s52: 9.8 -> 8.8 s at 50000); cycles are still collected.
gc.set_threshold(50_000, 20, 20)

import fixtures  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--soak-requests", type=int, default=120, help="requests of the server soak test (a longer one: 3000)"
    )
    parser.addoption("--playground-screenshot", default=None, help="copy the playground test's screenshot here")


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """One XLA compilation cache for the run, shared by the xdist workers (whose base temp dirs have one parent):
    a program one worker compiled (the tiny models' decoding loops recur across test files) is loaded by the other.
    Per run, so a test never reads a stale program."""
    import jax

    root = tmp_path_factory.getbasetemp()
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    jax.config.update("jax_compilation_cache_dir", str(shared / "xla-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield


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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep `--dist loadgroup` (pyproject's addopts) working: pytest-xdist sends the tests marked `xdist_group` to one
    worker by suffixing their node ids with the group's name, on a worker, in this hook; from pytest 9.2 the node id
    is a structured one and xdist's suffix (still written to the former `_nodeid`) no longer takes effect
    (pytest-xdist issue 1386), so each such test was scheduled on its own: the two Ray cluster tests ran at once
    on two workers (two clusters side by side; each one's no-Ray-process-left check also waited for the other's)
    and each family's engine was warmed up on both workers. Written here where pytest keeps the id now, after xdist's
    hook; a no-op where that one took effect (older pytest) or outside an xdist worker."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before 9.2: xdist's suffix works
        return
    for item in items:
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
        }
        nodeid = item.nodeid
        if not names or nodeid.rfind("@") > nodeid.rfind("]") or not isinstance(getattr(item, "_id", None), NodeId):
            continue  # no group, or the suffix is there already
        item._id = NodeId.parse(f"{nodeid}@{'_'.join(sorted(names))}")
