"""The serving engine (dllm_jax/engine) on tiny fp32 checkpoints: every request's tokens equal `generate` on that
request alone with the same settings, whatever shares its batch and whenever it arrives; one stored copy of a
shared affix at any placement; a pool smaller than the demand drains; a warmed-up engine compiles nothing more; bad
requests are refused at submit."""

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np
import pytest
from engine_invariants import check_block_manager
from hypothesis import given, settings
from hypothesis import strategies as st

from dllm_jax import GenerationConfig, answer_tokens, generate
from dllm_jax.compilation import compile_totals
from dllm_jax.decoding.caches import acache, bicache
from dllm_jax.decoding.config import Shallow
from dllm_jax.engine import Engine, EngineConfig, RequestError
from dllm_jax.engine import engine as engine_module
from dllm_jax.engine.block_manager import pages_for
from dllm_jax.engine.engine import KVBudgetError
from dllm_jax.engine.request import Status
from dllm_jax.engine.runner import Ladder
from dllm_jax.engine.scheduler import QueueFull
from dllm_jax.transformer.attention import LOOP_MIN_WIDTH

opts = GenerationConfig.from_options
RNG = np.random.default_rng(0)
AFFIX = RNG.integers(0, 80, 20).tolist()
OWN = [RNG.integers(0, 80, n).tolist() for n in (5, 9, 3, 6, 1, 7)]
# (prompt, the affix's span): prefix, infix and suffix placements, own parts of mixed lengths
PLACED = [
    (AFFIX + OWN[0], (0, 20)),
    (OWN[1][:2] + AFFIX + OWN[1][2:], (2, 22)),
    (OWN[2] + AFFIX, (3, 23)),
    (AFFIX + OWN[3], (0, 20)),
    (OWN[4] + AFFIX + OWN[5], (1, 21)),
]


# block starts in chunks of 32: a call's window runs 1 or 2 chunks, the rest skipped
BASE = dict(
    max_batch=4, kv_budget_bytes=1 << 22, min_affix_tokens=8, max_model_len=64, block_lengths=(4,), window_chunk=32
)


def engine_for(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{**BASE, **kw}))


WARM = dict(batch_sizes=(2, 4), shallow_depths=(1,))  # BiCache at depth 1 served too


@pytest.fixture(scope="module")
def warm_engines(models_fp32):
    """One engine per family with every program compiled, warmed when a test first asks for it and shared by the
    tests that serve on it (they leave it idle). Each family's tests run in one xdist group: one warm-up each."""

    class Warmed(dict):
        def __missing__(self, name):
            engine = engine_for(models_fp32[name], **WARM)
            info = engine.warmup(progress=False)
            assert info["programs"] == engine.program_count() and engine.warmed
            self[name] = engine
            return engine

    return Warmed()


def solo(model, prompt, gc, span=None, seed=0, affix=AFFIX, commit_steps=None):
    """generate on the request alone: the reference every engine answer must equal (commit_steps: a list that
    receives the step that committed each answer token)."""
    build = bicache.build_shared_prefix if isinstance(gc.cache.affix, Shallow) else acache.build_shared_affix
    shared = build(model.params, model.config, affix) if gc.cache.affix is not None else None
    out = generate(
        model, [prompt], gc, seed=seed, shared_affix=shared, affix_spans=[span] if gc.cache.affix is not None else None
    )
    answer = answer_tokens(out.tokens, model.config, gc)[0]
    if commit_steps is not None:
        commit_steps.append(out.commit_steps[0, : len(answer)].tolist())
    return answer


def serve(engine, items, arrival_seed=None, commit_steps=None):
    """Submit (prompt, config, span, seed) items, in order or spread over the first steps at random; run to the end.
    Returns each item's answer, checking that every request was answered exactly once (commit_steps: a list that
    receives each item's streamed commit steps, one per answer token)."""
    ids = [None] * len(items)
    order = list(range(len(items)))
    rng = np.random.default_rng(arrival_seed)
    if arrival_seed is not None:
        rng.shuffle(order)
    pending, seen, streamed = list(order), {}, {}
    while pending or engine.has_unfinished():
        for _ in range(len(pending) if arrival_seed is None else int(rng.integers(0, 3))):
            if pending:
                i = pending.pop(0)
                prompt, gc, span, seed = items[i]
                ids[i] = engine.add_request(prompt, gc, affix=span, seed=seed)
        for out in engine.step():
            assert not seen.get(out.request_id, False), "a request answered after it finished"
            seen[out.request_id] = out.finished
            assert len(out.commit_steps) == len(out.tokens)
            streamed.setdefault(out.request_id, []).extend(out.commit_steps)
    assert all(seen[i] for i in ids)
    answers = []
    for rid in ids:
        r = engine.request(rid)
        answers.append(r.answer(tuple(r.config.stop_token_ids(engine.model.config))))
        if commit_steps is not None:  # streamed: the whole block where stops do not end the answer
            commit_steps.append(streamed.get(rid, [])[: len(answers[-1])])
        engine.release(rid)
    return answers


