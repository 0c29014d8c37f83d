"""What the shared-affix techniques cost in answers, measured online: an `Auditor` decodes a fraction of the requests
served with an affix technique a second time, exactly (no sharing, the dual cache), as a shadow request that no
client sees, and compares the two answers per affix and per technique setting.

A layer over the engine (like the server; the engine package stays as it is): the loop that drives the engine calls
`admit` before each step and `observe` with every output of an audited request (`EngineService` does both).
Shadow requests only take what users leave: one is queued in the engine only into a batch row and pages left free
once every waiting user request is admitted, at most `max_shadows` at once, and every shadow is dropped (aborted:
its pages freed, counted) as soon as the waiting users would not fit beside them. The comparison is between
answers decoded in different batches: equal by construction in fp32 (the engine's answers equal solo `generate`),
while bf16 sums may differ across batches at near ties, which an audit counts as disagreement.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Sequence

from dllm_jax.decoding.config import Anchors, NaiveReuse, Shallow
from dllm_jax.engine.block_manager import affix_key, pages_for
from dllm_jax.engine.request import BlockOutput, Request

SHADOW = "shadow-"  # the request-id prefix of shadow requests
WILSON_Z = 1.959963984540054  # the normal quantile of a 95% interval
STATE_VERSION = 2  # of the file AuditConfig.state_path names (1: anchor ratios only, still read)
TECHNIQUES = ("anchors", "shallow")  # the techniques "auto" calibrates: ACache's ratio, BiCache's depth


def affix_id(key: str) -> str:
    """The public id of the affix whose engine key (`block_manager.affix_key`: "<length>:<hash>") is `key`."""
    return "affix-" + key.replace(":", "-", 1)


def wilson(successes: int, n: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default); (0, 1) without samples."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def check_state(config: "AuditConfig") -> None:
    """ValueError unless config.state_path can be read (when it exists) and written: checked before serving."""
    path = config.state_path
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{folder} is not a writable directory")
    if os.path.exists(path):
        Auditor(None, config)  # reads it: a bad file is refused here


def setting_of(technique: Any, depth: int = 0) -> str:
    """The technique setting an audit is counted under: "naive", "anchors:<ratio>" or "shallow:<depth>"."""
    if isinstance(technique, NaiveReuse):
        return "naive"
    if isinstance(technique, Anchors):
        return f"anchors:{technique.ratio:g}"
    if isinstance(technique, Shallow):
        return f"shallow:{depth}"
    raise ValueError(f"not an affix technique: {technique!r}")


def kind_of(technique: Any) -> str | None:
    """ "anchors" or "shallow" for the techniques "auto" calibrates, else None."""
    return "anchors" if isinstance(technique, Anchors) else "shallow" if isinstance(technique, Shallow) else None


def technique_at(kind: str, level: float) -> Anchors | Shallow:
    """The technique a calibrator's level stands for: ACache at that ratio, BiCache at that depth; BiCache's exact
    level (depth 0) is served as ACache at ratio 1 (exact too, and every engine serves it)."""
    if kind == "anchors":
        return Anchors(float(level))
    return Shallow(int(level)) if level else Anchors(1.0)


def compare(served: Sequence[int], exact: Sequence[int], block_length: int) -> tuple[bool, float, int | None]:
    """(the answers are equal, the share of positions where they agree over the longer one, the first block where
    they differ or None)."""
    n = max(len(served), len(exact))
    same = sum(a == b for a, b in zip(served, exact))
    first = next((i for i in range(n) if i >= min(len(served), len(exact)) or served[i] != exact[i]), None)
    return list(served) == list(exact), same / n if n else 1.0, None if first is None else first // block_length


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """fraction: of the requests served with an affix technique, the share also decoded exactly (every
    round(1 / fraction)-th one: deterministic). max_shadows: shadow requests in the engine at once; max_pending:
    audits waiting for room (more are skipped, counted); max_groups: (affix, setting) rows kept (the least recently
    audited are dropped beyond it). state_path: where the comparisons and calibrations persist (read at start,
    written atomically at most every save_every_s seconds and at close); None: in memory, a restart forgets them."""

    fraction: float = 0.02
    max_shadows: int = 2
    max_pending: int = 64
    max_groups: int = 256
    state_path: str | None = None  # a JSON file the figures and calibrations are kept in across restarts
    save_every_s: float = 5.0  # how often a changed state is written (and when the auditor is closed)

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"audit fraction={self.fraction} must be in [0, 1]")
        if self.save_every_s < 0:
            raise ValueError(f"AuditConfig.save_every_s={self.save_every_s} must be >= 0")
        for name in ("max_shadows", "max_pending", "max_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"AuditConfig.{name}={getattr(self, name)} must be positive")


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    """anchor_ratio="auto" and shallow_depth="auto" (`Calibrator`): the ACache ratios tried (1, exact, is the
    fallback), the BiCache depths tried (None: every depth the engine serves, deepest first; 0, exact, is the
    fallback) and the agreement target (the share of answers equal to the exact ones)."""

    ladder: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.5)
    target: float = 0.95
    audit_until: int = 16  # an affix's requests at a level its own comparisons do not decide: all audited until this
    max_affixes: int = 256  # calibrations kept (the least recently used are forgotten beyond it)
    depths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.ladder or any(not 0 <= r < 1 for r in self.ladder) or list(self.ladder) != sorted(set(self.ladder)):
            raise ValueError(f"calibration ladder={self.ladder}: increasing ratios in [0, 1)")
        if self.depths is not None and (any(d < 1 for d in self.depths) or len(set(self.depths)) != len(self.depths)):
            raise ValueError(f"calibration depths={self.depths}: distinct depths >= 1")
        if not 0 < self.target <= 1:
            raise ValueError(f"agreement target={self.target} must be in (0, 1]")
        if self.max_affixes < 1 or self.audit_until < 0:
            raise ValueError("max_affixes must be positive and audit_until >= 0")

    def depth_ladder(self, served: Sequence[int]) -> tuple[int, ...]:
        """The BiCache depths tried, cheapest (deepest: most layers reused) first, among those the engine serves."""
        depths = [d for d in (served if self.depths is None else self.depths) if d > 0]
        if missing := sorted(set(depths) - set(served)):
            raise ValueError(
                f"calibration depths {missing} are not served (EngineConfig.shallow_depths {list(served)})"
            )
        return tuple(sorted(depths, reverse=True))


class Calibrator:
    """The level (ACache's ratio, or BiCache's depth) an affix is served at under "auto", from comparisons with
    exact answers. The ladder runs from the cheapest level (ratio 0; the deepest depth) towards exact.

    The rule. From counts of comparisons at a level r, r is *accepted* when the 95% Wilson lower bound of the
    exact-match rate is at least the target and *rejected* when the upper bound is below it. For affix A, its own
    counts decide when they do; otherwise the counts pooled over every affix at r do (a prior: a new affix starts
    from what the others showed). A is served at its first (cheapest) accepted level. With none accepted, A's
    request is served exactly (ratio 1; depth 0) and a shadow decodes it at the first level neither accepted nor
    rejected (a calibration sample); with every level rejected, A is served exactly. A's requests at a level its own
    counts do not decide yet are all audited until it has audit_until comparisons there (then the audit
    fraction's), so a level accepted on the prior, or one whose agreement falls, is rejected by A's own counts and
    A moves up the ladder. (All n comparisons agreeing bound the rate at n / (n + 3.84): 73 of them accept a level
    on their own at the target 0.95.)"""

    def __init__(self, config: CalibrationConfig | None = None, kind: str = "anchors", ladder: Sequence = ()):
        self.config, self.kind = config or CalibrationConfig(), kind
        self.ladder = tuple(self.config.ladder if kind == "anchors" else ladder)
        self.exact = 1.0 if kind == "anchors" else 0
        self.own: OrderedDict[str, dict[float, list[int]]] = OrderedDict()  # key -> level -> [agree, n]
        self.pooled: dict[float, list[int]] = {r: [0, 0] for r in self.ladder}

    def _judge(self, agree: int, n: int) -> bool | None:
        low, high = wilson(agree, n)
        return True if low >= self.config.target else False if high < self.config.target else None

    def own_verdict(self, key: str, r: float) -> bool | None:
        return self._judge(*self.own.get(key, {}).get(r, [0, 0]))

    def verdict(self, key: str, r: float) -> bool | None:
        """True: accepted, False: rejected, None: undecided (A's own counts if they decide, else the pooled)."""
        own = self.own_verdict(key, r)
        return own if own is not None else self._judge(*self.pooled[r])

    def decide(self, key: str) -> tuple[float, float | None]:
        """(the level to serve A's request at, the level to calibrate at with a shadow, or None)."""
        if key in self.own:
            self.own.move_to_end(key)
        verdicts = [(r, self.verdict(key, r)) for r in self.ladder]
        accepted = [r for r, v in verdicts if v]
        if accepted:
            return accepted[0], None
        open_levels = [r for r, v in verdicts if v is None]
        return self.exact, open_levels[0] if open_levels else None

    def needs_audit(self, key: str, r: float) -> bool:
        """Whether a request served at r is audited beyond the fraction: A's own counts do not decide r yet and
        are fewer than audit_until."""
        own = self.own.get(key, {}).get(r, [0, 0])
        return r != self.exact and own[1] < self.config.audit_until and self._judge(*own) is None

    def record(self, key: str, r: float, agrees: bool) -> None:
        counts = self.own.setdefault(key, {}).setdefault(r, [0, 0])
        counts[0], counts[1] = counts[0] + agrees, counts[1] + 1
        self.pooled[r][0] += agrees
        self.pooled[r][1] += 1
        self.own.move_to_end(key)
        while len(self.own) > self.config.max_affixes:
            self.own.popitem(last=False)

    def report(self) -> list[dict]:
        rows, field = [], "ratio" if self.kind == "anchors" else "depth"
        for key, per_level in list(self.own.items()):
            served, calibrating = self.decide(key)
            counts = {f"{r:g}": {"agree": a, "n": n} for r, (a, n) in sorted(per_level.items())}
            rows.append(
                {"affix": affix_id(key), "technique": self.kind, field: served}
                | dict(calibrating_at=calibrating, samples=counts)
            )
        return rows

    def state(self) -> dict:
        return dict(
            own={key: {f"{r!r}": c for r, c in per.items()} for key, per in self.own.items()},
            pooled={f"{r!r}": c for r, c in self.pooled.items()},
        )

    def restore(self, state: dict) -> None:
        """Counts from `state` at the levels of this ladder (a level no longer tried is dropped)."""
        level = float if self.kind == "anchors" else lambda r: int(float(r))
        for key, per in state["own"].items():
            kept = {level(r): list(c) for r, c in per.items() if level(r) in self.pooled}
            if kept:
                self.own[key] = kept
        for r, c in state["pooled"].items():
            if level(r) in self.pooled:
                self.pooled[level(r)] = list(c)


@dataclasses.dataclass
class _Pair:
    """One audited request: the twin (the user's request) and its shadow, their answers as they arrive. Usually the
    shadow is exact; a calibration sample's shadow is the approximate one (the user is served exactly)."""

    twin: str
    prompt: list[int]
    config: Any  # the shadow's GenerationConfig
    seed: int
    group: tuple[str, str]  # (affix id, setting)
    block_length: int
    served: list[int] | None = None  # the approximate answer's tokens once finished
    exact: list[int] | None = None
    shadow: str | None = None  # the shadow's request id once queued in the engine
    shadow_tokens: list[int] = dataclasses.field(default_factory=list)
    shadow_exact: bool = True
    shadow_affix: Any = None  # the shadow's affix argument (None: exact; a span for a calibration sample)
    calibration: tuple[str, str, float] | None = None  # (technique, affix key, level): what it tells a calibrator


@dataclasses.dataclass
class _Group:
    n: int = 0
    exact: int = 0
    agreement: float = 0.0  # summed
    first_divergence: dict[int, int] = dataclasses.field(default_factory=dict)  # block -> count


class Auditor:
    """Audits an engine's affix-technique requests (see the module doc)."""

    def __init__(self, engine, config: AuditConfig | None = None, calibration: CalibrationConfig | None = None):
        self.engine, self.config = engine, config or AuditConfig()
        served = () if engine is None else engine.config.shallow_depths
        depths = (calibration or CalibrationConfig()).depth_ladder(served)
        self.calibrators = {"anchors": Calibrator(calibration), "shallow": Calibrator(calibration, "shallow", depths)}
        self._seen = 0  # requests served with an affix technique (the fraction picks among them)
        self._pairs: dict[str, _Pair] = {}  # by twin id and by shadow id
        self._pending: list[_Pair] = []  # twins waiting for their shadow to be queued
        self.groups: OrderedDict[tuple[str, str], _Group] = OrderedDict()
        self._lock = threading.Lock()  # `report` may run on another thread than the engine's
        names = "audited shadows shadows_finished shadow_abort shadow_error dropped skipped incomplete shadow_tokens"
        self.counts = dict.fromkeys(names.split(), 0)
        self._saved_at, self._dirty = 0.0, False
        self._waited: set[str] = set()  # the user requests waiting at the last `admit`
        if self.config.state_path is not None and os.path.exists(self.config.state_path):
            self._load(self.config.state_path)

    # ---- the loop's hooks -----------------------------------------------------------------------------------------
    def consider(self, request: Request, seed: int, calibrate: Any = None, auto: bool = False) -> bool:
        """A user request was just queued: pick it for an audit (its exact twin is queued when there is room).
        calibrate: the request is served exactly for "auto" (anchor_ratio or shallow_depth): its shadow decodes it
        with this technique (`technique_at`: a calibration sample, always taken). auto: it is served at the level
        its calibrator chose (audited beyond the fraction while its affix has few samples there). Returns whether
        it was picked."""
        f = self.config.fraction
        if request.technique is None and calibrate is None:
            return False
        s, e = request.affix_span
        key = affix_key(request.prompt[s:e])
        kind = kind_of(request.technique) if auto else None
        level = None if kind is None else request.technique.ratio if kind == "anchors" else request.depth
        level = level if kind is not None and level in self.calibrators[kind].ladder else None  # exact: nothing to do
        forced = calibrate is not None or (level is not None and self.calibrators[kind].needs_audit(key, level))
        if not forced:
            if f == 0:
                return False
            self._seen += 1
            if math.floor(self._seen * f) == math.floor((self._seen - 1) * f):
                return False
        if len(self._pending) >= self.config.max_pending:
            self.counts["skipped"] += 1
            return False
        cache = dataclasses.replace(request.config.cache, affix=calibrate)
        if calibrate is not None:
            level = calibrate.ratio if isinstance(calibrate, Anchors) else calibrate.depth
            calibration, setting = (kind_of(calibrate), key, level), setting_of(calibrate, level)
        else:
            calibration = None if level is None else (kind, key, level)
            setting = setting_of(request.technique, request.depth)
        pair = _Pair(
            request.request_id,
            list(request.prompt),
            dataclasses.replace(request.config, cache=cache),
            seed,
            (affix_id(key), setting),
            request.block_length,
            shadow_exact=calibrate is None,
            shadow_affix=None if calibrate is None else (s, e),
            calibration=calibration,
        )
        self._pairs[pair.twin] = pair
        self._pending.append(pair)
        return True

    def admit(self) -> None:
        """Before each engine step (the users who arrived are in the engine's queue): drop every shadow if the
        waiting users would not all fit beside them (batch rows, or pages counting the evictable cached ones) or if
        one of them already waited a step; else queue pending shadows into the rows and free pages left once every
        waiting user is admitted."""
        engine = self.engine
        bm, scheduler = engine.block_manager, engine.scheduler
        users = [r for r in scheduler.waiting if not r.request_id.startswith(SHADOW)]
        stuck = any(r.request_id in self._waited for r in users)
        self._waited = {r.request_id for r in users}
        user_pages = sum(pages_for(r.private_tokens(), bm.page_size) for r in users)
        rows_left = engine.config.max_batch - len(scheduler.running) - len(scheduler.waiting)
        active = {p.shadow: p for p in self._pairs.values() if p.shadow is not None and p.exact is None}
        if active and (rows_left < 0 or user_pages > bm.num_free_pages + bm.num_cached_pages or stuck):
            for shadow in list(active):
                engine.abort(shadow)  # its final output (abort) reaches `observe`
            return
        pages_left = bm.num_free_pages - user_pages
        while self._pending and len(active) < self.config.max_shadows and rows_left > 0:
            pair = self._pending[0]
            need = pages_for(len(pair.prompt) + pair.config.schedule.gen_length, bm.page_size)
            if need > pages_left:
                return
            self._pending.pop(0)
            pair.shadow = f"{SHADOW}{pair.twin}"
            try:
                engine.add_request(
                    pair.prompt,
                    pair.config,
                    affix=pair.shadow_affix,
                    seed=pair.seed,
                    request_id=pair.shadow,
                    on_block=self.observe,
                )
            except Exception:  # noqa: BLE001  (e.g. the id in use): this audit is given up, users are unaffected
                self._forget(pair, "skipped")
                continue
            self._pairs[pair.shadow] = pair
            self.counts["shadows"] += 1
            active[pair.shadow] = pair
            rows_left, pages_left = rows_left - 1, pages_left - need

    def observe(self, out: BlockOutput) -> None:
        """An output of an audited twin or of a shadow (others are ignored)."""
        pair = self._pairs.get(out.request_id)
        if pair is None:
            return
        if out.request_id == pair.shadow:
            pair.shadow_tokens += out.tokens
            self.counts["shadow_tokens"] += len(out.tokens)
            if out.finished:
                self.engine.release(pair.shadow)
                if out.finish_reason in ("stop", "length"):
                    self.counts["shadows_finished"] += 1
                    if pair.shadow_exact:
                        pair.exact = pair.shadow_tokens
                    else:
                        pair.served = pair.shadow_tokens
                else:  # dropped for a waiting user request (or failed): this audit is given up
                    self.counts["shadow_error" if out.finish_reason == "error" else "shadow_abort"] += 1
                    self._forget(pair, "dropped")
                    return
        elif out.finished:
            if out.finish_reason not in ("stop", "length"):  # cut short (a stop string, the client left, a fault)
                self._forget(pair, "incomplete")
                return
            record = self.engine.request(out.request_id)
            answer = record.answer(tuple(record.config.stop_token_ids(self.engine.model.config)))
            if pair.shadow_exact:
                pair.served = answer
            else:
                pair.exact = answer
        if pair.served is not None and pair.exact is not None:
            self._count(pair)

    # ---- results --------------------------------------------------------------------------------------------------
    def _count(self, pair: _Pair) -> None:
        equal, agreement, first = compare(pair.served, pair.exact, pair.block_length)
        with self._lock:
            if pair.calibration is not None:
                kind, key, level = pair.calibration
                self.calibrators[kind].record(key, level, equal)
            g = self.groups.pop(pair.group, None) or _Group()
            g.n, g.exact, g.agreement = g.n + 1, g.exact + equal, g.agreement + agreement
            if first is not None:
                g.first_divergence[first] = g.first_divergence.get(first, 0) + 1
            self.groups[pair.group] = g  # the most recently audited last
            while len(self.groups) > self.config.max_groups:
                self.groups.popitem(last=False)
        self.counts["audited"] += 1
        self._forget(pair, None)
        self._dirty = True
        if time.monotonic() - self._saved_at >= self.config.save_every_s:
            self.save()

    # ---- persistence ----------------------------------------------------------------------------------------------
    def save(self) -> None:
        """Write the comparisons and calibrations to state_path (atomically: a reader never sees half a file)."""
        path = self.config.state_path
        if path is None or not self._dirty:
            return
        with self._lock:
            state = dict(
                version=STATE_VERSION,
                groups=[[a, st, dataclasses.asdict(g)] for (a, st), g in self.groups.items()],
                calibration={kind: cal.state() for kind, cal in self.calibrators.items()},
            )
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
        self._saved_at, self._dirty = time.monotonic(), False

    def close(self) -> None:
        """Write the state (the server calls this when it stops)."""
        self._dirty = True
        self.save()

    def _load(self, path: str) -> None:
        try:
            with open(path) as f:
                state = json.load(f)
            if state.get("version") not in (1, STATE_VERSION):
                raise ValueError(f"version {state.get('version')!r}, expected {STATE_VERSION}")
            for affix, setting, g in state["groups"]:
                g["first_divergence"] = {int(k): v for k, v in g["first_divergence"].items()}
                self.groups[(affix, setting)] = _Group(**g)
            calibration = state["calibration"] if state["version"] > 1 else {"anchors": state}
            for kind, cal in self.calibrators.items():
                if kind in calibration:
                    cal.restore(calibration[kind])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"the audit state {path} cannot be read ({type(e).__name__}: {e}); move it away") from None

    def _forget(self, pair: _Pair, outcome: str | None) -> None:
        if outcome is not None:
            self.counts[outcome] += 1
        if pair in self._pending:
            self._pending.remove(pair)
        self._pairs.pop(pair.twin, None)
        if pair.shadow is not None:
            self._pairs.pop(pair.shadow, None)
            if pair.exact is None and outcome is not None:  # still decoding, or just aborted: no longer needed
                if self.engine.abort(pair.shadow):
                    self.counts["shadow_abort"] += 1
                self.engine.release(pair.shadow)

    def report(self) -> dict:
        """Per affix and setting: audited requests, exact matches with their 95% Wilson interval, the mean share of
        agreeing tokens and the first diverging block's counts; and the audit's own counts."""
        rows = []
        with self._lock:
            groups = [
                (key, dataclasses.replace(g, first_divergence=dict(g.first_divergence)))
                for key, g in self.groups.items()
            ]
        for (affix, setting), g in groups:
            low, high = wilson(g.exact, g.n)
            rows.append(
                dict(
                    affix=affix,
                    setting=setting,
                    requests=g.n,
                    exact_matches=g.exact,
                    exact_match_rate=g.exact / g.n,
                    exact_match_interval=[round(low, 4), round(high, 4)],
                    mean_token_agreement=round(g.agreement / g.n, 4),
                    first_divergence={str(k): v for k, v in sorted(g.first_divergence.items())},
                )
            )
        with self._lock:
            calibration = [row for cal in self.calibrators.values() for row in cal.report()]
        return dict(
            fraction=self.config.fraction,
            batch_invariant=self.engine.config.batch_invariant,
            **self.counts,
            pending=len(self._pending),
            groups=rows,
            target=self.calibrators["anchors"].config.target,
            calibration=calibration,
        )

    def resolve_auto(self, request: Request, kind: str = "anchors") -> tuple[Any, Any]:
        """ "auto" for a planned request (its affix span resolved) and technique ("anchors": the ratio; "shallow":
        the depth): (the technique to serve it with, the technique its calibration shadow decodes with, or None)."""
        s, e = request.affix_span
        with self._lock:
            served, calibrate = self.calibrators[kind].decide(affix_key(request.prompt[s:e]))
        return technique_at(kind, served), None if calibrate is None else technique_at(kind, calibrate)
