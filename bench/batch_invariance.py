"""Does an answer depend on what else shares its batch? The bundled model, mixed concurrent requests through the
engine (built as `dllm-jax serve --max-model-len 256 --block-lengths 4 [--batch-invariant]` builds it), each answer
compared with solo `generate` of the same request and settings; and what the batch-invariant mode costs the engine.

Requests: held-out problems of the three tasks at the three placements, temperature 0 or 0.7 and 4 or 8 steps a
block drawn per request (gen_length 8, block 4), all submitted at once to an engine of --max-batch rows. Rows per
dtype x mode: `equal_to_solo` (answers bit-identical to solo generate), `correct` (exact match with the task's
answer, engine and solo), the engine's wall seconds and tokens/s (after a warm-up), the mode's cost as a ratio to
the ordinary mode of the same dtype. Writes bench/results/batch_invariance_<h200|platform>.json.

    PYTHONPATH=. python bench/batch_invariance.py --run NAME                 # 300 requests, fp32 and bf16
    PYTHONPATH=. python bench/batch_invariance.py --requests 30 --dtypes float32 --run smoke
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import common  # noqa: E402

import dllm_jax  # noqa: E402
from dllm_jax import GenerationConfig, answer_tokens, generate  # noqa: E402
from dllm_jax.engine import Engine, EngineConfig  # noqa: E402
from dllm_jax.io.loading import DEFAULT_MODEL_DIR  # noqa: E402
from dllm_jax.tasks import generators as G  # noqa: E402


def requests(model, n: int, invariant: bool) -> list[tuple]:
    """(prompt, config, seed, answer) of n held-out problems over every task and placement, mixed settings."""
    vocab, rng, items = model.tokenizer.hf.get_vocab(), np.random.default_rng(0), []
    per_task = -(-n // len(G.TASKS))
    for task in G.TASKS:
        for i, problem in enumerate(G.generate(task, "heldout", per_task, seed=1)):
            r = G.render(problem, G.PLACEMENTS[i % len(G.PLACEMENTS)], vocab)
            gc = GenerationConfig.from_options(
                gen_length=8, block_length=4, steps=[4, 8][(i // 2) % 2], temperature=[0.0, 0.7][i % 2],
                cache="dual", batch_invariant=invariant,
            )  # fmt: skip
            items.append((r.prompt, gc, int(rng.integers(1 << 30)), r.answer))
    return items[:n]


def serve(engine: Engine, items) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    ids = [engine.add_request(p, gc, affix=None, seed=seed) for p, gc, seed, _ in items]
    while engine.has_unfinished():
        engine.step()
    answers = []
    for rid in ids:
        r = engine.request(rid)
        answers.append(r.answer(tuple(r.config.stop_token_ids(engine.model.config))))
        engine.release(rid)
    return answers, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--max-batch", type=int, default=16)
    common.output_args(ap)
    args = ap.parse_args(argv)
    import jax

    dev = jax.devices()[0]
    name = f"batch_invariance_{'h200' if 'H200' in dev.device_kind else dev.platform}.json"
    rows: list[dict] = []
    for dtype in args.dtypes:
        model = dllm_jax.load(DEFAULT_MODEL_DIR, dtype=dtype)
        for invariant in (False, True):
            items = requests(model, args.requests, invariant)
            # dllm-jax serve --max-batch N --max-model-len 256 --block-lengths 4 [--batch-invariant]
            config = EngineConfig(
                max_batch=args.max_batch, max_model_len=256, block_lengths=(4,), batch_invariant=invariant
            )
            engine = Engine(model, config)
            engine.warmup(progress=False)
            serve(engine, items[: args.max_batch])  # settles the host side too
            answers, seconds = serve(engine, items)
            solo = [
                answer_tokens(generate(model, [p], gc, seed=seed).tokens, model.config, gc)[0]
                for p, gc, seed, _ in items
            ]
            tokens = sum(len(a) for a in answers)
            row = dict(
                dtype=dtype,
                batch_invariant=invariant,
                requests=len(items),
                equal_to_solo=int(sum(a == s for a, s in zip(answers, solo))),
                correct_engine=int(sum(a == it[3] for a, it in zip(answers, items))),
                correct_solo=int(sum(s == it[3] for s, it in zip(solo, items))),
                engine_seconds=round(seconds, 3),
                tokens_per_s=round(tokens / seconds, 1),
            )
            base = next((r for r in rows if r["dtype"] == dtype and not r["batch_invariant"]), None)
            row["tokens_per_s_vs_ordinary"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
            rows.append(row)
            print(row, flush=True)
            common.write_results(
                name,
                common.meta(model=str(DEFAULT_MODEL_DIR.name), max_batch=args.max_batch, gen_length=8, block=4),
                rows,
                args.out,
                args.run,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
