"""`compilation.compile_overlapped`: programs lowered in the caller's thread while the previous one compiles in a
worker, every one compiled, a failed compile raised."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.compilation import compile_overlapped, compile_totals


class _Slow:
    """A lowering whose compile takes `seconds` in a worker thread and records where and when it ran."""

    def __init__(self, log: list, name: str, seconds: float, fail: bool = False):
        self.log, self.name, self.seconds, self.fail = log, name, seconds, fail

    def compile(self):
        self.log.append(("compile start", self.name, threading.current_thread().name, time.perf_counter()))
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError(f"{self.name} did not compile")
        self.log.append(("compile end", self.name, threading.current_thread().name, time.perf_counter()))


def test_lowering_overlaps_the_previous_compile_and_every_program_compiles():
    log: list = []

    def lowerings():
        for name in "abc":
            log.append(("lowered", name, threading.current_thread().name, time.perf_counter()))
            yield _Slow(log, name, 0.5)
            time.sleep(0.2)  # the next program's tracing and lowering

    t0 = time.perf_counter()
    compile_overlapped(lowerings(), 3, progress=False)
    wall = time.perf_counter() - t0
    ends = [e for e in log if e[0] == "compile end"]
    assert [e[1] for e in ends] == ["a", "b", "c"]  # all compiled, one at a time in order
    assert all(e[2] != threading.main_thread().name for e in ends)  # in the worker, not the caller's thread
    assert all(e[2] == threading.main_thread().name for e in log if e[0] == "lowered")
    # b was lowered while a compiled: one after the other the three take 3 x (0.5 + 0.2) = 2.1 s, overlapped ~1.5 s
    a_start = next(e[3] for e in log if e[:2] == ("compile start", "a"))
    b_lowered = next(e[3] for e in log if e[:2] == ("lowered", "b"))
    a_end = next(e[3] for e in ends if e[1] == "a")
    assert a_start < b_lowered < a_end
    assert wall < 1.9


def test_a_failed_compile_is_raised_after_the_rest_finished():
    log: list = []
    with pytest.raises(RuntimeError, match="b did not compile"):
        compile_overlapped(iter([_Slow(log, "a", 0.05), _Slow(log, "b", 0.05, fail=True), _Slow(log, "c", 0.05)]), 3)
    assert [e[1] for e in log if e[0] == "compile end"] == ["a", "c"]


def test_real_programs_compile_once_and_later_calls_find_them():
    """What a warm-up relies on: a program compiled ahead of time in the worker thread is the one a later call of
    the same shapes runs, with no compile of its own."""
    zeros, ones = jnp.zeros((7, 5)), jnp.ones((7, 5))
    before = compile_totals()[0]
    fns = [jax.jit(lambda x, k=k: x * k + 1) for k in range(3)]
    compile_overlapped((f.lower(zeros) for f in fns), 3, progress=False)
    assert compile_totals()[0] - before == 3
    assert [float(np.asarray(f(ones))[0, 0]) for f in fns] == [1.0, 2.0, 3.0]
    assert compile_totals()[0] - before == 3
