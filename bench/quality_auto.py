"""anchor_ratio "auto" (or shallow_depth "auto") on the bundled model: the accuracy it reaches, the ratio (depth) it
chooses per affix, the block-start tokens it saves against sharing off, and what calibrating and auditing cost, per
task x placement.

    PYTHONPATH=. python bench/quality_auto.py                  # 20 affixes x 50 requests per cell (n = 1000)
    PYTHONPATH=. python bench/quality_auto.py --affixes 2 --per-affix 8 --tasks rule --placements prefix
    PYTHONPATH=. python bench/quality_auto.py --technique shallow --clients 8   # BiCache: quality_auto_shallow.json

Each cell runs a fresh engine behind `EngineService` (the server's engine thread: calibration, shadows and audits
exactly as `dllm-jax serve --anchor-ratio auto` runs them) with closed-loop clients: held-out problems of the task
(dllm_jax.tasks), `--per-affix` requests per shared part (its questions cycled: repeated questions are traffic too),
the shared part named as the affix. The same requests are then decoded exactly (no sharing) through the same
engine for the exact path's accuracy, and at fixed ratios (depths) for comparison rows. Writes
bench/results/quality_auto.json (rows per cell and setting, Wilson 95% intervals) and quality_auto.png; with
--technique shallow quality_auto_shallow.json and .png (the engine serves --depths; the ladder runs deepest first).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import dllm_jax  # noqa: E402
from dllm_jax import GenerationConfig  # noqa: E402
from dllm_jax.audit import AuditConfig, CalibrationConfig, affix_id, wilson  # noqa: E402
from dllm_jax.engine import Engine, EngineConfig  # noqa: E402
from dllm_jax.engine.block_manager import affix_key  # noqa: E402
from dllm_jax.server import EngineService  # noqa: E402
from dllm_jax.tasks import generators as G  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def requests_of(task: str, placement: str, affixes: int, per_affix: int, seed: int, vocab) -> list:
    """[(prompt ids, affix span, answer ids, shared id)]: `per_affix` requests for each of `affixes` shared parts
    of the held-out split (their questions cycled), interleaved as traffic arrives (every affix in turn)."""
    stream = G.iter_problems(task, "heldout", seed=seed, per_shared=64)
    groups: dict[str, list] = {}
    for p in stream:
        if len(groups) == affixes and p.shared_id not in groups:
            break
        groups.setdefault(p.shared_id, []).append(G.render(p, placement, vocab))
    cycled = [list(itertools.islice(itertools.cycle(rs), per_affix)) for rs in groups.values()]
    return [r for round_ in zip(*cycled) for r in round_]


async def serve_all(service: EngineService, rendered, config, auto: str | None, clients: int) -> list[list[int]]:
    """Every request through the service by `clients` closed-loop clients; each one's answer tokens."""
    answers: list = [None] * len(rendered)
    todo = iter(range(len(rendered)))

    async def client():
        for i in todo:
            r = rendered[i]
            _, stream = await service.submit(r.prompt, config, r.affix_span, 0, auto=auto)
            tokens = []
            while not (out := await stream.get()).finished:
                tokens += out.tokens
            answers[i] = tokens + out.tokens

    await asyncio.gather(*[client() for _ in range(clients)])
    for _ in range(6000):  # the shadows that are still to run (they take the rows users leave)
        if service.auditor.report()["pending"] == 0 and not service.engine.has_unfinished():
            break
        await asyncio.sleep(0.05)
    return answers


def run_cell(model, task, placement, args) -> list[dict]:
    vocab = model.tokenizer.hf.get_vocab()
    rendered = requests_of(task, placement, args.affixes, args.per_affix, args.seed, vocab)
    base = dict(gen_length=8, block_length=4, steps=8, cache="dual")
    shallow = args.technique == "shallow"
    engine_config = EngineConfig(
        max_batch=16,
        max_model_len=256,
        block_lengths=(4,),
        kv_budget_bytes=64 << 20,
        shallow_depths=tuple(args.depths) if shallow else (),
    )
    rows = []
    settings = [("auto", dict(affix="anchors"), args.technique), ("exact", {}, None)]
    if shallow:
        settings += [(f"shallow_{d}", dict(affix="shallow", shallow_depth=d), None) for d in args.fixed_depths]
    else:
        settings += [(f"anchors_{r:g}", dict(affix="anchors", anchor_ratio=r), None) for r in args.fixed]
    for name, extra, auto in settings:
        service = EngineService(
            Engine(model, engine_config),
            warmup=False,
            audit=AuditConfig(fraction=args.audit_fraction if auto else 0.0),
            calibration=CalibrationConfig(target=args.target),
        ).start()
        t0 = time.time()
        config = GenerationConfig.from_options(**base, **extra)
        answers = asyncio.run(serve_all(service, rendered, config, auto, args.clients))
        seconds = time.time() - t0
        report = service.auditor.report()
        service.stop()
        correct = [a == r.answer for a, r in zip(answers, rendered)]
        k, n = int(sum(correct)), len(correct)
        row = dict(task=task, placement=placement, setting=name, clients=args.clients, n=n, correct=k, accuracy=k / n)
        row.update(ci95=[round(v, 4) for v in wilson(k, n)], wall_seconds=round(seconds, 1))
        affix_tokens = [r.affix_span[1] - r.affix_span[0] for r in rendered]
        if name == "auto":
            level, exact = ("depth", 0) if shallow else ("ratio", 1.0)
            chosen = {c["affix"]: c[level] for c in report["calibration"]}
            ids = [affix_id(affix_key(r.prompt[slice(*r.affix_span)])) for r in rendered]
            levels = [chosen.get(a, exact) for a in dict.fromkeys(ids)]
            if shallow:
                row.update(depths_chosen=levels, share_affixes_reused=float(np.mean([d > 0 for d in levels])))
            else:
                row.update(ratios_chosen=levels, share_affixes_at_most_0_3=float(np.mean([r <= 0.3 for r in levels])))
            row.update(
                shadow_requests=report["shadows"],
                shadow_tokens=report["shadow_tokens"],
                shadows_per_request=round(report["shadows"] / n, 3),
                calibration=report["calibration"],
            )
            # block-start token-layers not recomputed (ACache: the affix's non-anchor share; BiCache: its tokens in
            # the layers below the depth) at the requests' last served level, against sharing off: an estimate from
            # the final levels (early requests ran exactly)
            kept = (lambda d: d / model.config.n_layers) if shallow else (lambda r: 1 - r)
            saved = sum(kept(chosen.get(a, exact)) * t for a, t in zip(ids, affix_tokens))
            total = sum(len(r.prompt) + 8 for r in rendered)
            row["block_start_tokens_saved_share"] = round(saved / total, 4)
        rows.append(row)
        print(f"{task}/{placement} {name:12s} {k}/{n} = {k / n:.3f}  ({seconds:.0f} s)", flush=True)
    exact = next(r["accuracy"] for r in rows if r["setting"] == "exact")
    for r in rows:
        r["of_exact"] = round(r["accuracy"] / exact, 4) if exact else None
    return rows


