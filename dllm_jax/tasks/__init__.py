"""Synthetic tasks with a shared part (prefix / infix / suffix) for training and benchmarking the demo model
(`generators`: the bundled model's three tasks) and deeper quality models (`long_form`: multi-block worked answers
with few-shot examples, conversations whose earlier turns are shared, long documents)."""

from dllm_jax.tasks import generators, long_form
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

ALL_TASKS = TASKS + long_form.LONG_FORM_TASKS


def problems(
    task: str, split: str, n: int, seed: int = 0, per_shared: int = 4, difficulty: float = 1.0
) -> list[Problem]:
    """The first n problems of any task, the bundled model's or a long-form one."""
    source = long_form if task in long_form.LONG_FORM_TASKS else generators
    return source.generate(task, split, n, seed, per_shared, difficulty)


__all__ = [
    "ALL_TASKS",
    "PLACEMENTS",
    "SOLVERS",
    "SPLITS",
    "TASKS",
    "Problem",
    "Rendered",
    "generate",
    "iter_problems",
    "problems",
    "render",
]