# (technique, sampling, max_tokens, steps per block): every technique, sampler rule, temperature, length and step
# count comes up; the solo references compile one program per entry
CONFIGS = [
    (dict(), dict(), 8, 2),
    (dict(affix="anchors", anchor_ratio=0.0), dict(temperature=0.7), 4, 4),
    (dict(affix="anchors", anchor_ratio=0.2), dict(threshold=0.3), 12, 4),
    (dict(affix="anchors", anchor_ratio=1.0), dict(), 8, 4),
    (dict(affix="naive"), dict(factor=1.0), 8, 4),
    (dict(affix="shallow", shallow_depth=1), dict(temperature=0.7), 8, 2),
    (dict(affix="anchors", anchor_ratio=0.2), dict(temperature=0.7), 4, 2),
]
# Dream's sampler filters, per-row data in the engine (LLaDA's remasking has none: refused there)
DREAM_FILTERS = (dict(affix="anchors", anchor_ratio=0.2), dict(temperature=0.7, top_p=0.9, top_k=5), 4, 2)


def random_stream(n: int, seed: int, max_len: int = 64, configs: list[tuple] = CONFIGS) -> list[tuple]:
    """n requests of random affixes (lengths, placements), own lengths, seeds and EOS stops over `configs` in turn,
    each prompt + generation within max_len: (prompt, config, span, seed, affix tokens)."""
    rng = np.random.default_rng(seed)
    affixes = [rng.integers(0, 80, int(a)).tolist() for a in (8, 13, 24)]
    items = []
    for i in range(n):
        technique, sampling, gen, spb = configs[(i + seed) % len(configs)]
        affix = affixes[int(rng.integers(len(affixes)))]
        own = rng.integers(0, 80, int(rng.integers(1, max_len - gen - len(affix) + 1))).tolist()
        cut = int(rng.choice([0, len(own) // 2, len(own)]))  # prefix, infix, suffix
        prompt = own[:cut] + affix + own[cut:]
        gc = opts(
            gen_length=gen,
            block_length=4,
            steps=gen // 4 * spb,
            cache="dual",
            stop_at_eos=bool(i % 2),
            **technique,
            **sampling,
        )
        items.append((prompt, gc, (cut, cut + len(affix)), int(rng.integers(1000)), affix))
    return items


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.xdist_group(f"engine-{n}")) for n in ("llada", "dream")]
)
def test_warmed_engine_compiles_nothing_and_equals_solo_generate(name, models_fp32, warm_engines):
    """After a warm-up with no samples, a random stream (affix lengths and placements, question lengths, max_tokens,
    temperatures, thresholds and factors, Dream's top-p / top-k, step counts, techniques, EOS stops, random arrivals,
    up to max_model_len) compiles nothing (XLA's own compile events), and each answer is the request's solo
    `generate` answer."""
    m, engine = models_fp32[name], warm_engines[name]
    # LLaDA: each config once; Dream (its own sampler): the ones that sample, threshold or share differently (each
    # solo reference is a compile: the suite's time)
    configs = CONFIGS if name == "llada" else [CONFIGS[i] for i in (1, 2, 5)] + [DREAM_FILTERS]
    items = random_stream(len(configs), seed={"llada": 1, "dream": 2}[name], configs=configs)
    before, steps, solo_steps = compile_totals()[0], [], []
    got = serve(engine, [(p, gc, span, seed) for p, gc, span, seed, _ in items], arrival_seed=3, commit_steps=steps)
    assert compile_totals()[0] == before
    assert engine.stats()["compiles_after_warmup"] == 0
    assert got == [solo(m, p, gc, span, seed, affix, solo_steps) for p, gc, span, seed, affix in items]
    assert steps == solo_steps  # each token committed at the step of its block where generate committed it
    assert engine.block_manager.num_used_pages == 0


@pytest.mark.xdist_group("engine-llada")
def test_program_count_is_fixed_by_the_settings(models_fp32, warm_engines):
    """The programs are known before serving, do not change with traffic, and follow the settings only."""
    m, engine = models_fp32["llada"], warm_engines["llada"]
    count = engine.program_count()
    assert engine_for(m, **WARM).program_count() == count  # a fresh engine, before any traffic
    for seed in (5, 6):  # two different traffic samples
        items = random_stream(4, seed)
        serve(engine, [(p, gc, span, s) for p, gc, span, s, _ in items])
        assert engine.program_count() == engine.stats()["programs"] == count
    # 2 batch sizes: block, BiCache block; ACache's probe for 1 and 2-4 requests; the affix build, BiCache's layer
    # inputs and placement (one width each: the ladder's read_len)
    assert count == 2 * 2 + 2 + 3
    assert engine_for(m, shallow_depths=(1,)).program_count() == 2 * 2 + 2 + 3  # the default ladder: 1, 4
    assert engine_for(m, max_batch=16).program_count() == 3 + 2 + 1  # blocks of 1, 4, 16; probes of 1, 4; affix
    ladder = Ladder.for_settings(16, 2000)  # LLaDA-8B's serve defaults but a 2000-token max_model_len
    assert ladder.batch_sizes == (1, 4, 16) and (ladder.window_chunk, ladder.read_len) == (256, 2048)  # whole chunks
    # <= 2048 tokens a chunk of all rows, >= 512 where a row's chunk can shrink to 128 (4 rows); 32 at 64 rows
    assert [ladder.chunk(b) for b in ladder.batch_sizes] == [256, 128, 128]
    assert Ladder.for_settings(64, 2000).chunk(64) == 32
    assert Ladder.for_settings(16, 2000, window_chunk=64).chunk(4) == 64  # never above window_chunk
    assert Ladder.for_settings(16, 2000, (2, 16)).batch_sizes == (2, 16)
    assert engine_for(m, batch_sizes=(2, 4)).program_count() == 2 + 2 + 1  # no BiCache depth served


