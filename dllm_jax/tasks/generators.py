"""Three synthetic tasks with a SHARED part (reused by many requests) and a per-request part.

Every problem is (shared words, request head words, request tail words, answer words); all text is lower-case words
separated by single spaces, so the word-level tokenizer (`dllm_jax.tasks.vocab`) maps one word to one token.

Tasks (the answer can only be found by reading the shared part):
- "locate":  bAbI-qa1 style. Shared = a story of people moving between rooms plus two worked question/answer
             examples; request = "where is X ?" for a person of the story who is not in a worked example;
             answer = the room of X's LAST move (1 token).
- "lookup":  key-value lookup. Shared = a document of facts "the code of apple is 4 0 7 ."; request = the code of
             one key; answer = its 3 digits (3 tokens).
- "rule":    in-context function learning. Shared = worked examples "3 1 4 -> 4 2 5 ;" of one hidden operation on
             3-digit strings (chosen per shared part from OPS); request = a new input; answer = the operation applied
             to it (3 tokens). Examples are resampled until every operation consistent with them gives the same
             answer on the query, so the answer is determined by the shared part.

Placements of the shared part relative to the request. The decoding API puts the generation region right after
the prompt, so the shared part cannot follow the generation region; placements are defined relative to the
request text instead:
    prefix = [shared][head tail][gen]      infix = [head][shared][tail][gen]      suffix = [head tail][shared][gen]
The head carries the question proper (who / which key / which input), the tail is a per-request instruction, so
in the infix placement the shared part separates the question from the answer (the hardest case).

Prompts use LLaDA's chat template (what `Tokenizer.apply_chat_template` produces for one user message):
    <|startoftext|><|start_header_id|> user <|end_header_id|> BODY <|eot_id|><|start_header_id|> assistant
    <|end_header_id|>
and the generation region follows; the target is the answer words, then <|endoftext|> filling the region.

Splits: a shared part belongs to the held-out split iff a hash of its text falls in HELDOUT_BUCKETS of 100, so
train and held-out problems never share a shared part (and therefore never coincide). Everything is deterministic
given (task, split, seed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from typing import Callable, Iterator, Sequence

TASKS = ("locate", "lookup", "rule")
PLACEMENTS = ("prefix", "infix", "suffix")
SPLITS = ("train", "heldout")
HELDOUT_BUCKETS = 10  # of 100: ~10% of all possible shared parts are held out

PEOPLE = (
    "mary",
    "john",
    "sandra",
    "daniel",
    "emma",
    "oliver",
    "sophia",
    "liam",
    "ava",
    "noah",
    "mia",
    "lucas",
    "zoe",
    "ethan",
    "lily",
    "jack",
    "anna",
    "leo",
    "nora",
    "max",
)
PLACES = (
    "kitchen",
    "garden",
    "office",
    "bathroom",
    "bedroom",
    "hallway",
    "garage",
    "cellar",
    "attic",
    "balcony",
    "library",
    "studio",
)
VERBS = ("went", "moved", "travelled", "journeyed", "walked", "ran")
KEYS = (
    "apple",
    "river",
    "candle",
    "mountain",
    "violin",
    "pepper",
    "window",
    "rocket",
    "basket",
    "forest",
    "hammer",
    "island",
    "jacket",
    "lemon",
    "marble",
    "needle",
    "orange",
    "pillow",
    "rabbit",
    "saddle",
    "tiger",
    "turtle",
    "wallet",
    "yogurt",
    "anchor",
    "bottle",
    "castle",
    "dragon",
    "engine",
    "feather",
    "guitar",
    "helmet",
    "kettle",
    "ladder",
    "magnet",
    "napkin",
    "pencil",
    "silver",
    "tunnel",
    "valley",
    "wizard",
    "zipper",
    "blanket",
    "compass",
    "diamond",
    "falcon",
    "glacier",
)
DIGITS = tuple(str(d) for d in range(10))

# Template words of each task (every word any problem can contain is in one of these tuples).
TEMPLATE_WORDS = (
    "story",
    ":",
    "to",
    "the",
    ".",
    "question",
    "where",
    "is",
    "?",
    "answer",
    "with",
    "one",
    "word",
    "document",
    "code",
    "of",
    "what",
    "reply",
    "digits",
    "rule",
    "examples",
    "->",
    ";",
    "input",
    "does",
    "give",
    "apply",
    "result",
    "user",
    "assistant",
    "system",
)

CHAT_PRE = ("<|startoftext|>", "<|start_header_id|>", "user", "<|end_header_id|>")
CHAT_POST = ("<|eot_id|>", "<|start_header_id|>", "assistant", "<|end_header_id|>")


def all_words() -> list[str]:
    """Every non-special word a problem can contain, in a fixed order (the tokenizer's vocabulary)."""
    out: list[str] = []
    for group in (TEMPLATE_WORDS, DIGITS, PEOPLE, PLACES, VERBS, KEYS):
        for w in group:
            if w not in out:
                out.append(w)
    return out


# ---------------------------------------------------------------------------------------- operations
def _add(k):
    return lambda x: tuple((d + k) % 10 for d in x)


OPS: dict[str, callable] = {
    **{f"add{k}": _add(k) for k in range(1, 6)},
    "reverse": lambda x: tuple(reversed(x)),
    "sort_asc": lambda x: tuple(sorted(x)),
    "sort_desc": lambda x: tuple(sorted(x, reverse=True)),
    "rot_left": lambda x: x[1:] + x[:1],
    "rot_right": lambda x: x[-1:] + x[:-1],
    "complement": lambda x: tuple(9 - d for d in x),
    "double": lambda x: tuple((2 * d) % 10 for d in x),
}


# ------------------------------------------------------------------------------------------- problems
@dataclasses.dataclass(frozen=True)
class Problem:
    task: str
    shared: tuple[str, ...]
    head: tuple[str, ...]
    tail: tuple[str, ...]
    answer: tuple[str, ...]
    shared_id: str  # hash of the shared text (several problems share one)
    placements: tuple[str, ...] = PLACEMENTS  # where the shared part may go (earlier turns: only first)

    def body(self, placement: str) -> tuple[tuple[str, ...], tuple[int, int]]:
        """Body words in the placement's order and the shared part's (start, end) word span inside the body."""
        if placement in PLACEMENTS and placement not in self.placements:
            raise ValueError(f"a {self.task} problem's shared part goes only at {self.placements}, not {placement!r}")
        h, s, t = self.head, self.shared, self.tail
        if placement == "prefix":
            return s + h + t, (0, len(s))
        if placement == "infix":
            return h + s + t, (len(h), len(h) + len(s))
        if placement == "suffix":
            return h + t + s, (len(h) + len(t), len(h) + len(t) + len(s))
        raise ValueError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")

    def prompt_text(self, placement: str) -> str:
        """The user message content (what one would pass to the chat template)."""
        return " ".join(self.body(placement)[0])

    @property
    def answer_text(self) -> str:
        return " ".join(self.answer)


@dataclasses.dataclass(frozen=True)
class Rendered:
    prompt: list[int]  # chat-templated prompt ids (BOS ... assistant header); generation follows
    affix_span: tuple[int, int]  # (start, end) of the shared part inside `prompt`
    answer: list[int]  # answer ids (without EOS)


def render(problem: Problem, placement: str, vocab: dict[str, int]) -> Rendered:
    """Token ids of the prompt (LLaDA chat template around the body), the shared part's span, the answer ids."""
    body, (s, e) = problem.body(placement)
    prompt = [vocab[w] for w in CHAT_PRE] + [vocab[w] for w in body] + [vocab[w] for w in CHAT_POST]
    off = len(CHAT_PRE)
    return Rendered(prompt, (s + off, e + off), [vocab[w] for w in problem.answer])


def split_of(shared: Sequence[str]) -> str:
    h = int(hashlib.md5(" ".join(shared).encode()).hexdigest()[:8], 16) % 100
    return "heldout" if h < HELDOUT_BUCKETS else "train"


def _shared_id(shared: Sequence[str]) -> str:
    return hashlib.md5(" ".join(shared).encode()).hexdigest()[:12]


# --- locate
def _gen_locate(rng: random.Random, difficulty: float = 1.0):
    # difficulty 1: 5-7 people, n+3..16 moves (the task as specified); 0: 4 people, each moving once. Two of them
    # are worked examples, so even the easiest story leaves two people to ask about: the question must be read
    # (with 3 people the one person left could be answered without reading it). Difficulty 1 draws exactly
    # what it always drew (same bounds, same RNG calls), so held-out sets are unchanged.
    n_people = rng.randint(4 + round(1 * difficulty), 4 + round(3 * difficulty))
    people = rng.sample(PEOPLE, n_people)
    n_sent = rng.randint(
        n_people + round(3 * difficulty),
        max(n_people + round(3 * difficulty), round(n_people + (16 - n_people) * difficulty)),
    )
    where: dict[str, str] = {}
    order = people + [rng.choice(people) for _ in range(n_sent - n_people)]
    rng.shuffle(order)
    words = ["story", ":"]
    for p in order:
        place = rng.choice([pl for pl in PLACES if pl != where.get(p)])
        where[p] = place
        words += [p, rng.choice(VERBS), "to", "the", place, "."]
    worked = rng.sample(people, 2)
    for p in worked:
        words += ["question", ":", "where", "is", p, "?", "answer", ":", where[p], "."]
    asked = [p for p in people if p not in worked]
    rng.shuffle(asked)
    reqs = [
        (("question", ":", "where", "is", p, "?"), ("answer", "with", "one", "word", "."), (where[p],)) for p in asked
    ]
    return tuple(words), reqs


def solve_locate(shared: Sequence[str], head: Sequence[str]) -> tuple[str, ...]:
    """Reference solver: the last room the asked person moved to, read from the story."""
    person = head[head.index("is") + 1]
    story = list(shared[2 : shared.index("question")])
    last = None
    for i in range(0, len(story), 6):
        if story[i] == person:
            last = story[i + 4]
    return (last,)


# --- lookup
def _digits(rng: random.Random, n: int = 3) -> tuple[str, ...]:
    return tuple(str(rng.randrange(10)) for _ in range(n))


def _gen_lookup(rng: random.Random, difficulty: float = 1.0):
    # difficulty 1: 8-14 facts (as specified); 0: 2 facts
    n_facts = rng.randint(max(2, round(8 * difficulty)), max(2, round(14 * difficulty)))
    keys = rng.sample(KEYS, n_facts)
    vals = {k: _digits(rng) for k in keys}
    words = ["document", ":"]
    for k in keys:
        words += ["the", "code", "of", k, "is", *vals[k], "."]
    asked = list(keys)
    rng.shuffle(asked)
    reqs = [
        (("question", ":", "what", "is", "the", "code", "of", k, "?"), ("reply", "with", "the", "digits", "."), vals[k])
        for k in asked
    ]
    return tuple(words), reqs


def solve_lookup(shared: Sequence[str], head: Sequence[str]) -> tuple[str, ...]:
    key = head[head.index("of") + 1]
    for i in range(len(shared)):
        if shared[i] == "of" and shared[i + 1] == key:
            return tuple(shared[i + 3 : i + 6])
    raise KeyError(key)


# --- rule
def _consistent_ops(examples: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[str]:
    return [name for name, f in OPS.items() if all(f(x) == y for x, y in examples)]


def _gen_rule(rng: random.Random, difficulty: float = 1.0):
    del difficulty  # the examples must pin the operation down, so there is no easier version
    name = rng.choice(sorted(OPS))
    f = OPS[name]
    n_ex = rng.randint(4, 6)
    while True:
        examples = [tuple(rng.randrange(10) for _ in range(3)) for _ in range(n_ex)]
        examples = [(x, f(x)) for x in examples]
        if _consistent_ops(examples) == [name]:
            break
    words = ["rule", "examples", ":"]
    for x, y in examples:
        words += [*map(str, x), "->", *map(str, y), ";"]
    seen = {x for x, _ in examples}
    reqs = []
    while len(reqs) < 6:
        q = tuple(rng.randrange(10) for _ in range(3))
        if q in seen:
            continue
        seen.add(q)
        reqs.append((("input", ":", *map(str, q)), ("what", "does", "the", "rule", "give", "?"), tuple(map(str, f(q)))))
    return tuple(words), reqs


def solve_rule(shared: Sequence[str], head: Sequence[str]) -> tuple[str, ...]:
    """Reference solver: infer the operation from the worked examples, apply it to the query."""
    body = list(shared[3:])
    examples = []
    for i in range(0, len(body), 8):
        examples.append((tuple(int(d) for d in body[i : i + 3]), tuple(int(d) for d in body[i + 4 : i + 7])))
    q = tuple(int(d) for d in head[2:5])
    answers = {OPS[n](q) for n in _consistent_ops(examples)}
    if len(answers) != 1:
        raise ValueError(f"ambiguous rule problem: {answers}")
    return tuple(map(str, answers.pop()))


_GEN = {"locate": _gen_locate, "lookup": _gen_lookup, "rule": _gen_rule}
SOLVERS = {"locate": solve_locate, "lookup": solve_lookup, "rule": solve_rule}
_TASK_SALT = {"locate": 11, "lookup": 23, "rule": 37}
_SPLIT_SALT = {"train": 1, "heldout": 2}


def iter_problems(
    task: str, split: str, seed: int = 0, per_shared: int = 4, difficulty: float = 1.0
) -> Iterator[Problem]:
    """Endless deterministic stream of problems of one task and split; `per_shared` requests per shared part.

    difficulty in [0, 1] shrinks the shared part (fewer facts / people / moves) for a training curriculum;
    1.0 is the task as specified and the only level the quality benchmark uses.
    """
    if task not in _GEN:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return problem_stream(task, _GEN[task], _TASK_SALT[task], split, seed, per_shared, difficulty)


def problem_stream(
    task: str,
    make: Callable,
    salt: int,
    split: str,
    seed: int,
    per_shared: int,
    difficulty: float,
    placements: tuple[str, ...] = PLACEMENTS,
) -> Iterator[Problem]:
    """The stream of every task: `make(rng, difficulty)` -> (shared words, [(head, tail, answer)]), kept where the
    shared part's hash falls in `split`, `per_shared` requests each."""
    if not 0.0 <= difficulty <= 1.0:
        raise ValueError(f"difficulty must be in [0, 1], got {difficulty}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    rng = random.Random(seed * 1_000_003 + salt * 101 + _SPLIT_SALT[split])

    def stream() -> Iterator[Problem]:  # a generator inside, so that bad arguments raise at the call
        while True:
            shared, reqs = make(rng, difficulty)
            if split_of(shared) != split:
                continue
            sid = _shared_id(shared)
            for head, tail, answer in reqs[:per_shared]:
                yield Problem(task, shared, head, tail, answer, sid, placements)

    return stream()


def generate(
    task: str, split: str, n: int, seed: int = 0, per_shared: int = 4, difficulty: float = 1.0
) -> list[Problem]:
    """The first n problems of `iter_problems(task, split, seed, per_shared, difficulty)`."""
    out = []
    for p in iter_problems(task, split, seed, per_shared, difficulty):
        out.append(p)
        if len(out) == n:
            break
    return out
