"""Train the bundled demo DLLM (LLaDA layout) on the three synthetic tasks.

    PYTHONPATH=. python bench/train_demo.py --out /tmp/stage1 --steps auto --time-budget 375 --batch 512 \
        --lr 2e-3 --warmup 300 --full-frac 0.1 --curriculum-frac 0.5 --hold-frac 0.5 --hold-until 0.9 \
        --task-weights lookup=1.5                                                      # GPU: ~7 minutes
    PYTHONPATH=. python bench/train_demo.py --init /tmp/stage1 --out /tmp/stage2 --steps auto --time-budget 420 \
        --batch 512 --lr 1e-3 --warmup 200 --full-frac 0.1 --levels 1 --pool 300000 \
        --task-weights locate=2,rule=1.5,lookup=0.5                                    # GPU: ~8 minutes
    PYTHONPATH=. python bench/train_demo.py --out /tmp/m --tiny --steps 30 --pool 600    # CPU smoke test

The bundled model came out of those two runs (100% held-out exact match); one command replays both exactly:

    PYTHONPATH=. python bench/train_demo.py --recipe bundled --out dllm_jax/assets/default_model   # GPU: ~15 minutes

Objective: LLaDA's masked-diffusion loss. Per sequence a mask ratio t ~ U(eps, 1); each token of the masked region
is replaced by [MASK] with probability t (at least one is); loss = sum of cross-entropies on masked tokens / t,
divided by the region's length, averaged over the batch. The region is the answer slot (answer + EOS fill, the
SFT variant) for a fraction 1 - --full-frac of the rows, and the whole sequence after BOS (the pre-training
variant, which makes the model read the context) for the rest.

Data: a pool of training problems (all three tasks; the shared part placed prefix/infix/suffix uniformly) at
--levels curriculum difficulties, built deterministically in chunks (in parallel processes), kept on the device;
batches are drawn on the device. With a level-0 hold (--hold-frac/--hold-until or --hold-steps) every row starts
at the easiest level, cut to its length, at the peak learning rate, until the key match of the lookups has formed
(bench/QUALITY.md); then the curriculum ramps up.
AdamW (b2 0.98, wd 0.1, clip 1.0), linear warmup, cosine decay from the hold's end; fp32 master weights, bf16
compute. `--steps auto` fits the run to --time-budget seconds; the step count (and the hold's length) it chose
are printed and saved (train_args.json beside the model) so `--steps N [--hold-steps H]` reproduces the run.
At the end the held-out exact-match accuracy per task x placement is printed (no-cache argmax decoding).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from tools.checkpoints import TrainCheckpoints  # noqa: E402

from dllm_jax.config import ModelConfig  # noqa: E402
from dllm_jax.decoding import GenerationConfig, answer_tokens, generate  # noqa: E402
from dllm_jax.io import checkpoint  # noqa: E402
from dllm_jax.io.loading import Model  # noqa: E402
from dllm_jax.models import FAMILIES  # noqa: E402
from dllm_jax.tasks import ALL_TASKS, problems  # noqa: E402
from dllm_jax.tasks import generators as G  # noqa: E402
from dllm_jax.tasks import vocab as V  # noqa: E402
from dllm_jax.transformer import Kernels, forward  # noqa: E402
from dllm_jax.transformer.params import cast_params, init_params  # noqa: E402

GEN_LENGTH = 8  # the bundled model's tasks: answers of <= 4 tokens in one block
SEQ_LEN = 160  # longest prompt (~150) + GEN_LENGTH, rounded up
LONG_GEN_LENGTH = 128  # with long-form tasks: chain answers of up to 126 tokens (4 blocks of 32)
LONG_SEQ_LEN = 1280  # longest long-form prompt (~1050: a 1020-token document) + LONG_GEN_LENGTH, rounded up


def shapes_for(tasks: tuple[str, ...]) -> tuple[int, int]:
    """(row length, generation region) of the rows of a task set."""
    if all(t in G.TASKS for t in tasks):
        return SEQ_LEN, GEN_LENGTH
    return LONG_SEQ_LEN, LONG_GEN_LENGTH


CHUNK = 2000  # problems per data chunk (one RNG seed each)


def model_config(
    tiny: bool,
    dtype: str = "float32",
    d_model: int = 256,
    n_layers: int = 6,
    family: str = "llada",
    max_seq_len: int = 1024,
) -> ModelConfig:
    """The demo model's shape in either family's layout. Dream's differs as the release does: GQA (a quarter of the
    heads for K/V), q/k/v biases, RoPE in the activation dtype; and it predicts position i at output i - 1."""
    if family not in ("llada", "dream"):
        raise SystemExit(f"--family: expected llada or dream, got {family!r}")
    v = V.vocab()
    d, layers, heads, mlp = (64, 2, 4, 192) if tiny else (d_model, n_layers, d_model // 32, 3 * d_model)
    dream = family == "dream"
    return ModelConfig(
        family=family,
        vocab_size=V.padded_vocab_size(),
        d_model=d,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=max(1, heads // 4) if dream else heads,
        head_dim=d // heads,
        mlp_hidden=mlp,
        rms_eps=1e-5,
        rope_theta=10000.0,
        rope_fp32=not dream,
        qkv_bias=dream,
        tie_embeddings=False,
        max_seq_len=max_seq_len,
        mask_token_id=v[V.MASK],
        eos_token_id=v[V.EOS],
        pad_token_id=v[V.EOS],
        bos_token_id=v[V.BOS],
        dtype=dtype,
    )


def predictions(logits: jax.Array, config: ModelConfig) -> jax.Array:
    """Logits aligned with the tokens they predict, [B, T, V]: Dream's output i - 1 predicts token i (the sampler
    applies the same shift); position 0 (BOS, never masked) keeps its own output."""
    if config.family != "dream":
        return logits
    return jnp.concatenate([logits[:, :1], logits[:, :-1]], axis=1)


# ------------------------------------------------------------------------------------------------ data
def _chunk(args):
    """Rows of one chunk: (tokens [n, seq_len] int16, valid length [n], answer start [n])."""
    task, chunk_idx, n, seed, level, difficulty, (seq_len, gen_length) = args
    v = V.vocab()
    eos = v[V.EOS]
    rng = np.random.default_rng([seed, chunk_idx, ALL_TASKS.index(task), level])
    toks = np.full((n, seq_len), eos, np.int16)
    length = np.zeros(n, np.int32)
    start = np.zeros(n, np.int32)
    probs = problems(task, "train", n, seed=seed * 100_000 + chunk_idx + 10_000 * level, difficulty=difficulty)
    for i, p in enumerate(probs):
        r = G.render(p, p.placements[rng.integers(len(p.placements))], v)
        row = r.prompt + r.answer + [eos] * (gen_length - len(r.answer))
        toks[i, : len(row)] = row
        length[i] = len(row)
        start[i] = len(r.prompt)
    return toks, length, start


def build_pool(n_per_task: int, seed: int, workers: int, levels: int = 1, tasks: tuple[str, ...] = G.TASKS):
    """Training rows of `tasks` (default all) at `levels` difficulties (linspace(0, 1) if levels > 1, else 1.0),
    level by level: returns (tokens, length, start) with rows [level][task][problem], each level
    n_per_task x len(tasks) rows (`shapes_for(tasks)` long). A task's rows do not depend on which other tasks are
    built."""
    diffs = [1.0] if levels == 1 else list(np.linspace(0.0, 1.0, levels))
    shapes = shapes_for(tasks)
    jobs = []
    for lv, dfc in enumerate(diffs):
        for task in tasks:
            for c in range(math.ceil(n_per_task / CHUNK)):
                jobs.append((task, c, min(CHUNK, n_per_task - c * CHUNK), seed, lv, float(dfc), shapes))
    if workers > 1:
        with mp.get_context("fork").Pool(workers) as pool:
            parts = pool.map(_chunk, jobs)
    else:
        parts = [_chunk(j) for j in jobs]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


# ------------------------------------------------------------------------------------------------ loss
def make_step(
    config: ModelConfig,
    batch: int,
    full_frac: float,
    eps: float,
    tx,
    backend: str = "xla",
    levels: int = 1,
    task_weights: tuple[float, ...] | None = None,
    compute_dtype: str = "bfloat16",
):
    """One jitted training step. compute_dtype: the forward's dtype over fp32 master weights ("float32" for CPU
    probes: XLA's CPU bf16 matmuls are ~2.5x slower than fp32 ones)."""
    cfg_c = config.replace(dtype=compute_dtype)

    def loss_fn(params, tokens, length, start, key):
        b, t = tokens.shape
        pos = jnp.arange(t, dtype=jnp.int32)[None, :]
        valid = pos < length[:, None]
        answer = (pos >= start[:, None]) & valid
        k_t, k_m, k_f = jax.random.split(key, 3)
        ratio = eps + (1 - eps) * jax.random.uniform(k_t, (b, 1))
        full = jax.random.uniform(k_f, (b, 1)) < full_frac
        region = jnp.where(full, valid & (pos > 0), answer)
        u = jax.random.uniform(k_m, (b, t))
        u = jnp.where(region, u, 2.0)
        masked = (u < ratio) | (u == jnp.min(u, axis=1, keepdims=True))  # at least one masked token per row
        masked = masked & region
        x = jnp.where(masked, config.mask_token_id, tokens)
        positions = jnp.broadcast_to(pos, (b, t))
        logits = predictions(
            forward(
                cast_params(params, cfg_c.jnp_dtype),
                cfg_c,
                x,
                positions,
                key_mask=valid,
                kernels=Kernels(attention=backend),
            ).logits,
            config,
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens)
        row = jnp.sum(jnp.where(masked, ce, 0.0), axis=1) / ratio[:, 0] / jnp.sum(region, axis=1)
        ans_ce = jnp.sum(jnp.where(masked & answer, ce, 0.0)) / jnp.maximum(jnp.sum(masked & answer), 1)
        return jnp.mean(row), ans_ce

    @jax.jit
    def step(params, opt_state, pool, key, lr, max_level):
        # curriculum: each row's difficulty level is uniform in [0, max_level]; the pool is level-major
        k_idx, k_loss = jax.random.split(key)
        idx = sample_rows(k_idx, pool[0].shape[0], batch, levels, max_level, task_weights)
        tokens = pool[0][idx].astype(jnp.int32)
        (loss, ans_ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, tokens, pool[1][idx], pool[2][idx], k_loss
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))  # same on old/new optax
        return params, opt_state, loss, ans_ce, grad_norm

    return step