def test_a_few_long_windows_run_in_a_call_of_their_own():
    """Every row of a block call pays its block start's chunks up to the longest window: `Ladder.calls` splits off
    the long rows where that saves more than the other call's steps cost, and keeps rows of like windows together.
    LLaDA-8B's serve defaults on a GPU: an audit's shadow (an unshared 2400-token window) among 14 ACache rows."""
    ladder = Ladder.for_settings(16, 4096)
    windows = [400] * 7 + [2400] + [400] * 7
    assert ladder.calls(windows, [8] * 15, 32) == [[7], [*range(7), *range(8, 15)]]
    assert ladder.calls([900] * 16, [8] * 16, 32) == [list(range(16))]
    assert ladder.calls([300, 2000, 400, 2200], [8] * 4, 32) == [[0, 1, 2, 3]]  # half long: a second call's steps
    # three tiers, longest first
    assert ladder.calls([100] * 10 + [1000, 3000], [8] * 12, 32) == [[11], [10], list(range(10))]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.integers(1, 32)), min_size=1, max_size=16), st.sampled_from([4, 16]))
def test_calls_partition_the_rows_and_never_cost_more_than_one_call(rows, max_batch):
    ladder = Ladder.for_settings(max_batch, 4096)
    rows = rows[:max_batch]
    windows, steps = [w for w, _ in rows], [s for _, s in rows]
    calls = ladder.calls(windows, steps, 32)
    assert sorted(i for c in calls for i in c) == list(range(len(rows))) and all(c == sorted(c) for c in calls)
    cost = sum(ladder.cost([windows[i] for i in c], max(steps[i] for i in c), 32) for c in calls)
    assert cost <= ladder.cost(windows, max(steps), 32)


def test_wide_read_tables_run_in_chunks_and_every_answer_stays_solo(models_fp32):
    """Read tables wider than LOOP_MIN_WIDTH (max_model_len 640) go through `attend_slot_chunks`' loop off the GPU,
    only the chunks each call's longest list fills: a 300-token affix shared with ACache at an infix (its list 2
    chunks), a 400-token unshared prompt (4 chunks) and a short one, every answer as solo `generate`."""
    m = models_fp32["llada"]
    wide = dataclasses.replace(m, config=dataclasses.replace(m.config, max_seq_len=640))
    engine = engine_for(wide, max_model_len=640, window_chunk=128)
    assert engine.runner.ladder.read_len > LOOP_MIN_WIDTH
    affix, gc = RNG.integers(0, 80, 300).tolist(), opts(gen_length=8, block_length=4, steps=4, cache="dual")
    shared = opts(gen_length=8, block_length=4, steps=4, cache="dual", affix="anchors", anchor_ratio=0.2)
    items = [(OWN[1][:2] + affix + OWN[1][2:], shared, (2, 302), 1), (RNG.integers(0, 80, 400).tolist(), gc, None, 2)]
    items.append((OWN[0], gc, None, 3))
    got = serve(engine, items)
    assert got == [solo(wide, p, c, span, seed, affix=affix) for p, c, span, seed in items]


def test_a_long_window_runs_apart_and_every_answer_stays_solo(models_fp32):
    """One long unshared prompt beside a short one and an ACache one (probed in the same step): two calls (the long
    row alone), on programs the warm-up compiled (nothing compiles after it), every answer as solo `generate`."""
    m = models_fp32["llada"]
    engine = engine_for(m, max_model_len=192, window_chunk=16)
    engine.warmup(progress=False)
    gc = opts(gen_length=4, block_length=4, steps=1, cache="dual")  # a step costs little beside a 12-chunk window
    shared = opts(gen_length=8, block_length=4, steps=4, cache="dual", affix="anchors", anchor_ratio=0.2)
    items = [(RNG.integers(0, 80, 180).tolist(), gc, None, 0), (OWN[0], gc, None, 1)]
    items.append((PLACED[1][0], shared, PLACED[1][1], 2))  # an infix affix
    ids = [engine.add_request(p, c, affix=span, seed=seed) for p, c, span, seed in items]
    blocks, rows = engine.counters["blocks"], engine.counters["block_rows"]
    engine.step()
    assert (engine.counters["blocks"] - blocks, engine.counters["block_rows"] - rows) == (2, 3)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["compiles_after_warmup"] == 0
    got = [engine.request(i).answer(tuple(c.stop_token_ids(m.config))) for i, (_, c, _, _) in zip(ids, items)]
    assert got == [solo(m, p, c, span, seed) for p, c, span, seed in items]


