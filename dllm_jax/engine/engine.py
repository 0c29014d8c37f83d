"""`Engine`: many requests over one paged KV pool, continuous batching at block boundaries, shared affixes stored once.

    engine = Engine(model, EngineConfig(max_batch=16))
    doc = engine.register_affix(document_ids)                  # or found automatically in repeated prompts
    rid = engine.add_request(question_ids, config, affix=doc)   # errors here, before any device work
    while engine.has_unfinished():
        for out in engine.step():                              # one block of every running request
            ...                                                # out.tokens: the block's new answer tokens

Each step admits waiting requests (FIFO) while pages and batch slots last, builds newly needed affixes (once each),
then runs one block of every running request: one device call per block length and BiCache depth (every other
setting is per-row data); a new ACache request is probed right before the call that decodes its first block. A
request's tokens are `dllm_jax.generate`'s on it alone. The settings fix the programs: `warmup()` compiles them all.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from dllm_jax.compilation import compile_overlapped, compile_totals, loop_compiler_options
from dllm_jax.decoding.caches.bicache import ShallowReuse
from dllm_jax.decoding.caches.dual import DualCache
from dllm_jax.decoding.config import CacheConfig, GenerationConfig, Schedule, Shallow
from dllm_jax.decoding.generate import fp8_compiler_options
from dllm_jax.decoding.loop import BlockRunner
from dllm_jax.decoding.samplers import FamilySampler
from dllm_jax.decoding.samplers.rows import RowSampler
from dllm_jax.engine.affix_index import AffixIndex
from dllm_jax.engine.block_manager import BlockManager, pages_for
from dllm_jax.engine.intake import AffixHandle, Intake, RequestError
from dllm_jax.engine.kv_pool import kv_bytes_per_token
from dllm_jax.engine.request import BlockOutput, Request, Status
from dllm_jax.engine.runner import STRATEGY, Ladder, ModelRunner
from dllm_jax.engine.scheduler import Scheduler
from dllm_jax.io.loading import generation_defaults
from dllm_jax.transformer import KernelChoice, Kernels
from dllm_jax.transformer.params import unstack_layers
from dllm_jax.transformer.sharding import mesh_of

log = logging.getLogger("dllm_jax.engine")
# the engine's counters (stats(); the server's /metrics): requests by outcome, device faults, work done, peaks
COUNTERS = (
    "requests finished aborted failed timed_out faults pool_rebuilds generated_tokens blocks block_rows probes "
    "affix_builds affix_hits peak_pages warmup_seconds compiles_after_warmup compile_seconds_after_warmup"
).split()
FINISHED_KEPT = 4096  # finished requests whose records stay readable until `release` (older ones are dropped)
CPU_DEFAULT_BUDGET = 1 << 30  # the default pool on the CPU (which shares the host memory) or where free is unknown
BeforeCall = Callable[[list[str]], None]  # called with the request ids of a device call before it runs


class KVBudgetError(ValueError):
    """A KV budget that holds no page, or more than the device has free: refused before allocating anything."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, checked here. Block lengths, batch sizes, the sampler and BiCache depths each multiply
    the programs compiled at warm-up; a request outside them gets RequestError naming the list."""

    max_batch: int = 16  # requests decoded together in one device call (and the most running at once)
    kv_budget_bytes: int | None = None  # the pool's size, at most the free memory (None: see kv_fraction)
    kv_fraction: float = 0.5  # the pool's share of the free memory when kv_budget_bytes is None (at most 1 GiB on CPU)
    page_size: int = 16  # tokens per page
    max_model_len: int | None = None  # the longest prompt + generation (None: the model's maximum, at most 4096)
    max_queue: int = 4096  # waiting requests beyond which add_request raises QueueFull
    auto_affix: bool = True  # find shared spans in prompts without registration (where a config names a technique)
    min_affix_tokens: int = 64  # the shortest span worth sharing
    attention: str = "auto"  # the kernel choice (auto: the slot kernel on a GPU, XLA's gather elsewhere)
    batch_sizes: tuple[int, ...] | None = None  # the batch shapes calls are padded to (None: 1, 4, 16, ..., max_batch)
    window_chunk: int = 256  # block starts run in chunks of this many tokens a row (see `Ladder.chunk`)
    block_lengths: tuple[int, ...] | None = None  # None: the model's generation_config.json block_length, else 32
    sampler: FamilySampler | None = None  # the sampler's static part (None: the family's default; the rest is data)
    shallow_depths: tuple[int, ...] = ()  # the BiCache depths served (none by default: BiCache requests are refused)
    compiler_options: tuple[tuple[str, str | bool | int | float], ...] = ()  # XLA's (name, value), over the engine's
    batch_invariant: bool = False  # answers bit-identical whatever shares a batch (`KernelChoice.batch_invariant`)

    def __post_init__(self) -> None:
        counts = ("max_batch", "page_size", "max_queue", "min_affix_tokens", "window_chunk", "kv_budget_bytes")
        for name in (*counts, "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be positive")
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"EngineConfig.kv_fraction={self.kv_fraction} must be in (0, 1]")
        KernelChoice(attention=self.attention)
        for name, low in (("block_lengths", 1), ("shallow_depths", 0)):
            values = getattr(self, name)
            if values is not None:
                values = tuple(sorted({int(v) for v in values}))
                if (not values and low) or (values and values[0] < low):
                    raise ValueError(f"EngineConfig.{name}={values} must be {'positive' if low else '>= 0'}")
                object.__setattr__(self, name, values)
        object.__setattr__(self, "compiler_options", tuple(dict(self.compiler_options).items()))  # typed, hashable
        if (s := self.batch_sizes) is not None and (not s or max(s) != self.max_batch or min(s) < 1):
            raise ValueError(f"EngineConfig.batch_sizes={s}: positive sizes ending at max_batch={self.max_batch}")


class Engine:
    """The serving loop (see the module doc). before_call: fault injection in tests (what it raises is that call's
    fault). A failed call fails only its requests, unless it consumed the pool's buffers (donated to every call): then
    the pool is rebuilt zeroed, stored affixes are dropped and every running request fails too (their K/V are gone).
    Waiting requests are untouched."""

    def __init__(self, model, config: EngineConfig | None = None, before_call: BeforeCall | None = None):
        self.model, self.config, self.before_call = model, config or EngineConfig(), before_call
        cfg, mc = self.config, model.config
        self.consecutive_faults, self.last_fault = 0, None  # failed device calls since the last one that ran, its error
        self.max_len = min(cfg.max_model_len or min(mc.max_seq_len, 4096), mc.max_seq_len)
        num_pages = self._pages_within_budget()
        self.block_manager = bm = BlockManager(num_pages, cfg.page_size)
        self.scheduler = Scheduler(bm, cfg.max_batch, cfg.max_queue)
        # what is served, resolved once: each is part of the programs' keys (everything else is data)
        self.affixes = affixes = AffixIndex(min_tokens=cfg.min_affix_tokens, k=min(16, cfg.min_affix_tokens))
        gd = generation_defaults(getattr(model, "path", None))  # the model's generation_config.json
        blocks = cfg.block_lengths or (gd.get("block_length", 32),)
        self.intake = Intake(mc, self.max_len, blocks, cfg.sampler, cfg.shallow_depths, affixes, cfg.auto_affix, gd)
        self.block_lengths, self.sampler = self.intake.block_lengths, self.intake.sampler
        # the pool is per layer, so the layer loop is unrolled: stacked params (the CPU default) are unstacked once
        # fused q/k/v would not split by head; batch-invariant: generate's layout (another GEMM width, other rounding)
        params = unstack_layers(model.params, fuse=mesh_of(model.params) is None and not cfg.batch_invariant)
        choice = KernelChoice(attention=cfg.attention, rope_write="xla", batch_invariant=cfg.batch_invariant)
        kernels = Kernels.resolve(choice, mc, params)
        ladder = Ladder.for_settings(cfg.max_batch, self.max_len, cfg.batch_sizes, cfg.window_chunk)
        slots, rows = num_pages * cfg.page_size, RowSampler(self.sampler)
        # XLA options: loops in command buffers; FP8: generate's where every block call would get them (its smallest
        # batch's); the user's win by name
        fp8 = fp8_compiler_options(mc, ladder.batch_sizes[0] * min(self.block_lengths))
        self.compiler_options = tuple((dict(loop_compiler_options()) | dict(fp8) | dict(cfg.compiler_options)).items())
        self.runner = ModelRunner(params, mc, slots, self.max_len, ladder, kernels, self.compiler_options)
        gcs = {bl: GenerationConfig(Schedule(bl, bl, bl), rows, CacheConfig("dual")) for bl in self.block_lengths}
        depths = {d: STRATEGY if d is None else ShallowReuse(DualCache(), d) for d in (None, *cfg.shallow_depths)}
        self._runners = {(bl, d): BlockRunner(mc, gc, st, rows) for bl, gc in gcs.items() for d, st in depths.items()}
        self._programs = self.runner.programs(list(self._runners.values()))  # fixed with the settings
        self._ids, self._requests, self.warmed, self._compiles_at_start = itertools.count(), {}, False, compile_totals()
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()  # unreleased, oldest first
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)  # what stats() reports, with the gauges

    def _pages_within_budget(self) -> int:
        """The pool's pages: kv_budget_bytes, or kv_fraction of the free memory (the allocator's report; on the CPU the
        host's available memory, and at most 1 GiB). A budget over the free memory is refused here, not by a crash."""
        device, budget = jax.devices()[0], self.config.kv_budget_bytes
        stats, free = device.memory_stats() or {}, 0
        if stats.get("bytes_limit"):
            free = max(stats["bytes_limit"] - stats.get("bytes_in_use", 0), 0)
        elif os.path.exists("/proc/meminfo"):
            with open("/proc/meminfo") as f:
                free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), 0)
        if budget is None:
            budget = int(free * self.config.kv_fraction) if free else CPU_DEFAULT_BUDGET
            budget = min(budget, CPU_DEFAULT_BUDGET) if device.platform == "cpu" else budget
        elif free and budget > free:
            raise KVBudgetError(
                f"a KV budget of {budget / 2**30:.2f} GiB is more than the {free / 2**30:.2f} GiB free on "
                f"{device.device_kind}: lower kv_budget_bytes (dllm-jax serve --kv-budget-gib)"
            )
        if budget < (page_bytes := kv_bytes_per_token(self.model.config) * self.config.page_size):
            raise KVBudgetError(f"a KV budget of {budget} bytes holds no page ({page_bytes} bytes a page)")
        return int(budget // page_bytes)

    def register_affix(self, tokens: Sequence[int]) -> AffixHandle:
        """Declare a span many requests will contain (a system prompt, few-shot examples, a document): requests
        naming the handle, or containing its tokens anywhere, share its one stored copy."""
        return self.intake.handle(tokens)

    def add_request(
        self,
        prompt: Sequence[int],
        config: GenerationConfig | None = None,
        *,
        affix: AffixHandle | tuple[int, int] | str | None = "auto",
        seed: int = 0,
        request_id: str | None = None,
        on_block: Callable[[BlockOutput], Any] | None = None,
        timeout: float | None = None,
        arrival: float | None = None,
    ) -> str:
        """Queue a request; returns its id. config: its decoding settings (cache "dual"; its affix technique says how
        a shared affix is reused; None: the model's generation_config.json schedule, `Intake.default`). affix:
        "auto" (registered affixes, then a span repeated from earlier prompts), a handle, a (start, end) span of the
        prompt, or None. timeout: seconds from its arrival (a server passes when its handler got it; default now)
        after which it ends unfinished ("timeout") at the next step. Raises RequestError for bad input and QueueFull
        when the queue is full, before any device work."""
        if timeout is not None and not timeout > 0:
            raise RequestError(f"timeout={timeout} must be a positive number of seconds")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in use")
        key = seed_key(seed)  # checked before affix discovery records the prompt
        req = self.plan_request(prompt, config, affix, rid)
        req.on_block, req.key = on_block, key
        if arrival is not None:
            req.arrival = arrival
        req.deadline = None if timeout is None else req.arrival + timeout
        self.scheduler.add(req)
        self._requests[rid] = req
        self.counters["requests"] += 1
        return rid

    def plan_request(
        self,
        prompt: Sequence[int],
        config: GenerationConfig | None = None,
        affix: Any = "auto",
        request_id: str = "planned",
        remember: bool = True,
    ) -> Request:
        """The checked request `add_request` would queue (RequestError otherwise), its affix span and BiCache depth
        resolved; not queued. remember=False: affix discovery does not record the prompt."""
        req = self.intake.request(prompt, config, affix, request_id, remember)
        if not self.scheduler.fits_ever(req):
            raise RequestError(
                f"request {request_id} needs {pages_for(req.private_tokens(), self.config.page_size)} "
                f"pages (plus its affix), more than the whole pool's {self.block_manager.num_pages}"
            )
        return req

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def open_rows(self) -> int:
        """Batch rows no running or queued request will take at the next step."""
        s = self.scheduler
        return max(self.config.max_batch - len(s.running) - len(s.waiting), 0)

    def step(self) -> list[BlockOutput]:
        """One iteration: admit, build new affixes, then one block of every running request (ACache's new ones probed
        just before, by a call of their own)."""
        before = compile_totals()
        outputs = self._step()
        compiled, seconds, _ = (a - b for a, b in zip(compile_totals(), before))
        if compiled and self.warmed:  # the engine's own calls (its thread's): a shape or setting it did not warm
            self.counters["compiles_after_warmup"] += compiled
            self.counters["compile_seconds_after_warmup"] += seconds
            log.warning("the engine compiled %d program(s) after warm-up: a shape or setting it did not warm", compiled)
        return outputs

    def _step(self) -> list[BlockOutput]:
        now = time.perf_counter()
        expired = [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.deadline and now >= r.deadline]
        outputs = [self._end(r, "timeout") for r in expired]
        admitted = self.scheduler.admit()
        self.runner.forget(self.block_manager.evictions())  # what the runner keeps of evicted affixes
        self.counters["peak_pages"] = max(self.counters["peak_pages"], self.block_manager.num_used_pages)
        for r in admitted:
            if r.affix_entry is not None:
                try:
                    self._prepare_affix(r)
                except Exception as e:  # noqa: BLE001  a failed device call fails its request, not the engine
                    outputs += self._fault([r], e)
        for group in self.scheduler.batches(self._program):
            outputs += self._run_calls(sorted(group, key=lambda r: r.needs_probe))  # new ones last, all probed first
        return outputs

    def _run_calls(self, group: list[Request]) -> list[BlockOutput]:
        """One block of each of one program's requests (new ACache ones last, probed first), in the calls
        `Ladder.calls` splits them into: a block start recomputes every row's window up to the longest one's, so a
        few long windows (unshared requests among shared ones, audit shadows) run apart."""
        outputs: list[BlockOutput] = []
        bl = group[0].block_length
        steps = [min(r.config.schedule.steps_per_block, bl) for r in group]
        for ix in self.runner.ladder.calls([r.private_tokens() for r in group], steps, bl):
            call = [group[i] for i in ix]  # in group order: the probed rows last
            probing = [r for r in call if r.needs_probe]
            if any(r.status != Status.RUNNING for r in call):  # failed with a lost pool earlier in this step
                continue
            try:
                if self.before_call is not None:
                    self.before_call([r.request_id for r in call])
                if probing:  # their anchors first, then their first block in the call with the others
                    for r, ranking in zip(probing, self.runner.probe(probing, self.block_manager)):
                        r.probe_done(ranking)
                    self.counters["probes"] += len(probing)
                blocks = self.runner.run_block(call, self.block_manager, self._program(call[0]))
            except Exception as e:  # noqa: BLE001  a failed device call fails its requests, not the engine
                outputs += self._fault(call, e)
                continue
            self.consecutive_faults = 0
            now = time.perf_counter()
            for r, blk, committed, key in zip(call, *blocks):
                outputs.append(self._commit(r, blk.tolist(), committed.tolist(), key, now))
            self.counters["blocks"] += 1
            self.counters["block_rows"] += len(call)
        return outputs

    def _prepare_affix(self, r: Request) -> None:
        """An admitted request's stored affix: built once (its K/V, alone), and for BiCache its hidden states and
        its K/V placed in the request's pages."""
        bm, entry = self.block_manager, r.affix_entry
        slots = bm.slots(entry.pages, len(entry.tokens))
        if self.before_call is not None:
            self.before_call([r.request_id])
        self.counters["affix_hits" if entry.ready else "affix_builds"] += 1
        if not entry.ready:
            self.runner.build_affix(entry.tokens, slots)
            bm.mark_ready(entry)
        if isinstance(r.technique, Shallow):  # BiCache: the prefix's hidden state (once), its K/V placed
            self.runner.store_hidden(entry.key, entry.tokens, slots, r.depth)
            s, e = r.affix_span
            private = bm.slots(r.pages, r.private_tokens())  # prompt first: index j is prompt token j
            self.runner.place(slots, private[s:e], s)

    def _fault(self, group: list[Request], error: Exception) -> list[BlockOutput]:
        """A device call over `group` raised: fail those requests, and if it consumed the pool, rebuild it and fail
        every running request (see the class docstring)."""
        self.counters["faults"] += 1
        self.consecutive_faults += 1
        self.last_fault = f"{type(error).__name__}: {error}"
        lost = self.runner.pool_lost()
        failed = list(group) + ([r for r in self.scheduler.running if r not in group] if lost else [])
        note = "; the KV pool was lost and is rebuilt" if lost else ""
        log.error("a device call failed (%d request(s) fail%s): %s", len(failed), note, self.last_fault, exc_info=error)
        outputs = [self._end(r, "error") for r in failed if r.status != Status.FINISHED]
        if lost:
            self.runner.reset_pool()
            self.block_manager.drop_cached()  # every copy's K/V went with the pool; rebuilt on their next use
            self.runner.forget(self.block_manager.evictions())
            self.counters["pool_rebuilds"] += 1
        return outputs

    def _program(self, req: Request) -> BlockRunner:
        """The block runner of a request's calls: its block length and BiCache depth (everything else is data)."""
        return self._runners[(req.block_length, req.depth if isinstance(req.technique, Shallow) else None)]

    def _commit(self, r: Request, block: list[int], steps: list[int], key, now: float) -> BlockOutput:
        stops = set(r.config.stop_token_ids(self.model.config))
        before = len(r.answer(tuple(stops)))
        ended = r.config.stop_at_eos and any(t in stops for t in r.generated)
        r.generated.extend(block)
        r.key = np.asarray(key, np.uint32)
        r.first_block_time = r.first_block_time or now
        new = [] if ended else r.answer(tuple(stops))[before:] if r.config.stop_at_eos else block
        stopped = r.config.stop_at_eos and any(t in stops for t in block)
        reason = "stop" if stopped else "length" if r.blocks_done == r.n_blocks else None
        self.counters["generated_tokens"] += len(new)
        if reason is not None:
            self._finish(r, reason, now)
        return self._emit(r, new, reason, steps[: len(new)])

    def _end(self, r: Request, reason: str) -> BlockOutput:
        """End a request unfinished ("abort"; "error": its device call failed; "timeout": past its deadline)."""
        self._finish(r, reason)
        return self._emit(r, [], reason)

    def _emit(self, r: Request, tokens: list[int], reason: str | None, steps=()) -> BlockOutput:
        affix = r.affix_span, list(r.anchors)
        out = BlockOutput(r.request_id, r.blocks_done - 1, tokens, reason is not None, reason, list(steps), affix)
        if r.on_block is not None:
            r.on_block(out)
        return out

    def _finish(self, r: Request, reason: str, now: float | None = None) -> None:
        self.scheduler.finish(r)
        r.finish_reason, r.finish_time = reason, now or time.perf_counter()
        self.counters[{"abort": "aborted", "error": "failed", "timeout": "timed_out"}.get(reason, "finished")] += 1
        self._finished[r.request_id] = None  # bounded: a caller that never releases does not grow the engine
        while len(self._finished) > FINISHED_KEPT:
            self._requests.pop(self._finished.popitem(last=False)[0], None)

    def abort(self, request_id: str) -> bool:
        """Stop a request now (waiting or running) and free its pages. False if it is unknown or already done."""
        if (r := self._requests.get(request_id)) is None or r.status == Status.FINISHED:
            return False
        self._end(r, "abort")
        return True

    def request(self, request_id: str) -> Request:
        """A request's record: while it waits or runs, and once finished until `release` (or until FINISHED_KEPT
        later requests finished). KeyError otherwise."""
        return self._requests[request_id]

    def release(self, request_id: str) -> None:
        """Forget a finished request's record (the server does this once it has answered)."""
        if (r := self._requests.get(request_id)) is not None and r.status == Status.FINISHED:
            del self._requests[request_id]
            self._finished.pop(request_id, None)

    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig | None = None, *, affix: Any = "auto",
                 seeds: Sequence[int] | None = None, progress: bool = True) -> list[list[int]]:  # fmt: skip
        """Serve a list of prompts to the end (a progress bar over blocks); returns each one's answer tokens."""
        ids = [self.add_request(p, config, affix=affix, seed=seeds[i] if seeds else 0) for i, p in enumerate(prompts)]
        records = [self._requests[i] for i in ids]
        with tqdm(total=sum(r.n_blocks for r in records), desc="blocks", unit="block", disable=not progress) as bar:
            while any(r.status != Status.FINISHED for r in records):  # ended by a step, or aborted meanwhile
                self.step()
                bar.update(sum(r.blocks_done for r in records) - bar.n)
                for rid in ids:  # the finished ones at once (a no-op for the others): finished records stay bounded
                    self.release(rid)
        for rid in ids:  # those aborted during the last step
            self.release(rid)
        return [r.answer(tuple(r.config.stop_token_ids(self.model.config))) for r in records]

    def program_count(self) -> int:
        """How many programs serving can ever run (a function of the settings only): what `warmup` compiles."""
        return len(self._programs)

    def warmup(self, progress: bool = True) -> dict:
        """Compile every program the engine can ever run, before serving (nothing is written to the pool). Returns the
        programs, the XLA compilations it took, those loaded from jax's persistent cache instead, and the seconds."""
        t0, (c0, _, loads0) = time.perf_counter(), compile_totals()
        seed_key(0)  # the tiny program that turns a seed into a key
        compile_overlapped(map(self.runner.lowered, self._programs), len(self._programs), progress)
        jax.block_until_ready(self.runner.k)
        seconds, (c1, _, loads1) = time.perf_counter() - t0, compile_totals()
        self.counters["warmup_seconds"] += seconds
        self.warmed, loaded = True, loads1 - loads0
        return dict(programs=self.program_count(), compiles=c1 - c0 - loaded, loaded=loaded, seconds=seconds)

    def stats(self) -> dict:
        """Counters and gauges (the server's /metrics). Compiles are XLA's, counted process-wide since the engine
        was made and since its warm-up."""
        bm, (events, seconds, loads), start = self.block_manager, compile_totals(), self._compiles_at_start
        page_bytes = bm.page_size * kv_bytes_per_token(self.model.config)
        return dict(
            self.counters,
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            **{f"pages_{n}": getattr(bm, f"num_{n}_pages") for n in ("free", "used", "shared", "cached")},
            pages_total=bm.num_pages,
            kv_bytes_used=bm.num_used_pages * page_bytes,
            peak_kv_bytes=self.counters["peak_pages"] * page_bytes,
            programs=self.program_count(),
            compiles=events - loads - (start[0] - start[2]),
            compiles_loaded=loads - start[2],
            compile_seconds=seconds - start[1],
            block_host_seconds=self.runner.host_seconds,
            block_device_seconds=self.runner.device_seconds,
            probe_seconds=self.runner.probe_seconds,
            consecutive_faults=self.consecutive_faults,
        )


def seed_key(seed: int) -> np.ndarray:
    """The key data `jax.random.key(seed)` holds: the request's random stream starts where generate's does."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not -(2**63) <= seed < 2**63:
        raise RequestError(f"seed={seed!r} must be an integer in [-2**63, 2**63)")  # what a key takes
    return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
