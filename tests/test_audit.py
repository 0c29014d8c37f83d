"""The audit (`dllm_jax.audit`): shadow requests decode audited requests exactly, in the rows and pages users leave,
and the comparison counts what each technique costs in answers, per affix and setting."""

import json

import fixtures
import numpy as np
import pytest

import dllm_jax
from dllm_jax import GenerationConfig, answer_tokens, generate
from dllm_jax.audit import SHADOW, AuditConfig, Auditor, affix_id, compare, wilson
from dllm_jax.decoding.caches import acache
from dllm_jax.engine import Engine, EngineConfig
from dllm_jax.engine.block_manager import affix_key

DOC, KEYS = fixtures.LOOKUP_DOC, fixtures.LOOKUP_KEYS


@pytest.fixture(scope="module")
def model():
    return dllm_jax.load(dtype="float32")  # fp32: the engine's answers equal solo generate's bit for bit


def opts(**kw):
    return GenerationConfig.from_options(gen_length=8, block_length=4, steps=8, cache="dual", **kw)


def drive(engine: Engine, auditor: Auditor, items, arrivals=None) -> list[str]:
    """What EngineService does around the engine: every user request considered for an audit and its outputs
    observed, `admit` before each step. items: (prompt, config, span); arrivals: {step: items added then}."""
    ids = []

    def add(prompt, config, span):
        rid = engine.add_request(prompt, config, affix=span, on_block=auditor.observe)
        auditor.consider(engine.request(rid), 0)
        ids.append(rid)

    for item in items:
        add(*item)
    arrivals, step = arrivals or {}, 0
    while True:
        for item in arrivals.get(step, []):
            add(*item)
        auditor.admit()
        if not engine.has_unfinished() and step >= max(arrivals, default=0):
            return ids
        engine.step()
        step += 1


def test_wilson_interval_and_answer_comparison():
    low, high = wilson(75, 75)
    assert 0.951 < low < 0.952 and high == 1.0  # 75 samples that all agree bound the rate at 0.95
    low, high = wilson(10, 20)
    assert low == pytest.approx(0.2993, abs=1e-4) and high == pytest.approx(0.7007, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)
    assert compare([1, 2, 3], [1, 2, 3], 2) == (True, 1.0, None)
    assert compare([1, 2, 3, 4], [1, 2, 5, 4], 2) == (False, 0.75, 1)
    assert compare([1, 2], [1, 2, 7, 7], 2) == (False, 0.5, 1)  # one answer ended earlier: the rest disagrees
    assert compare([], [], 4) == (True, 1.0, None)
    with pytest.raises(ValueError, match="fraction"):
        AuditConfig(fraction=1.5)


def test_the_audit_counts_what_each_technique_costs(model):
    """Every request audited (fraction 1): at ratio 1 (exact) every audit agrees; with naive reuse of the lookup
    document the agreement is what an offline comparison of the same requests with solo `generate` finds."""
    tok = model.tokenizer
    doc = tok.encode(DOC)
    prompts = [tok.encode(f"{DOC} question : what is the code of {k} ? reply with the digits .") for k in KEYS]
    span = (0, len(doc))
    naive, exact_ratio = opts(affix="naive"), opts(affix="anchors", anchor_ratio=1.0)
    engine = Engine(model, EngineConfig(max_batch=4, kv_budget_bytes=16 << 20, max_model_len=128, block_lengths=(4,)))
    auditor = Auditor(engine, AuditConfig(fraction=1.0, max_shadows=4))
    ids = drive(engine, auditor, [(p, c, span) for c in (naive, exact_ratio) for p in prompts])
    report = auditor.report()
    assert report["audited"] == report["shadows"] == len(ids) == 12 and report["dropped"] == 0
    groups = {g["setting"]: g for g in report["groups"]}
    assert set(groups) == {"naive", "anchors:1"} and {g["affix"] for g in groups.values()} == {affix_id(affix_key(doc))}
    assert groups["anchors:1"]["exact_matches"] == 6 and groups["anchors:1"]["mean_token_agreement"] == 1.0
    # offline: each request decoded alone, with the document's stored K/V (naive) and exactly
    shared = acache.build_shared_affix(model.params, model.config, doc)
    agree = []
    for p in prompts:
        served = generate(model, [p], naive, shared_affix=shared, affix_spans=[span])
        exact = generate(model, [p], opts())
        agree.append(answer_tokens(served.tokens, model.config)[0] == answer_tokens(exact.tokens, model.config)[0])
    assert groups["naive"]["exact_matches"] == sum(agree) < 6  # naive reuse fails some lookups on this model
    assert groups["naive"]["exact_match_rate"] == pytest.approx(np.mean(agree))
    low, high = groups["naive"]["exact_match_interval"]
    assert low <= np.mean(agree) <= high
    assert engine.block_manager.num_used_pages == 0 and not engine.has_unfinished()