@pytest.mark.xdist_group("engine-dream")
def test_different_settings_share_one_device_call(models_fp32, warm_engines):
    """Requests with different temperatures, thresholds, factors, steps and max_tokens run in one call."""
    engine = warm_engines["dream"]
    configs = [
        opts(gen_length=4, block_length=4, steps=2, cache="dual"),
        opts(gen_length=12, block_length=4, steps=12, cache="dual", temperature=0.9),
        opts(gen_length=8, block_length=4, cache="dual", threshold=0.5),
        opts(gen_length=8, block_length=4, steps=4, cache="dual", factor=2.0, top_p=0.9),
    ]
    ids = [engine.add_request(PLACED[i][0], gc, affix=None) for i, gc in enumerate(configs)]
    blocks, rows = engine.counters["blocks"], engine.counters["block_rows"]
    engine.step()
    assert engine.counters["blocks"] - blocks == 1 and engine.counters["block_rows"] - rows == 4
    while engine.has_unfinished():
        engine.step()
    for rid in ids:
        engine.release(rid)


@pytest.mark.xdist_group("engine-dream")
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # generate's own (the reference)
def test_settings_past_the_row_arrays_range_are_served_as_generate_serves_them(models_fp32, warm_engines):
    """A top_k past int32 and a factor past float32 (the server bounds neither): served as `generate` serves them (a
    top-k past the vocabulary filters nothing, such a factor commits a block at once) beside a plain request, with
    nothing compiled. Before, the int32 cast raised in the call's layout and failed every row of the call."""
    m, engine = models_fp32["dream"], warm_engines["dream"]
    items = [
        (PLACED[0][0], opts(gen_length=4, block_length=4, steps=4, cache="dual", temperature=0.7, top_k=2**40)),
        (PLACED[1][0], opts(gen_length=4, block_length=4, cache="dual", factor=1e300)),
        (PLACED[2][0], opts(gen_length=4, block_length=4, steps=4, cache="dual")),
    ]
    before = compile_totals()[0]
    got = serve(engine, [(p, gc, None, 3) for p, gc in items])
    assert compile_totals()[0] == before
    assert got == [solo(m, p, gc, seed=3) for p, gc in items] and all(got)


@pytest.mark.xdist_group("engine-llada")
def test_settings_outside_the_served_ones_are_refused(models_fp32, warm_engines):
    """Block length, BiCache depth and the sampler's static part are programs' keys: outside the served list, a
    RequestError names the setting and the list (before any device work)."""
    engine = warm_engines["llada"]
    with pytest.raises(RequestError, match=r"block_length=8 is not served: .* \[4\]"):
        engine.add_request([1, 2, 3], opts(gen_length=8, block_length=8, steps=8, cache="dual"))
    shallow2 = opts(gen_length=4, block_length=4, cache="dual", affix="shallow", shallow_depth=2)
    with pytest.raises(RequestError, match=r"shallow_depth=2 is not served: .* \[1\]"):
        engine.add_request(AFFIX + [1, 2], shallow2, affix=(0, 20))
    with pytest.raises(RequestError, match="sampler .* is not served"):
        engine.add_request([1, 2, 3], opts(gen_length=4, block_length=4, cache="dual", remasking="random"))
    # Dream's filters on LLaDA's sampler would be ignored: refused, naming the setting (top_p 1 filters nothing)
    for setting in (dict(top_p=0.9), dict(top_k=5), dict(alg="entropy")):
        name = next(iter(setting))
        with pytest.raises(RequestError, match=rf"^{name}=.* would be ignored: .* LLaDA's remasking sampler"):
            engine.add_request([1, 2, 3], opts(gen_length=4, block_length=4, cache="dual", **setting))
    rid = engine.add_request([1, 2, 3], opts(gen_length=4, block_length=4, cache="dual", top_p=1.0))
    while engine.has_unfinished():
        engine.step()
    assert engine.request(rid).finish_reason in ("length", "stop")
    engine.release(rid)