def plot(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys((r["task"], r["placement"]) for r in rows))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
    width = 0.8 / len(settings)
    by = {(r["task"], r["placement"], r["setting"]): r for r in rows}
    for j, s in enumerate(settings):
        got = [by.get((*c, s)) for c in cells]
        acc = [r["accuracy"] if r else 0 for r in got]
        err = [
            [r["accuracy"] - r["ci95"][0] if r else 0 for r in got],
            [r["ci95"][1] - r["accuracy"] if r else 0 for r in got],
        ]
        ax.bar(np.arange(len(cells)) + j * width, acc, width, yerr=err, label=s, capsize=2)
    ax.set_xticks(np.arange(len(cells)) + 0.4 - width / 2, [f"{t}\n{p}" for t, p in cells])
    ax.set_ylabel("exact-match accuracy (95% Wilson)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=len(settings))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(G.TASKS), choices=list(G.TASKS))
    ap.add_argument("--placements", nargs="+", default=list(G.PLACEMENTS), choices=list(G.PLACEMENTS))
    ap.add_argument("--affixes", type=int, default=20, help="shared parts per cell")
    ap.add_argument("--per-affix", type=int, default=50, help="requests per shared part")
    ap.add_argument("--target", type=float, default=0.95, help="--agreement-target")
    ap.add_argument("--audit-fraction", type=float, default=0.02)
    ap.add_argument("--fixed", type=float, nargs="*", default=[0.2], help="fixed ratios decoded for comparison")
    ap.add_argument("--technique", default="anchors", choices=["anchors", "shallow"], help="what auto calibrates")
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 6], help="shallow: the depths the engine serves")
    ap.add_argument("--fixed-depths", type=int, nargs="*", default=[4], help="shallow: fixed depths for comparison")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--clients",
        type=int,
        default=16,
        help="closed-loop clients (max_batch is 16: at 16 users always fill the batch and shadows rarely run)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="default: bench/results/quality_auto[_shallow].json")
    ap.add_argument("--plot", default=None, help="default: the --out path as .png")
    args = ap.parse_args(argv)
    stem = "quality_auto" + ("_shallow" if args.technique == "shallow" else "")
    args.out = args.out or str(REPO / "bench" / "results" / f"{stem}.json")
    args.plot = args.plot or str(Path(args.out).with_suffix(".png"))
    model = dllm_jax.load(dtype=args.dtype)
    rows = []
    t0 = time.time()
    for task in args.tasks:
        for placement in args.placements:
            rows += run_cell(model, task, placement, args)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip()
    meta = dict(
        commit=commit,
        jax=jax.__version__,
        platform=jax.default_backend(),
        machine=platform.machine(),
        dtype=args.dtype,
        affixes=args.affixes,
        per_affix=args.per_affix,
        target=args.target,
        audit_fraction=args.audit_fraction,
        technique=args.technique,
        ladder=sorted(args.depths, reverse=True) if args.technique == "shallow" else list(CalibrationConfig().ladder),
        seconds=round(time.time() - t0, 1),
        generation=dict(gen_length=8, block_length=4, steps=8, cache="dual", temperature=0),
    )
    out = Path(args.out)  # rows of other client counts already there are kept (one run per load)
    kept = json.loads(out.read_text()) if out.exists() else dict(meta={}, rows=[])
    runs = {k: v for k, v in kept.get("meta", {}).get("runs", {}).items() if k != str(args.clients)}
    rows = [r for r in kept["rows"] if r.get("clients", 16) != args.clients] + rows
    meta = dict(runs={**runs, str(args.clients): meta})
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    if args.plot:
        what = (
            'shallow_depth "auto" against exact decoding and fixed depths'
            if args.technique == "shallow"
            else ('anchor_ratio "auto" against exact decoding and fixed ratios')
        )
        plot([r for r in rows if r.get("clients", 16) == args.clients], Path(args.plot), f"{what} (bundled model)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