def test_shadows_take_only_what_users_leave(model):
    """One batch row: the shadow runs only once the user request finished, and is dropped (aborted, pages freed,
    counted) the step a new user request would wait behind it; that request's answer is its solo answer."""
    tok = model.tokenizer
    doc = tok.encode(DOC)
    first, later = (tok.encode(f"{DOC} question : what is the code of {k} ? reply with the digits .") for k in KEYS[:2])
    config = opts(affix="naive")
    engine = Engine(model, EngineConfig(max_batch=1, kv_budget_bytes=16 << 20, max_model_len=128, block_lengths=(4,)))
    auditor = Auditor(engine, AuditConfig(fraction=1.0))
    span = (0, len(doc))
    # the first request takes 2 steps (2 blocks); its shadow is queued before step 2 and runs there; the later
    # request arrives before step 3: the shadow (one block left) is dropped for it
    ids = drive(engine, auditor, [(first, config, span)], arrivals={3: [(later, opts(), None)]})
    report = auditor.report()
    assert report["shadows"] == 1 and report["dropped"] == 1 and report["shadow_abort"] == 1
    assert report["audited"] == 0 and report["groups"] == []
    assert engine.stats()["requests"] == 3  # two users and one shadow, which the server's metrics subtract
    assert (
        engine.request(ids[1]).answer(tuple(config.stop_token_ids(model.config)))
        == answer_tokens(generate(model, [later], opts()).tokens, model.config)[0]
    )
    assert engine.block_manager.num_used_pages == 0
    with pytest.raises(KeyError):
        engine.request(f"{SHADOW}{ids[0]}")  # its record released


RULES = "rule examples : 7 4 0 -> 2 5 9 ; 3 6 8 -> 6 3 1 ; 6 5 2 -> 3 4 7 ; 4 3 4 -> 5 6 5 ; 0 4 1 -> 9 5 8 ;"


@pytest.mark.parametrize("kind", ["anchors", "shallow"])
def test_auto_calibrates_per_affix(model, kind):
    """anchor_ratio / shallow_depth "auto" through the server's engine thread: while an affix calibrates its
    requests are served exactly and shadows decode them at the ladder's levels; the affix where reuse is harmless
    (the digit rule) ends at the cheapest level (ratio <= 0.2; the deepest depth), the one where it fails (lookups:
    naive reuse of the document breaks them) at a dearer one or exact; afterwards, held-out requests served at the
    chosen levels agree with the exact answers at the target."""
    import asyncio

    from dllm_jax.audit import CalibrationConfig
    from dllm_jax.server import EngineService

    tok, rng = model.tokenizer, np.random.default_rng(0)
    cal = CalibrationConfig(ladder=(0.0, 0.2, 0.5), target=0.75)  # 12 of 12 agreeing accept a level: 12 / 15.84
    depths = (3, 6) if kind == "shallow" else ()  # 6: every layer reused (naive reuse)
    engine = Engine(
        model, EngineConfig(max_batch=4, kv_budget_bytes=16 << 20, max_model_len=128, shallow_depths=depths)
    )
    service = EngineService(engine, warmup=False, audit=AuditConfig(fraction=0.0, max_shadows=4), calibration=cal)
    service.start()
    config = GenerationConfig.from_options(gen_length=8, block_length=8, steps=8, cache="dual", affix="anchors")

    def rule(digits):
        p = model.encode_chat(f"{RULES} input : {' '.join(map(str, digits))} what does the rule give ?")
        r = tok.encode(RULES)
        at = next(i for i in range(len(p)) if p[i : i + len(r)] == r)
        return p, (at, at + len(r))

    def lookup(key):
        p, d = (
            model.encode_chat(f"{DOC} question : what is the code of {key} ? reply with the digits ."),
            tok.encode(DOC),
        )
        at = next(i for i in range(len(p)) if p[i : i + len(d)] == d)
        return p, (at, at + len(d))

    async def answer(prompt, span, auto=kind, technique=config):
        _, stream = await service.submit(prompt, technique, span, 0, auto=auto)
        tokens = []
        while not (out := await stream.get()).finished:
            tokens += out.tokens
        return tokens + out.tokens

    async def wave(items, **kw):
        got = await asyncio.gather(*[answer(p, s, **kw) for p, s in items])
        for _ in range(600):  # the shadows run once the users left room
            if service.auditor.report()["pending"] == 0 and not engine.has_unfinished():
                break
            await asyncio.sleep(0.05)
        return got

    async def main():
        for _ in range(5):
            await wave([rule(rng.integers(0, 10, 3)) for _ in range(3)] + [lookup(KEYS[int(rng.integers(6))])])
        report = service.auditor.report()["calibration"]
        assert {row["technique"] for row in report} == {kind}
        level = "ratio" if kind == "anchors" else "depth"
        chosen = {row["affix"]: row[level] for row in report}
        rules_id, doc_id = (affix_id(affix_key(tok.encode(t))) for t in (RULES, DOC))
        if kind == "anchors":  # cheaper: a lower ratio
            assert chosen[rules_id] <= 0.2 and chosen[doc_id] > chosen[rules_id], chosen
        else:  # cheaper: a deeper depth (0: exact)
            assert chosen[rules_id] == 6 and chosen[doc_id] < chosen[rules_id], chosen
        held_out = [rule(rng.integers(0, 10, 3)) for _ in range(6)] + [lookup(k) for k in KEYS[:3]]
        served = await wave(held_out)
        ratio_one = GenerationConfig.from_options(
            gen_length=8, block_length=8, steps=8, cache="dual", affix="anchors", anchor_ratio=1.0
        )
        exact = await wave(held_out, auto=None, technique=ratio_one)
        return np.mean([a == b for a, b in zip(served, exact)])

    try:
        agreement = asyncio.run(main())
    finally:
        service.stop()
    assert agreement >= 0.75


