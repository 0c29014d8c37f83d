"""Tasks closer to what the caching papers measure, for quality models deeper than the bundled one: answers that
span several blocks, few-shot examples as the shared affix, earlier turns of a conversation as the shared prefix,
long documents. Same conventions as `generators` (words, placements, splits by the shared part's hash, solvers).

- "chain":    few-shot worked answers (GSM8K-like chains). Shared = 1, 2 or 4 worked examples of one hidden
              program of 5-20 digit operations, each step written out ("add2 -> 5 3 6 ;"); request = a new input;
              answer = the same steps on it, then "answer : d d d ." (36-126 tokens: several blocks).
- "dialogue": a conversation in which the user tells codes and the assistant acknowledges ("ok ."). Shared = the
              first 1-8 turns (BiCache's shared prefix: 10% to 90% of the prompt); request = its own later turns
              and a question about any code told; answer = the 3 digits. Prefix placement only (earlier turns).
- "longdoc":  lookup in a 256-1024-token document of "the code of red apple is 4 0 7 ." facts (keys repeat
              with other colours, so both words must be read); answer = the 3 digits.

Difficulty in [0, 1] shrinks the programs, conversations and documents for a curriculum; 1 is the task as
specified. The words are appended after `generators.all_words()` in the vocabulary, so the ids of the bundled
model's words do not move.
"""

from __future__ import annotations

import random
from typing import Iterator, Sequence

from dllm_jax.tasks.generators import CHAT_POST, CHAT_PRE, KEYS, OPS, PLACEMENTS, Problem, _digits, problem_stream

LONG_FORM_TASKS = ("chain", "dialogue", "longdoc")
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "purple", "pink", "brown", "grey")
WORDS = (*sorted(OPS), "steps", "work", "it", "out", "step", "by", "examples", "remember", "ok", *COLOURS)


# --- chain
def worked_steps(program: Sequence[str], digits: tuple[int, ...]) -> tuple[str, ...]:
    """`program`'s operations on `digits`, each step written out, then the result."""
    out: list[str] = []
    for op in program:
        digits = OPS[op](digits)
        out += [op, "->", *map(str, digits), ";"]
    return (*out, "answer", ":", *map(str, digits), ".")


def _gen_chain(rng: random.Random, difficulty: float = 1.0):
    k = rng.randint(max(1, round(5 * difficulty)), max(1, round(20 * difficulty)))
    program = [rng.choice(sorted(OPS)) for _ in range(k)]
    shots = rng.choice((1, 2, 4))
    inputs: list[tuple[int, ...]] = []
    while len(inputs) < shots + 4:
        x = tuple(rng.randrange(10) for _ in range(3))
        if x not in inputs:
            inputs.append(x)
    words = ["examples", ":"]
    for x in inputs[:shots]:
        words += ["input", ":", *map(str, x), "steps", ":", *worked_steps(program, x)]
    tail = ("work", "it", "out", "step", "by", "step", ".")
    reqs = [(("input", ":", *map(str, q)), tail, worked_steps(program, q)) for q in inputs[shots:]]
    return tuple(words), reqs


def solve_chain(shared: Sequence[str], head: Sequence[str]) -> tuple[str, ...]:
    """Read the program off the first worked example; run it on the request's input."""
    first = list(shared[shared.index("steps") + 2 : shared.index("answer")])
    program = [w for w in first if w in OPS]
    return worked_steps(program, tuple(int(d) for d in head[2:5]))


def shots_of(problem: Problem) -> int:
    return problem.shared.count("input")


# --- dialogue
# the end of a user turn, the assistant's "ok ." turn, the next user turn's header (LLaDA's chat template)
_TURN = (*CHAT_POST, "ok", ".", CHAT_POST[0], *CHAT_PRE[1:])


def _told(keys: Sequence[str], vals: dict) -> tuple[str, ...]:
    """One user turn telling these codes, the assistant's "ok .", and the next user turn's header."""
    out = ["remember", ":"]
    for k in keys:
        out += ["the", "code", "of", k, "is", *vals[k], "."]
    return (*out, *_TURN)