def test_a_request_without_a_config_decodes_with_the_models_schedule(models_fp32, tmp_path):
    """No config: the model's generation_config.json schedule (max_new_tokens, block_length, steps) at a block length
    the engine serves, with its sampler: what `dllm-jax serve` resolves for a request without those fields, never
    a library default the engine refuses (block 32 against the served 4)."""
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(max_new_tokens=6, block_length=4, steps=4)))
    m = dataclasses.replace(models_fp32["llada"], path=tmp_path)
    base = {k: v for k, v in BASE.items() if k != "block_lengths"}
    engine = Engine(m, EngineConfig(**base))
    assert engine.block_lengths == (4,)
    [answer] = engine.generate([OWN[1]], progress=False)  # 6 tokens round up to 2 blocks of 4, 2 steps a block
    assert answer == solo(m, OWN[1], opts(gen_length=8, block_length=4, steps=4, cache="dual"))
    # the model's block length not served: the first served one; steps that do not divide into its blocks: 1 a token
    default = Engine(m, EngineConfig(**base, block_lengths=(2, 8))).intake.default
    assert (default.schedule.gen_length, default.schedule.block_length, default.schedule.steps) == (6, 2, 6)
    assert default.cache.mode == "dual" and default.sampler == engine.sampler


@pytest.mark.xdist_group("engine-llada")
def test_a_failed_device_call_fails_only_its_requests(models_fp32, warm_engines):
    """A call that raises fails its requests (finish reason "error", pages freed, counted) and the engine serves on;
    a call that consumed the donated pool also fails every running request, and the rebuilt pool (affix copies
    rebuilt on use) serves answers equal to solo generate."""
    m, engine = models_fp32["llada"], warm_engines["llada"]
    gc = opts(gen_length=8, block_length=4, steps=4, cache="dual", affix="anchors", anchor_ratio=0.2)
    plain = opts(gen_length=8, block_length=4, steps=4, cache="dual")
    faults = {"calls": 0, "lose_pool": False}

    def inject(ids):
        if faults["calls"]:
            faults["calls"] -= 1
            if faults["lose_pool"]:  # what a device fault inside a call leaves: the donated buffers consumed
                for buf in engine.runner.k + engine.runner.v:
                    buf.delete()
            raise RuntimeError("injected device fault")

    engine.before_call = inject
    try:
        before = dict(engine.counters)
        for lose_pool in (False, True):
            ids = [engine.add_request(p, gc, affix=span) for p, span in PLACED[:2]]
            while not all(engine.request(i).anchors for i in ids):  # admitted, its affix built and probed
                engine.step()
            ids += [engine.add_request(PLACED[i][0], plain, affix=None) for i in (2, 3)]  # the batch is full
            waiting = engine.add_request(PLACED[4][0], plain, affix=None)  # max_batch 4: it waits for pages
            faults.update(calls=1, lose_pool=lose_pool)
            outs = []
            while engine.has_unfinished():
                outs += engine.step()
            failed = {o.request_id for o in outs if o.finish_reason == "error"}
            assert failed == set(ids) and all(o.finished and not o.tokens for o in outs if o.request_id in failed)
            r = engine.request(waiting)  # served after the fault
            assert r.answer(tuple(plain.stop_token_ids(m.config))) == solo(m, PLACED[4][0], plain)
            for rid in ids + [waiting]:
                engine.release(rid)
            assert engine.block_manager.num_used_pages == 0
        assert engine.counters["faults"] - before["faults"] == 2 and engine.consecutive_faults == 0
        assert engine.counters["pool_rebuilds"] - before["pool_rebuilds"] == 1
        assert engine.block_manager.num_cached_pages == 0  # the stored copies went with the pool
        again = serve(engine, [(p, gc, span, 0) for p, span in PLACED[:2]])
        assert again == [solo(m, p, gc, span) for p, span in PLACED[:2]]
        assert engine.stats()["compiles_after_warmup"] == 0
    finally:
        engine.before_call = None


@pytest.mark.xdist_group("engine-llada")
def test_requests_past_their_deadline_end_and_free_their_pages(warm_engines):
    """timeout: a running and a waiting request past their deadlines end at the next step (finish reason "timeout",
    no tokens, pages freed, counted); a non-positive timeout is refused."""
    engine = warm_engines["llada"]
    gc = opts(gen_length=12, block_length=4, steps=12, cache="dual")
    with pytest.raises(RequestError, match="timeout=0 must be a positive"):
        engine.add_request([1, 2, 3], gc, timeout=0)
    before = engine.counters["timed_out"]
    running = engine.add_request(PLACED[0][0], gc, affix=None, timeout=0.3)
    first = engine.step()  # admitted: its first block
    assert [o.request_id for o in first] == [running] and not first[0].finished
    waiting = engine.add_request(PLACED[1][0], gc, affix=None, timeout=0.3)
    time.sleep(0.35)
    outs = engine.step()
    assert {(o.request_id, o.finish_reason, len(o.tokens)) for o in outs} == {
        (running, "timeout", 0),
        (waiting, "timeout", 0),
    }
    assert not engine.has_unfinished() and engine.block_manager.num_used_pages == 0
    assert engine.counters["timed_out"] - before == 2
    for rid in (running, waiting):
        engine.release(rid)