def sample_rows(key, n_rows: int, batch: int, levels: int, max_level, task_weights=None):
    """Pool row indices for one batch. The pool is [level][task][problem]; each row's level is uniform in
    [0, max_level] (the curriculum), its task uniform or drawn with `task_weights` (in the pool's task order)."""
    k_lv, k_task, k_idx = jax.random.split(key, 3)
    per_level = n_rows // levels
    level = jax.random.randint(k_lv, (batch,), 0, max_level + 1)
    if task_weights is None:
        return level * per_level + jax.random.randint(k_idx, (batch,), 0, per_level)
    per_task = per_level // len(task_weights)
    task = jax.random.categorical(k_task, jnp.log(jnp.asarray(task_weights, jnp.float32)), shape=(batch,))
    return level * per_level + task * per_task + jax.random.randint(k_idx, (batch,), 0, per_task)


def parse_task_weights(spec: str | None, tasks: tuple[str, ...] = G.TASKS) -> tuple[float, ...] | None:
    """'locate=1,lookup=2' -> weights in `tasks` order (unnamed tasks weigh 1); None -> uniform."""
    if not spec:
        return None
    w = dict.fromkeys(tasks, 1.0)
    for item in spec.split(","):
        name, _, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = None
        if name.strip() not in w or weight is None or not math.isfinite(weight) or weight < 0:
            raise SystemExit(
                f"--task-weights: bad item {item!r}; expected TASK=WEIGHT (a finite weight >= 0) with TASK in {tasks}"
            )
        w[name.strip()] = weight
    if sum(w.values()) <= 0:
        raise SystemExit("--task-weights: the weights must not all be 0")
    return tuple(w[t] for t in tasks)