def _gen_dialogue(rng: random.Random, difficulty: float = 1.0):
    n_shared = rng.randint(1, max(1, round(8 * difficulty)))
    turns = [rng.randint(1, 2) for _ in range(n_shared)]
    keys = rng.sample(KEYS, 2 * 8 * 2)  # enough for 8 shared and 8 own turns of 2 facts
    vals = {k: _digits(rng) for k in keys}
    words, used = [], 0
    for n in turns:
        words += _told(keys[used : used + n], vals)
        used += n
    reqs = []
    tail = ("reply", "with", "the", "digits", ".")
    for _ in range(4):
        own_turns = [rng.randint(1, 2) for _ in range(rng.randint(0, max(0, round(8 * difficulty))))]
        own, at = [], used
        for n in own_turns:
            own += _told(keys[at : at + n], vals)
            at += n
        k = rng.choice(keys[:at])
        reqs.append(((*own, "question", ":", "what", "is", "the", "code", "of", k, "?"), tail, vals[k]))
    return tuple(words), reqs


def solve_dialogue(shared: Sequence[str], head: Sequence[str]) -> tuple[str, ...]:
    """The code told for the asked key, in the shared turns or the request's own."""
    key = head[-2]
    told = list(shared) + list(head[:-9])
    for i in range(len(told) - 5):
        if told[i : i + 2] == ["of", key] and told[i + 2] == "is":
            return tuple(told[i + 3 : i + 6])
    raise KeyError(key)


def shared_fraction(problem: Problem) -> float:
    """The shared prefix's share of the prompt body (BiCache's prefix fraction)."""
    return len(problem.shared) / (len(problem.shared) + len(problem.head) + len(problem.tail))


# --- longdoc
def _gen_longdoc(rng: random.Random, difficulty: float = 1.0):
    n = rng.randint(max(2, round(26 * difficulty)), max(2, round(102 * difficulty)))  # 10 words a fact
    names = rng.sample([(c, k) for c in COLOURS for k in KEYS], n)
    vals = {name: _digits(rng) for name in names}
    words = ["document", ":"]
    for c, k in names:
        words += ["the", "code", "of", c, k, "is", *vals[(c, k)], "."]
    tail = ("reply", "with", "the", "digits", ".")
    asked = rng.sample(names, min(6, n))
    reqs = [(("question", ":", "what", "is", "the", "code", "of", c, k, "?"), tail, vals[(c, k)]) for c, k in asked]
    return tuple(words), reqs


def solve_longdoc(shared: Sequence[str], head: Sequence[str]) -> tuple[str, ...]:
    colour, key = head[7], head[8]
    for i in range(len(shared) - 6):
        if shared[i : i + 3] == ("of", colour, key):
            return tuple(shared[i + 4 : i + 7])
    raise KeyError((colour, key))


_GEN = {"chain": _gen_chain, "dialogue": _gen_dialogue, "longdoc": _gen_longdoc}
SOLVERS = {"chain": solve_chain, "dialogue": solve_dialogue, "longdoc": solve_longdoc}
_TASK_SALT = {"chain": 41, "dialogue": 43, "longdoc": 47}
_PLACEMENTS = {"chain": PLACEMENTS, "dialogue": ("prefix",), "longdoc": PLACEMENTS}


def iter_problems(
    task: str, split: str, seed: int = 0, per_shared: int = 4, difficulty: float = 1.0
) -> Iterator[Problem]:
    """Endless deterministic stream of one long-form task's problems (as `generators.iter_problems`)."""
    if task not in _GEN:
        raise ValueError(f"unknown long-form task {task!r}; expected one of {LONG_FORM_TASKS}")
    return problem_stream(
        task, _GEN[task], _TASK_SALT[task], split, seed, per_shared, difficulty, placements=_PLACEMENTS[task]
    )


def generate(
    task: str, split: str, n: int, seed: int = 0, per_shared: int = 4, difficulty: float = 1.0
) -> list[Problem]:
    """The first n problems of `iter_problems(task, split, seed, per_shared, difficulty)`."""
    stream = iter_problems(task, split, seed, per_shared, difficulty)
    return [next(stream) for _ in range(n)]