def test_a_fresh_process_warms_from_the_persistent_cache(tmp_path, hf_dirs):
    """The same engine settings in a new process load their programs from jax's persistent compilation cache."""
    script = tmp_path / "warm.py"
    script.write_text(
        "import json, sys\n"
        "import dllm_jax\n"
        "from dllm_jax.compilation import enable_compile_cache\nfrom dllm_jax.engine import Engine, EngineConfig\n"
        "enable_compile_cache(sys.argv[2])\n"
        "m = dllm_jax.load(sys.argv[1], dtype='float32')\n"
        "e = Engine(m, EngineConfig(max_batch=1, kv_budget_bytes=1 << 20, max_model_len=48, block_lengths=(4,)))\n"
        "print(json.dumps(e.warmup(progress=False)))\n"
    )
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, str(script), str(hf_dirs["llada"]), str(tmp_path / "cache")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, cached = runs
    assert cold["programs"] == cached["programs"] == 3  # block, probe, affix
    assert cold["compiles"] >= cold["programs"] and cached["compiles"] == 0 and cached["loaded"] >= cold["programs"]
    assert cached["seconds"] < 0.6 * cold["seconds"]


def test_one_stored_copy_at_every_placement(models_fp32):
    """N requests on one affix build its K/V once and hold its pages once, at prefix, infix and suffix placements;
    each request's private pages hold only what it writes; the entry stays cached for the next request."""
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors", anchor_ratio=0.2, stop_at_eos=False)
    engine = engine_for(m, max_batch=8)
    bm = engine.block_manager
    ids = [engine.add_request(p, gc, affix=span) for p, span in PLACED]
    engine.step()  # admits all, builds the affix once, probes, runs block 0
    # all 5 probed (calls of 4 and 1: a probe call takes at most 4), then decoded their first block together in that
    # same step: a burst starts together
    assert len(PLACED) == 5 and engine.counters["probes"] == 5 and engine.counters["blocks"] == 1
    assert all(engine.request(i).anchors and len(engine.request(i).generated) == 4 for i in ids)
    affix_pages = pages_for(len(AFFIX), bm.page_size)
    private = [pages_for(engine.request(i).private_tokens(), bm.page_size) for i in ids]
    assert engine.counters["affix_builds"] == 1 and engine.counters["affix_hits"] == len(PLACED) - 1
    assert bm.num_shared_pages == affix_pages  # one stored copy, held by all
    assert bm.num_used_pages == affix_pages + sum(private)
    k = acache.anchor_count(len(AFFIX), 0.2)
    assert all(engine.request(i).private_tokens() == len(engine.request(i).prompt) - len(AFFIX) + k + 8 for i in ids)
    while engine.has_unfinished():
        engine.step()
    assert bm.num_used_pages == 0 and bm.num_cached_pages == affix_pages
    last = engine.add_request(PLACED[0][0], gc, affix=PLACED[0][1])
    engine.step()
    assert engine.counters["affix_builds"] == 1  # a hit on the cached copy
    assert engine.counters["probes"] == len(PLACED) + 1 and len(engine.request(last).generated) == 4  # a 1-row probe
    check_block_manager(bm)


def test_probe_calls_take_the_new_requests_longest_window_first(models_fp32):
    """Every row of a probe call runs the chunks of its longest window, so the new requests of a step are probed
    longest window first, in calls of 4: the short one left over does not run a long one's chunks. Each ranking
    still reaches its own request: every answer equals solo `generate`."""
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors", anchor_ratio=0.2, stop_at_eos=False)
    engine = engine_for(m, max_batch=8)
    run_window, calls = engine.runner._run_window, []

    def spy(params, k, v, lay, **static):
        if static["probe"]:
            calls.append((int(lay["live"]), lay["x"].shape[0]))
        return run_window(params, k, v, lay, **static)

    engine.runner._run_window = spy
    ids = [engine.add_request(p, gc, affix=span) for p, span in PLACED]
    # windows: own tokens, the generation region (8) and, for the suffix, P - 1 (in the affix): 13, 17, 12, 14, 16;
    # in PLACED's order the call of 4 would hold the two longest and leave the 16 to the second call
    while engine.has_unfinished():
        engine.step()
    assert calls == [(17, 4), (12, 1)]
    for i, (prompt, span) in zip(ids, PLACED):
        assert engine.request(i).answer(()) == solo(m, prompt, gc, span)