def lr_at(
    step: int, total: int | None, peak: float, warmup: int, final_frac: float = 0.05, decay_start: int | None = 0
) -> float:
    """Linear warmup, the peak until decay_start (None: not yet known, so the peak), cosine down to
    final_frac * peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if total is None or decay_start is None or step < decay_start:
        return peak
    begin = max(warmup, decay_start)
    frac = min(1.0, (step - begin) / max(1, total - begin))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def time_step(step_fn, params, opt_state, pool, n: int = 20) -> float:
    """Seconds per call of a training step at max level 0 (after a compile and a warm-up call); the results
    are thrown away."""
    args = (params, opt_state, pool, jax.random.key(0), jnp.float32(0.0), jnp.int32(0))
    jax.block_until_ready(step_fn(*args))
    t = time.time()
    for _ in range(n):
        out = step_fn(*args)
    jax.block_until_ready(out)
    return (time.time() - t) / n


# ------------------------------------------------------------------------------------------------ eval
def quick_eval_set(
    n: int = 256, seed: int = 99, difficulty: float = 1.0, tasks: tuple[str, ...] = G.TASKS, shapes=None
):
    """Held-out rows (placements cycling) per task for the in-training probe; full difficulty unless asked;
    rows `shapes` = (row length, generation region) long (default: those of `tasks`)."""
    v = V.vocab()
    seq_len, gen_length = shapes or shapes_for(tasks)
    out = {}
    for task in tasks:
        probs = problems(task, "heldout", n, seed=seed, difficulty=difficulty)
        rows = [G.render(p, p.placements[i % len(p.placements)], v) for i, p in enumerate(probs)]
        toks = np.full((n, seq_len), v[V.EOS], np.int32)
        length, start = np.zeros(n, np.int32), np.zeros(n, np.int32)
        for i, r in enumerate(rows):
            row = r.prompt + r.answer + [v[V.EOS]] * (gen_length - len(r.answer))
            toks[i, : len(row)], length[i], start[i] = row, len(row), len(r.prompt)
        out[task] = (jnp.asarray(toks), jnp.asarray(length), jnp.asarray(start))
    return out


def make_quick_eval(config: ModelConfig, compute_dtype: str = "bfloat16"):
    """Exact match with the whole answer region masked and decoded in ONE forward (argmax): a cheap lower-bound
    proxy of the iterative decoder's accuracy, for the training log."""
    cfg = config.replace(dtype=compute_dtype)

    @jax.jit
    def acc(params, toks, length, start):
        pos = jnp.arange(toks.shape[1])[None]
        region = (pos >= start[:, None]) & (pos < length[:, None])
        x = jnp.where(region, cfg.mask_token_id, toks)
        lg = predictions(
            forward(
                cast_params(params, cfg.jnp_dtype),
                cfg,
                x,
                jnp.broadcast_to(pos, x.shape),
                key_mask=pos < length[:, None],
            ).logits,
            cfg,
        )
        return jnp.mean(jnp.all((jnp.argmax(lg, -1) == toks) | ~region, axis=1))

    return acc


