"""Synthetic tasks with a shared part (prefix / infix / suffix) for training and benchmarking the demo model
(`generators`: the bundled model's three tasks) and deeper quality models (`long_form`: multi-block worked answers
with few-shot examples, conversations whose earlier turns are shared, long documents)."""

from dllm_jax.tasks.generators import (
    PLACEMENTS,
    SOLVERS,
    SPLITS,
    TASKS,
    Problem,
    Rendered,
    generate,
    iter_problems,
    render,
)

__all__ = ["PLACEMENTS", "SOLVERS", "SPLITS", "TASKS", "Problem", "Rendered", "generate", "iter_problems", "render"]