def test_affixes_found_without_registration_and_by_handle(models_fp32):
    """ "auto": a span repeated from an earlier prompt is shared (a second request reuses the first one's copy);
    a registered handle is located in the prompt; both decode as with the explicit span."""
    m = models_fp32["dream"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors", anchor_ratio=0.2, stop_at_eos=False)
    engine = engine_for(m)
    first = engine.add_request(PLACED[1][0], gc)  # nothing seen before: no affix
    assert engine.request(first).affix_span is None
    second = engine.add_request(PLACED[2][0], gc)  # shares AFFIX (and nothing else) with the first prompt
    assert engine.request(second).affix_span == PLACED[2][1]
    handle = engine.register_affix(AFFIX)
    third = engine.add_request(PLACED[4][0], gc, affix=handle)
    assert engine.request(third).affix_span == PLACED[4][1]
    while engine.has_unfinished():
        engine.step()
    assert engine.request(second).answer(()) == solo(m, PLACED[2][0], gc, PLACED[2][1])
    assert engine.request(third).answer(()) == solo(m, PLACED[4][0], gc, PLACED[4][1])
    with pytest.raises(RequestError, match="does not contain the affix"):
        engine.add_request(OWN[0], gc, affix=handle)


def test_a_pool_smaller_than_the_demand_drains(models_fp32):
    """Room for about two requests at a time: every request waits its turn (FIFO), finishes once, with its solo
    tokens; the pool is idle at the end."""
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", stop_at_eos=False)
    per_request = max(pages_for(len(p) + 8, 16) for p, _ in PLACED)
    budget = 2 * per_request * 16 * m.config.n_layers * 2 * m.config.n_kv_heads * m.config.head_dim * 4
    engine = engine_for(m, kv_budget_bytes=budget)
    assert engine.block_manager.num_pages == 2 * per_request
    items = [(p, gc, None, 0) for p, _ in PLACED * 2]
    most_running = []
    ids = [engine.add_request(p, gc_, affix=None) for p, gc_, _, _ in items]
    while engine.has_unfinished():
        engine.step()
        most_running.append(len(engine.scheduler.running))
    assert max(most_running) <= 2 and len(engine.scheduler.waiting) == 0
    answers = [engine.request(i).answer(()) for i in ids]
    assert answers == [solo(m, p, gc) for p, _, _, _ in items]
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_abort_frees_pages_and_streams_the_end(models_fp32):
    m = models_fp32["llada"]
    gc = opts(gen_length=12, block_length=4, steps=12, cache="dual", stop_at_eos=False)
    engine = engine_for(m)
    seen = []
    rid = engine.add_request(PLACED[0][0], gc, affix=None, on_block=seen.append)
    waiting = engine.add_request(PLACED[1][0], gc, affix=None)
    engine.step()
    assert seen[0].block == 0 and len(seen[0].tokens) == 4 and not seen[0].finished
    assert engine.abort(rid) and engine.abort(waiting)  # one running, one admitted with it (max_batch 4)
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert not engine.abort(rid) and not engine.abort("unknown")  # already finished; never submitted
    assert not engine.has_unfinished() and engine.block_manager.num_used_pages == 0
    assert engine.request(rid).status == engine.request(waiting).status == Status.FINISHED


def test_compiler_options_reach_the_block_programs(models_fp32, tmp_path):
    """EngineConfig.compiler_options are the block programs' XLA options (here XLA's dump directory, which then
    holds the block program), and answers are unchanged; a bad option is refused when the engine is made."""
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual")
    engine = engine_for(m, compiler_options=(("xla_dump_to", str(tmp_path)),))
    assert engine.generate([PLACED[0][0]], gc, affix=None, progress=False) == [solo(m, PLACED[0][0], gc)]
    assert any("block_call" in p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="No such compile option"):
        engine_for(m, compiler_options=(("xla_no_such_option", 1),))


def test_the_engines_xla_options_are_its_defaults_under_the_users(models_fp32, monkeypatch):
    """On a GPU the block programs keep their loops and conditionals in command buffers (XLA's default kinds plus
    WHILE and CONDITIONAL); EngineConfig.compiler_options go over the engine's own, option by option."""
    from dllm_jax.compilation import loop_compiler_options

    kinds = dict(loop_compiler_options("gpu"))["xla_gpu_enable_command_buffer"].split(",")
    assert {"FUSION", "CUBLAS", "CUSTOM_CALL", "WHILE", "CONDITIONAL"} <= set(kinds)
    assert loop_compiler_options("cpu") == ()
    defaults = (("xla_cpu_enable_fast_math", False), ("xla_dump_hlo_as_text", False))
    monkeypatch.setattr(engine_module, "loop_compiler_options", lambda: defaults)
    engine = engine_for(models_fp32["llada"], compiler_options=(("xla_dump_hlo_as_text", True),))
    assert engine.compiler_options == (("xla_cpu_enable_fast_math", False), ("xla_dump_hlo_as_text", True))


def test_finished_records_are_bounded_without_release(models_fp32, monkeypatch):
    """A caller that never releases its finished requests does not grow the engine without end: the latest
    FINISHED_KEPT stay readable, older ones are dropped (aborts: finished without any device work)."""
    monkeypatch.setattr(engine_module, "FINISHED_KEPT", 3)
    engine = engine_for(models_fp32["llada"], max_queue=8)
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual")
    ids = [engine.add_request(PLACED[0][0], gc, affix=None) for _ in range(5)]
    for rid in ids:
        assert engine.abort(rid)
    for rid in ids[:2]:
        with pytest.raises(KeyError):
            engine.request(rid)
    assert all(engine.request(rid).finish_reason == "abort" for rid in ids[2:])
    engine.release(ids[2])  # a released record leaves at once, and the bound with it
    with pytest.raises(KeyError):
        engine.request(ids[2])


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(prompt=[]), "the prompt is empty"),
        (dict(prompt=[1, 2, 500]), "outside"),
        (dict(prompt=[1] * 250), "exceeds the engine's maximum length"),
        (dict(affix=(3, 2)), "is not a non-empty span"),
        (dict(affix=(0, 99)), "is not a non-empty span"),
        (dict(affix="everything"), "expected 'auto'"),
        (dict(config=GenerationConfig.from_options(cache="prefix")), "dual cache"),
        (dict(config=GenerationConfig.from_options(cache="dual", refresh="step")), "refresh='block'"),
        (dict(request_id="taken"), "already in use"),
        (dict(seed=2**64), r"seed=18446744073709551616 must be an integer in \[-2\*\*63, 2\*\*63\)"),
        (dict(seed=1.5), "seed=1.5 must be an integer"),
    ],
)
def test_bad_requests_are_refused_at_submit(kw, msg, models_fp32):
    engine = engine_for(models_fp32["llada"])
    engine.add_request([1, 2, 3], opts(gen_length=8, block_length=4, steps=8, cache="dual"), request_id="taken")
    args = dict(
        prompt=[1, 2, 3, 4, 5],
        config=opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors"),
        affix=None,
    )
    args.update(kw)
    with pytest.raises(RequestError, match=msg):
        engine.add_request(args.pop("prompt"), args.pop("config"), **args)
    assert len(engine.scheduler.waiting) == 1  # nothing half-queued
    with pytest.raises(ValueError, match="anchor ratio"):
        opts(cache="dual", affix="anchors", anchor_ratio=1.5)