def evaluate(
    params, config: ModelConfig, n: int, seed: int = 1234, batch: int = 512, tasks: tuple[str, ...] = G.TASKS
) -> dict:
    """Held-out exact match per (task, placement), the engine's no-cache decoding (bf16 weights, one token
    per step)."""
    v = V.vocab()
    cfg = config.replace(dtype="bfloat16")
    model = Model(cfg, cast_params(params, jnp.bfloat16))
    gen = shapes_for(tasks)[1]
    gc = GenerationConfig.from_options(gen_length=gen, block_length=min(gen, 32), steps=gen, cache="none")
    out = {}
    for task in tasks:
        probs = problems(task, "heldout", n, seed=seed)
        for pl in probs[0].placements:
            rs = [G.render(p, pl, v) for p in probs]
            correct = 0
            for i in range(0, len(rs), batch):
                chunk = rs[i : i + batch]
                gen = generate(model, [r.prompt for r in chunk], gc).tokens
                correct += sum(a == r.answer for a, r in zip(answer_tokens(gen, cfg, gc), chunk))
            out[f"{task}/{pl}"] = correct / len(rs)
    return out


# ------------------------------------------------------------------------------------------------ main
# The bundled default model, as two runs (bench/QUALITY.md): a level-0 hold then the curriculum, then full difficulty
# from those weights. Exact replays of the runs that made it (step counts and the hold's end as they came out).
BUNDLED_RECIPE = (
    [
        "--steps",
        "11727",
        "--hold-steps",
        "7578",
        "--batch",
        "512",
        "--lr",
        "2e-3",
        "--warmup",
        "300",
        "--full-frac",
        "0.1",
        "--levels",
        "4",
        "--curriculum-frac",
        "0.5",
        "--task-weights",
        "lookup=1.5",
        "--pool",
        "200000",
    ],
    [
        "--steps",
        "10829",
        "--batch",
        "512",
        "--lr",
        "1e-3",
        "--warmup",
        "200",
        "--full-frac",
        "0.1",
        "--levels",
        "1",
        "--task-weights",
        "locate=2,rule=1.5,lookup=0.5",
        "--pool",
        "300000",
    ],
)


