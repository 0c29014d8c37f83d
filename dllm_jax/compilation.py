"""jax's compilation, process-wide: its persistent cache (a restart loads programs instead of compiling them; `serve`
and `generate` turn it on) and a count of what was compiled (what must not move while a warmed-up engine serves)."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import jax
from tqdm.auto import tqdm

_compiles = [0, 0.0, 0]  # programs jax compiled or loaded from its persistent cache (anyone's), their seconds, loads


@functools.cache
def _listen() -> None:
    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":  # a compile, or a load from the persistent cache
            _compiles[:2] = _compiles[0] + 1, _compiles[1] + duration

    def on_event(event: str, **kwargs) -> None:
        _compiles[2] += event == "/jax/compilation_cache/cache_hits"

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)


def compile_totals() -> tuple[int, float, int]:
    """(programs compiled or loaded from the persistent cache in this process, the seconds that took, how many were
    loaded), counted from the first call on."""
    _listen()
    return tuple(_compiles)


# XLA's command buffers (CUDA graphs) with while loops and conditionals added to its default kinds: a program whose
# loops' trip counts depend on its data (the engine's chunk loops, ~4 a layer) then keeps each trip check on the GPU
# instead of a copy to the host and a wait (~20 ms of a 16-row LLaDA-8B block call's 364, s46-prof)
LOOPS_IN_COMMAND_BUFFERS = (
    ("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"),
)


def loop_compiler_options(backend: str | None = None) -> tuple[tuple[str, str], ...]:
    """The XLA options for programs whose loops run data-dependent trip counts, on `backend` (default: jax's)."""
    return LOOPS_IN_COMMAND_BUFFERS if (backend or jax.default_backend()) == "gpu" else ()


def enable_compile_cache(path: str | os.PathLike) -> None:
    """Turn on jax's persistent compilation cache at `path` (created if missing): a restart with the same settings
    loads the programs instead of compiling them. Every program is cached, however fast it compiled."""
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def compile_overlapped(lowerings: Iterable[jax.stages.Lowered], total: int, progress: bool = True) -> None:
    """Compile programs as they are lowered: each is traced and lowered in this thread (Python, as `lowerings` yields
    it) while the one before compiles, or loads from the persistent cache, in one worker thread (XLA, the GIL
    released), so a start's tracing and compiling overlap. One worker: XLA's autotuner times kernels on the device,
    and two compiles at once would time each other. A failed compile raises here."""
    bar = tqdm(total=total, desc="compiling", unit="program", disable=not progress)
    with bar, ThreadPoolExecutor(1, thread_name_prefix="compile") as pool:
        jobs = []
        for lowered in lowerings:
            jobs.append(pool.submit(lowered.compile))
            jobs[-1].add_done_callback(lambda _: bar.update())
        for job in jobs:
            job.result()