def test_requests_that_can_never_fit_and_a_full_queue(models_fp32):
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual")
    tiny = engine_for(m, kv_budget_bytes=16 * m.config.n_layers * 2 * m.config.n_kv_heads * m.config.head_dim * 4)
    with pytest.raises(RequestError, match="more than the whole pool"):
        tiny.add_request([1] * 40, gc)
    with pytest.raises(KVBudgetError, match="holds no page"):
        engine_for(m, kv_budget_bytes=100)
    with pytest.raises(KVBudgetError, match="GiB free on"):  # refused, not an out-of-memory crash
        engine_for(m, kv_budget_bytes=1 << 50)
    engine = engine_for(m, max_queue=2)
    engine.add_request([1, 2], gc)
    engine.add_request([1, 2], gc)
    with pytest.raises(QueueFull):
        engine.add_request([1, 2], gc)


def test_a_full_length_suffix_request_probed_at_ratio_one(models_fp32):
    """ACache at ratio 1 (every affix token an anchor) on a suffix affix ending at the prompt's last token, in a
    request of exactly max_model_len tokens: the probed row's window (its anchors, own tokens, P - 1, the generation
    region) still fits, and the answer equals solo `generate`."""
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors", anchor_ratio=1.0, stop_at_eos=False)
    own = RNG.integers(0, 80, 64 - 8 - len(AFFIX)).tolist()
    prompt, span = own + AFFIX, (len(own), len(own) + len(AFFIX))
    engine = engine_for(m)
    assert len(prompt) + 8 == engine.config.max_model_len == engine.runner.ladder.read_len
    rid = engine.add_request(prompt, gc, affix=span)
    while engine.has_unfinished():
        engine.step()
    assert engine.request(rid).finish_reason in ("length", "stop")
    assert engine.request(rid).generated == solo(m, prompt, gc, span)


def test_the_slot_kernels_probe_and_decode_as_xla_does(models_fp32):
    """The engine on the slot kernels (Pallas, interpreted here; what a GPU runs): ACache's probe scores each row's
    shared list through `slot_key_weights`, a block start's chunks attend once a layer over both read lists, and
    the anchors and answers are those of the XLA engine and of solo generate, at every placement; an unshared
    request's block starts run a chunk and a half chunk (its window of 46 tokens, chunks of 32: 32 + 16), one
    attention over both."""
    m = models_fp32["llada"]
    gc = opts(gen_length=8, block_length=4, steps=8, cache="dual", affix="anchors", anchor_ratio=0.2, stop_at_eos=False)
    items = [(p, gc, span, 0) for p, span in PLACED[:3]]
    plain = dataclasses.replace(gc, cache=dataclasses.replace(gc.cache, affix=None))
    long = RNG.integers(0, 80, 38).tolist()
    anchors, answers = [], []
    for attention in ("pallas", "xla"):
        engine = engine_for(m, attention=attention)
        assert engine.runner.kernels.attention == attention
        ids = [engine.add_request(p, gc, affix=span) for p, span in PLACED[:3]]
        ids.append(engine.add_request(long, plain))
        engine.step()  # probes all three and decodes their first block
        anchors.append([engine.request(i).anchors for i in ids[:3]])
        while engine.has_unfinished():
            engine.step()
        answers.append([engine.request(i).answer(()) for i in ids])
    assert anchors[0] == anchors[1] and all(anchors[0])
    want = [solo(m, p, gc, span) for p, gc, span, _ in items] + [solo(m, long, plain)]
    assert answers[0] == answers[1] == want