def test_the_audit_state_survives_a_restart_when_asked(model, tmp_path):
    """With a state file the comparisons and calibrations are written atomically and read back by the next
    auditor (a restart); without one a new auditor starts empty; a broken file is refused before serving."""
    from dllm_jax.audit import CalibrationConfig, check_state

    tok = model.tokenizer
    doc = tok.encode(DOC)
    prompts = [tok.encode(f"{DOC} question : what is the code of {k} ? reply with the digits .") for k in KEYS[:2]]
    state = tmp_path / "audit.json"
    config = AuditConfig(fraction=1.0, state_path=str(state), save_every_s=0.0)
    mc = EngineConfig(max_batch=2, kv_budget_bytes=16 << 20, max_model_len=128, block_lengths=(4,), shallow_depths=(3,))
    engine = Engine(model, mc)
    auditor = Auditor(engine, config, CalibrationConfig(ladder=(0.0, 0.5)))
    drive(engine, auditor, [(p, opts(affix="naive"), (0, len(doc))) for p in prompts])
    auditor.calibrators["anchors"].record(affix_key(doc), 0.5, True)
    auditor.calibrators["shallow"].record(affix_key(doc), 3, False)
    auditor.close()
    before = auditor.report()
    assert before["groups"][0]["requests"] == 2 and not list(tmp_path.glob("*.tmp*"))
    again = Auditor(engine, config, CalibrationConfig(ladder=(0.0, 0.5)))
    assert again.report()["groups"] == before["groups"]
    assert again.report()["calibration"] == before["calibration"] and len(before["calibration"]) == 2
    assert again.calibrators["anchors"].pooled[0.5] == [1, 1] and again.calibrators["shallow"].pooled[3] == [0, 1]
    assert Auditor(engine, AuditConfig(fraction=1.0)).report()["groups"] == []  # no file: a restart forgets
    saved = json.loads(state.read_text())  # a file of version 1 (ratios only, at the top) is still read
    state.write_text(json.dumps(dict(version=1, groups=[], **saved["calibration"]["anchors"])))
    assert Auditor(engine, config, CalibrationConfig(ladder=(0.0, 0.5))).calibrators["anchors"].pooled[0.5] == [1, 1]
    state.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read"):
        check_state(config)
    with pytest.raises(ValueError, match="not a writable directory"):
        check_state(AuditConfig(state_path=str(tmp_path / "missing" / "audit.json")))
