"""Synthetic tasks with a shared part (prefix / infix / suffix) for training and benchmarking the demo model."""

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