def train_bundled(out: str, extra: list[str]) -> int:
    """`--recipe bundled`: both runs, the first into OUT_stage1, the second from it into OUT (extra args, e.g.
    --workers or --eval-n, go to both)."""
    stage1 = f"{out.rstrip('/')}_stage1"
    first, second = BUNDLED_RECIPE
    if main(["--out", stage1, *first, *extra]) != 0:
        return 1
    return main(["--out", out, "--init", stage1, *second, *extra])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)  # a recipe is several runs: it takes --out and pass-through args
    pre.add_argument("--recipe", choices=["bundled"])
    pre.add_argument("--out", default="dllm_jax/assets/default_model")
    known, rest = pre.parse_known_args(argv)
    if known.recipe:
        return train_bundled(known.out, rest)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="dllm_jax/assets/demo_model")
    ap.add_argument(
        "--recipe",
        choices=["bundled"],
        help="run a named multi-run recipe instead (bundled: the two runs of the bundled default model, "
        "~15 minutes on one H200; with --out DIR and pass-through args such as --workers)",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    ap.add_argument("--steps", default="auto", help="number of steps, or 'auto' (fit --time-budget)")
    ap.add_argument("--time-budget", type=float, default=180.0, help="seconds of training for --steps auto")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--full-frac", type=float, default=0.25, help="rows with whole-sequence masking")
    ap.add_argument("--eps", type=float, default=0.05, help="lowest mask ratio")
    ap.add_argument("--pool", type=int, default=200_000, help="training problems per task")
    ap.add_argument("--workers", type=int, default=max(1, min(16, mp.cpu_count() - 1)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "xla", "cudnn"],
        help="training attention backend (auto: cudnn on GPU, else xla)",
    )
    ap.add_argument("--eval-n", type=int, default=300, help="held-out problems per task for the final eval")
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument(
        "--family",
        default="llada",
        choices=["llada", "dream"],
        help="checkpoint layout and prediction rule (dream: GQA, biases, shifted prediction)",
    )
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--levels", type=int, default=4, help="curriculum difficulty levels (1 = no curriculum)")
    ap.add_argument(
        "--task-weights",
        default=None,
        help="sampling weight per task, e.g. 'locate=1,lookup=2,rule=0.5' (default: uniform)",
    )
    ap.add_argument("--init", default=None, help="start from this model directory (e.g. the bundled model)")
    ap.add_argument(
        "--tasks",
        default=",".join(G.TASKS),
        help=f"comma-separated tasks to train on, of {','.join(ALL_TASKS)} (default: the bundled model's three; "
        f"a long-form one makes rows {LONG_SEQ_LEN} tokens with a {LONG_GEN_LENGTH}-token answer region)",
    )
    ap.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save the training state here every --checkpoint-every steps and resume from its latest on start "
        "(a run longer than one device session: repeat the same command); needs --steps N",
    )
    ap.add_argument("--checkpoint-every", type=int, default=500, help="steps between saved training states")
    ap.add_argument(
        "--curriculum-frac",
        type=float,
        default=0.4,
        help="fraction of the run (after the level-0 hold) over which the hardest allowed level rises to the full task",
    )
    ap.add_argument(
        "--hold-frac",
        type=float,
        default=0.0,
        help="hold every row at level 0 (2 facts, 4 people moving once) for up to this fraction of the "
        "steps, on rows cut to the level's length (about half the tokens): the key match forms there",
    )
    ap.add_argument(
        "--hold-until",
        type=float,
        default=None,
        help="end the hold early once the one-shot probe on level-0 held-out lookups and stories "
        "reaches this accuracy (checked every --log-every steps)",
    )
    ap.add_argument(
        "--hold-steps",
        type=int,
        default=None,
        help="hold exactly this many steps (replays a run whose hold ended early)",
    )
    args = ap.parse_args(argv)
    if not 0.0 <= args.hold_frac < 1.0:
        raise SystemExit("--hold-frac must be in [0, 1)")
    if (args.hold_frac > 0 or args.hold_steps) and args.levels < 2:
        raise SystemExit("a level-0 hold needs a curriculum (--levels >= 2)")
    if args.hold_until is not None and args.hold_steps is not None:
        raise SystemExit("--hold-until ends an adaptive hold; --hold-steps replays a fixed one: give one")
    if args.checkpoint_dir and (args.steps == "auto" or args.hold_until is not None or args.checkpoint_every < 1):
        # a resumed run must take the same steps: a step count fixed up front, no end decided by the clock
        raise SystemExit("--checkpoint-dir needs --steps N, --checkpoint-every >= 1 and no --hold-until")

    tasks = tuple(t.strip() for t in args.tasks.split(","))
    if not tasks or len(set(tasks)) != len(tasks) or not set(tasks) <= set(ALL_TASKS):
        raise SystemExit(f"--tasks: expected distinct names of {ALL_TASKS}, got {args.tasks!r}")
    task_weights = parse_task_weights(args.task_weights, tasks)
    seq_len, gen_length = shapes_for(tasks)
    t0 = time.time()
    config = model_config(
        args.tiny, d_model=args.d_model, n_layers=args.layers, family=args.family, max_seq_len=max(1024, seq_len)
    )
    # build the data in forked workers BEFORE anything starts JAX's backend threads (fork + threads can deadlock)
    pool_np = build_pool(args.pool, args.seed, args.workers, args.levels, tasks)
    if args.attention == "auto":
        args.attention = "cudnn" if jax.default_backend() == "gpu" else "xla"
    print(
        f"pool: {len(pool_np[0])} rows x {seq_len} built in {time.time() - t0:.1f}s "
        f"(max len {pool_np[1].max()}); backend {jax.default_backend()}",
        flush=True,
    )
    pool = tuple(jnp.asarray(a) for a in pool_np)

    if args.init:
        # continue from an earlier run (its bf16 safetensors become the fp32 master weights; Adam restarts)
        import dllm_jax

        start = dllm_jax.load(args.init, dtype="float32", layer_layout="stacked")
        if start.config.replace(dtype=config.dtype) != config:
            raise SystemExit(
                f"--init {args.init}: its config differs from this run's (--d-model/--layers?):\n"
                f"  {start.config}\n  {config}"
            )
        params = start.params
        print(f"init from {args.init}", flush=True)
    else:
        params = init_params(config, jax.random.key(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"model: {n_params / 1e6:.2f}M params, d={config.d_model} L={config.n_layers} H={config.n_heads} "
        f"mlp={config.mlp_hidden} V={config.vocab_size}",
        flush=True,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(b1=0.9, b2=0.98, eps=1e-8),
        optax.add_decayed_weights(0.1, mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)),
    )
    opt_state = tx.init(params)
    step_fn = make_step(config, args.batch, args.full_frac, args.eps, tx, args.attention, args.levels, task_weights)
    if args.attention != "xla":  # fall back to the reference attention if the fused one does not compile here
        try:
            jax.block_until_ready(step_fn(params, opt_state, pool, jax.random.key(0), jnp.float32(0.0), jnp.int32(0)))
        except Exception as e:  # noqa: BLE001
            print(f"attention backend {args.attention!r} failed ({type(e).__name__}: {str(e)[:200]}); using xla")
            args.attention = "xla"
            step_fn = make_step(config, args.batch, args.full_frac, args.eps, tx, "xla", args.levels, task_weights)
    quick_set, quick_acc = quick_eval_set(tasks=tasks), make_quick_eval(config)
    hold_fn = None
    if args.hold_frac > 0 or args.hold_steps:
        # level-0 rows are at most ~80 tokens: a step over them cut to that length costs about half a full one
        per_level = len(pool_np[0]) // args.levels
        cut = int(-(-int(pool_np[1][:per_level].max()) // 16) * 16)
        pool0 = (pool[0][:per_level, :cut], pool[1][:per_level], pool[2][:per_level])
        hold_fn = make_step(config, args.batch, args.full_frac, args.eps, tx, args.attention, 1, task_weights)
        easy_set = quick_eval_set(difficulty=0.0, tasks=("locate", "lookup"))
        print(f"level-0 hold: rows cut to {cut} tokens", flush=True)

    total = None if args.steps == "auto" else int(args.steps)
    if hold_fn is not None and total is None:
        per_full = time_step(step_fn, params, opt_state, pool)  # the hold's end sets the step count from this
        print(f"auto: full steps take {per_full * 1e3:.1f} ms", flush=True)
    key = jax.random.key(args.seed + 1)
    t_train, t_calib, s = time.time(), None, 0
    hist = []
    # The learning rate: warmup, then the peak while holding at level 0, then cosine from the hold's end (when the
    # hold is adaptive, that end also fixes the step count: replay with --steps N --hold-steps H).
    holding = hold_fn is not None and args.hold_steps != 0
    hold_end = 0 if not holding else args.hold_steps  # None: the adaptive hold has not ended yet
    saved = TrainCheckpoints(args.checkpoint_dir) if args.checkpoint_dir else None
    if saved is not None and saved.latest_step() is not None:
        s, (params, opt_state), meta = saved.restore(like=(params, opt_state))
        hist, hold_end = [tuple(h) for h in meta["history"]], meta["hold_end"]
        holding = holding and (hold_end is None or s < hold_end)
        if meta["steps"] != total:
            raise SystemExit(f"--checkpoint-dir holds a run of --steps {meta['steps']}, not {total}")
        print(f"resumed from {args.checkpoint_dir} at step {s}", flush=True)
    while total is None or s < total:
        if holding and hold_end is None:
            budget_used = (time.time() - t_train) / args.time_budget if total is None else s / total
            if budget_used >= args.hold_frac:
                hold_end = s  # the adaptive hold used up its share of the run
        if holding and hold_end is not None and s >= hold_end:
            holding = False
            if total is None:
                total = s + max(1, int((args.time_budget - (time.time() - t_train)) / per_full))
            print(f"level-0 hold ends at step {s}; {total} steps in all", flush=True)
        lr = lr_at(s, total, args.lr, args.warmup, decay_start=None if holding else hold_end)
        if holding:
            max_level = 0
            params, opt_state, loss, ans_ce, gn = hold_fn(
                params, opt_state, pool0, jax.random.fold_in(key, s), jnp.float32(lr), jnp.int32(0)
            )
        else:
            ramp = args.curriculum_frac * ((total or 10**9) - hold_end)
            max_level = args.levels - 1 if ramp <= 0 else min(args.levels - 1, int(args.levels * (s - hold_end) / ramp))
            params, opt_state, loss, ans_ce, gn = step_fn(
                params, opt_state, pool, jax.random.fold_in(key, s), jnp.float32(lr), jnp.int32(max_level)
            )
        s += 1
        if total is None and hold_fn is None:
            if s == 10:
                jax.block_until_ready(loss)
                t_calib = time.time()
            elif s == 60:
                jax.block_until_ready(loss)
                per = (time.time() - t_calib) / 50
                total = max(61, int((args.time_budget - (time.time() - t_train)) / per) + 60)
                print(f"auto: {per * 1e3:.1f} ms/step -> --steps {total}", flush=True)
        if s % args.log_every == 0 or s == total:
            loss, ans_ce, gn = float(loss), float(ans_ce), float(gn)
            probe = {t: round(float(quick_acc(params, *quick_set[t])), 3) for t in tasks}
            hist.append((s, loss, ans_ce, probe))
            easy = ""
            if holding:
                easy_probe = {t: round(float(quick_acc(params, *easy_set[t])), 3) for t in easy_set}
                easy = f" level-0 {easy_probe}"
                if args.hold_until is not None and hold_end is None and min(easy_probe.values()) >= args.hold_until:
                    hold_end = s  # the match has formed: move on to the curriculum
            print(
                f"step {s}/{total} loss {loss:.4f} answer-ce {ans_ce:.4f} gnorm {gn:.2f} lr {lr:.2e} "
                f"level<={max_level} one-shot heldout {probe}{easy} t {time.time() - t_train:.0f}s",
                flush=True,
            )
        if saved is not None and (s % args.checkpoint_every == 0 or s == total):
            saved.save(s, (params, opt_state), {"history": hist, "hold_end": hold_end, "steps": total})
    jax.block_until_ready(params)
    train_s = time.time() - t_train
    print(f"trained {s} steps in {train_s:.1f}s", flush=True)

    out = Path(args.out)
    checkpoint.export_hf(params, config, out)
    # the task prompts use LLaDA's chat template (its header tokens are in the vocabulary), whatever the layout
    V.write(out, chat_template=FAMILIES["llada"].chat_template if config.family != "llada" else None)
    # the CLI's defaults for this model: it was trained to answer in gen_length tokens
    block = min(gen_length, 32)
    (out / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": gen_length, "block_length": block, "steps": gen_length}, indent=2)
    )
    # the flags the command line below repeats as they are
    flags = "family batch lr warmup full_frac eps pool seed d_model layers levels curriculum_frac".split()
    meta = {k: getattr(args, k) for k in ("tiny", *flags, "attention", "init", "task_weights")}
    meta.update(hold_frac=args.hold_frac, hold_until=args.hold_until, hold_steps=hold_end)
    meta.update(
        steps=s,
        train_seconds=round(train_s, 1),
        backend=jax.default_backend(),
        loss_history=hist,
        gen_length=gen_length,
        tasks=list(tasks),
        command=f"python bench/train_demo.py --out {args.out} --steps {s}"
        + "".join(f" --{k.replace('_', '-')} {getattr(args, k)}" for k in flags)
        + (f" --task-weights {args.task_weights}" if args.task_weights else "")
        + (f" --hold-steps {hold_end}" if hold_end else "")
        + (f" --init {args.init}" if args.init else "")
        + (" --tiny" if args.tiny else ""),
    )
    if args.eval_n > 0:
        t1 = time.time()
        acc = evaluate(params, config, args.eval_n, tasks=tasks)
        meta["heldout_accuracy_nocache"] = acc
        print(f"held-out exact match (no cache, n={args.eval_n}/cell, {time.time() - t1:.0f}s):", flush=True)
        for k, a in acc.items():
            print(f"  {k:16s} {a:.3f}", flush=True)
    (out / "train_args.json").write_text(json.dumps(meta, indent=2))
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
