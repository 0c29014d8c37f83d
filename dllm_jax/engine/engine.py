"""`Engine`: many requests over one paged KV pool, continuous batching at block boundaries, shared affixes stored once.

    engine = Engine(model, EngineConfig(max_batch=16))
    doc = engine.register_affix(document_ids)                  # or found automatically in repeated prompts
    rid = engine.add_request(question_ids, config, affix=doc)   # errors here, before any device work
    while engine.has_unfinished():
        for out in engine.step():                              # one block of every running request
            ...                                                # out.tokens: the block's new answer tokens

Each iteration admits waiting requests (FIFO) while pages and batch slots last, builds the K/V of newly needed
affixes alone (once per affix, whatever its placement), then one block of every running request (one device call
per block length and BiCache depth: the block start and all its steps; temperatures, top-p / top-k, thresholds,
steps, lengths, seeds and anchors differ per row as data). A newly admitted ACache request rides its first call as a
probe (its window's forward, inside the block start of the others): it gets its anchors and commits nothing, then
decodes from the next call on. A request's tokens are those of `dllm_jax.generate` on that request alone with the
same settings.

The programs are fixed by the settings (`EngineConfig`: max_batch, max_model_len, the served block lengths, sampler
and BiCache depths), never by the traffic: `warmup()` compiles every one of them (`program_count()`), after which
no request compiles anything; a compile after warm-up is counted and logged as a warning.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from dllm_jax.decoding.caches.bicache import ShallowReuse
from dllm_jax.decoding.caches.dual import DualCache
from dllm_jax.decoding.config import CacheConfig, GenerationConfig, Schedule, Shallow
from dllm_jax.decoding.loop import BlockRunner
from dllm_jax.decoding.samplers import FamilySampler
from dllm_jax.decoding.samplers.rows import RowSampler
from dllm_jax.engine.affix_index import AffixIndex
from dllm_jax.engine.block_manager import BlockManager, pages_for
from dllm_jax.engine.intake import AffixHandle, Intake, RequestError
from dllm_jax.engine.kv_pool import kv_bytes_per_token
from dllm_jax.engine.request import BlockOutput, Request, Status
from dllm_jax.engine.runner import STRATEGY, Ladder, ModelRunner, compile_totals
from dllm_jax.engine.scheduler import QueueFull, Scheduler
from dllm_jax.io.loading import generation_defaults
from dllm_jax.transformer import KernelChoice, Kernels
from dllm_jax.transformer.params import unstack_layers
from dllm_jax.transformer.sharding import mesh_of

__all__ = [
    "AffixHandle",
    "Engine",
    "EngineConfig",
    "KVBudgetError",
    "QueueFull",
    "RequestError",
    "enable_compile_cache",
]
log = logging.getLogger("dllm_jax.engine")
# the engine's counters (stats(); the server's /metrics): requests by outcome, device faults, work done, peaks
COUNTERS = (
    "requests finished aborted failed timed_out faults pool_rebuilds generated_tokens blocks block_rows probes "
    "affix_builds affix_hits peak_pages warmup_seconds compiles_after_warmup compile_seconds_after_warmup"
).split()
FINISHED_KEPT = 4096  # finished requests whose records stay readable until `release` (older ones are dropped)
CPU_DEFAULT_BUDGET = 1 << 30  # the default pool on the CPU (which shares the host memory) or where free is unknown


class KVBudgetError(ValueError):
    """A KV budget that holds no page, or more than the device has free: refused before allocating anything."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """max_batch: requests decoded together in one device call (and the most running at once). kv_budget_bytes: the
    pool's size (at most the free memory); None = kv_fraction of the device's free memory (at most 1 GiB on the CPU).
    page_size: tokens per page. max_model_len: the longest prompt + generation (default: the model's maximum,
    at most 4096). max_queue: waiting requests beyond which add_request raises QueueFull. auto_affix: find shared
    spans in prompts without registration (requests whose config names an affix technique). min_affix_tokens: the
    shortest span worth sharing. attention: the kernel choice (auto: the slot kernel through the page tables on a
    GPU, XLA's gather elsewhere). batch_sizes: the batch shapes calls are padded to (default: 1, 4, 16, ... up to
    max_batch, and max_batch). window_sizes: the widths an affix's own forward is padded to (default: 256, 1024,
    4096, ... up to max_model_len, which is always added). window_chunk: block starts run in chunks of this many
    tokens a row (halved at larger batches until a chunk of all rows is at most 2048 tokens), as many as the
    longest window in the call needs: one program for every window length. block_lengths:
    the block lengths served (None: the model's generation_config.json block_length, else 32). sampler: the static
    part of the sampler served (LLaDA's remasking rule, Dream's algorithm, alg_temp and eps; None: the family's
    default); temperature, top-p / top-k, threshold or factor and steps are per request. shallow_depths: the BiCache
    depths served (none by default: BiCache requests are refused). Each of these multiplies the programs compiled
    at warm-up; a request outside them gets RequestError naming the list. compiler_options: XLA options (name,
    value) the block programs are compiled with (XLA's defaults when empty; for experiments such as command
    buffers), checked when the engine is made."""

    max_batch: int = 16
    kv_budget_bytes: int | None = None
    kv_fraction: float = 0.5
    page_size: int = 16
    max_model_len: int | None = None
    max_queue: int = 4096
    auto_affix: bool = True
    min_affix_tokens: int = 64
    attention: str = "auto"
    batch_sizes: tuple[int, ...] | None = None
    window_sizes: tuple[int, ...] | None = None
    window_chunk: int = 256
    block_lengths: tuple[int, ...] | None = None
    sampler: FamilySampler | None = None
    shallow_depths: tuple[int, ...] = ()
    compiler_options: tuple[tuple[str, str | bool | int | float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_batch", "page_size", "max_queue", "min_affix_tokens", "window_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)} must be positive")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise ValueError(f"EngineConfig.kv_budget_bytes={self.kv_budget_bytes} must be positive")
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"EngineConfig.kv_fraction={self.kv_fraction} must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len={self.max_model_len} must be positive")
        KernelChoice(attention=self.attention)
        for name in ("block_lengths", "shallow_depths", "window_sizes"):
            values = getattr(self, name)
            if values is not None:
                object.__setattr__(self, name, tuple(sorted({int(v) for v in values})))
        if self.window_sizes is not None and (not self.window_sizes or min(self.window_sizes) <= 0):
            raise ValueError(f"EngineConfig.window_sizes={self.window_sizes} must be positive")
        if self.block_lengths is not None and (not self.block_lengths or min(self.block_lengths) <= 0):
            raise ValueError(f"EngineConfig.block_lengths={self.block_lengths} must be positive")
        object.__setattr__(self, "compiler_options", tuple(dict(self.compiler_options).items()))  # typed, hashable
        if self.shallow_depths and min(self.shallow_depths) < 0:
            raise ValueError(f"EngineConfig.shallow_depths={self.shallow_depths} must be >= 0")
        if self.batch_sizes is not None and (
            not self.batch_sizes or max(self.batch_sizes) != self.max_batch or min(self.batch_sizes) < 1
        ):
            raise ValueError(
                f"EngineConfig.batch_sizes={self.batch_sizes} must be positive sizes ending at "
                f"max_batch={self.max_batch}"
            )


def free_memory_bytes(device: jax.Device) -> int:
    """Bytes free on `device`: what its allocator reports, else (the CPU) the host's available memory; 0 if
    unknown."""
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return max(stats["bytes_limit"] - stats.get("bytes_in_use", 0), 0)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0


class Engine:
    """before_call: called with the request ids of every device call before it runs (fault injection in tests: what
    it raises is that call's fault). A failed call fails only its requests (finish reason "error", pages freed); when
    it consumed the pool's buffers (they are donated to every call), the pool is rebuilt zeroed, stored affix copies
    are dropped (rebuilt on their next use) and every running request fails with it: their K/V are gone, and some
    may have streamed blocks already, so none is restarted. Waiting requests are untouched."""

    def __init__(
        self, model, config: EngineConfig | None = None, before_call: Callable[[list[str]], None] | None = None
    ):
        self.model, self.config = model, config or EngineConfig()
        self.before_call = before_call
        self.consecutive_faults = 0  # failed device calls since the last one that ran
        self.last_fault: str | None = None
        mc = model.config
        self.max_len = min(self.config.max_model_len or min(mc.max_seq_len, 4096), mc.max_seq_len)
        num_pages = self._pages_within_budget()
        self.block_manager = BlockManager(num_pages, self.config.page_size)
        self.scheduler = Scheduler(
            self.block_manager, self.config.max_batch, self.config.max_batch, self.config.max_queue
        )
        # what is served, resolved once: each is part of the programs' keys (everything else is data)
        m = self.config.min_affix_tokens
        self.affixes = AffixIndex(self.config.page_size, min_tokens=m, k=min(16, m))
        default_block = generation_defaults(getattr(model, "path", None)).get("block_length", 32)
        self.intake = Intake.serving(
            mc,
            self.max_len,
            self.config.block_lengths or (default_block,),
            self.config.sampler,
            self.config.shallow_depths,
            self.affixes,
            self.config.auto_affix,
        )
        self.block_lengths, self.sampler = self.intake.block_lengths, self.intake.sampler
        # the pool is per layer, so the layer loop is unrolled: stacked params (the CPU default) are unstacked once
        params = unstack_layers(model.params, fuse=mesh_of(model.params) is None)  # fused q/k/v would not split by head
        kernels = Kernels.resolve(KernelChoice(attention=self.config.attention, rope_write="xla"), mc, params)
        ladder = Ladder.for_settings(
            self.config.max_batch,
            self.max_len,
            self.config.batch_sizes,
            self.config.window_sizes,
            self.config.window_chunk,
        )
        options = self.config.compiler_options
        self.runner = ModelRunner(params, mc, num_pages * self.config.page_size, self.max_len, ladder, kernels, options)
        self._runners = {
            (bl, depth): BlockRunner(
                mc,
                GenerationConfig(Schedule(bl, bl, bl), RowSampler(self.sampler), CacheConfig("dual")),
                STRATEGY if depth is None else ShallowReuse(DualCache(), depth),
                RowSampler(self.sampler),
            )
            for bl in self.block_lengths
            for depth in (None, *self.config.shallow_depths)
        }
        self._programs = self.runner.programs(list(self._runners.values()))  # fixed with the settings
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()  # unreleased, oldest first
        self.warmed = False
        self._compiles_at_start = compile_totals()
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)  # what stats() reports, with the gauges

    def _pages_within_budget(self) -> int:
        """The pool's pages: kv_budget_bytes, or kv_fraction of the free memory (at most 1 GiB on the CPU, where the
        pool shares the host's memory with everything else). A budget over the free memory is refused here rather
        than crashing the process when the pool is allocated."""
        device = jax.devices()[0]
        free = free_memory_bytes(device)
        budget = self.config.kv_budget_bytes
        if budget is None:
            budget = int(free * self.config.kv_fraction) if free else CPU_DEFAULT_BUDGET
            budget = min(budget, CPU_DEFAULT_BUDGET) if device.platform == "cpu" else budget
        elif free and budget > free:
            raise KVBudgetError(
                f"a KV budget of {budget / 2**30:.2f} GiB is more than the {free / 2**30:.2f} GiB free on "
                f"{device.device_kind}: lower kv_budget_bytes (dllm-jax serve --kv-budget-gib)"
            )
        page_bytes = kv_bytes_per_token(self.model.config) * self.config.page_size
        if budget < page_bytes:
            raise KVBudgetError(
                f"a KV budget of {budget} bytes holds no page of {self.config.page_size} tokens ({page_bytes} bytes)"
            )
        return int(budget // page_bytes)

    # ---- submitting ---------------------------------------------------------------------------------------------
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
        """Queue a request; returns its id. config: the decoding settings (cache "dual"; its affix technique, if
        any, says how a shared affix is reused). affix: "auto" (registered affixes, then a span repeated from earlier
        prompts), a handle, an explicit (start, end) span of the prompt, or None (nothing shared). timeout: seconds
        from its arrival after which the request ends unfinished (finish reason "timeout", pages freed) at the next
        step, waiting or running. arrival: when it arrived (`time.perf_counter()`; default now): a server passes the
        time its handler got it, so latencies and timeouts count the wait for the engine's thread. Raises
        RequestError for bad input and QueueFull when the queue is at its bound, before any device work."""
        if timeout is not None and not timeout > 0:
            raise RequestError(f"timeout={timeout} must be a positive number of seconds")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already in use")
        req = self.plan_request(prompt, config, affix, rid)
        req.seed, req.on_block, req.key = seed, on_block, seed_key(seed)
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
        """The checked request `add_request` would queue (RequestError otherwise), with its affix span resolved
        and, for BiCache, its depth; not queued. remember=False: affix discovery does not record the prompt."""
        req = self.intake.request(prompt, config, affix, request_id, remember)
        if not self.scheduler.fits_ever(req):
            raise RequestError(
                f"request {request_id} needs {pages_for(req.private_tokens(), self.config.page_size)} "
                f"pages (plus its affix), more than the whole pool's {self.block_manager.num_pages}"
            )
        return req

    # ---- running ------------------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def open_rows(self) -> int:
        """Batch rows no running or queued request will take at the next step."""
        s = self.scheduler
        return max(self.config.max_batch - len(s.running) - len(s.waiting), 0)

    def step(self) -> list[BlockOutput]:
        """One scheduling iteration: admit, build new affixes, then one block of every running request (or its
        ACache probe)."""
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
        outputs = [self._end(r, "timeout") for r in list(self.scheduler.requests()) if r.deadline and now >= r.deadline]
        admitted = self.scheduler.admit()
        self.runner.forget(self.block_manager.evictions())  # what the runner keeps of evicted affixes
        self.counters["peak_pages"] = max(self.counters["peak_pages"], self.block_manager.num_used_pages)
        bm = self.block_manager
        for r in admitted:
            if r.affix_entry is None:
                continue
            try:
                self._prepare_affix(r)
            except Exception as e:  # noqa: BLE001  a failed device call fails its request, not the engine
                outputs += self._fault([r], e)
        for group in self.scheduler.batches(self._program):
            probing = [r for r in group if r.needs_probe]
            if len(probing) > Ladder.probe_rows:  # the rest are probed by the next calls
                group = [r for r in group if not r.needs_probe] + probing[: Ladder.probe_rows]
            if any(r.status != Status.RUNNING for r in group):  # failed with a lost pool earlier in this step
                continue
            try:
                if self.before_call is not None:
                    self.before_call([r.request_id for r in group])
                tokens, keys, steps, ranks = self.runner.run_block(group, bm, self._program(group[0]))
            except Exception as e:  # noqa: BLE001  a failed device call fails its requests, not the engine
                outputs += self._fault(group, e)
                continue
            self.consecutive_faults = 0
            now = time.perf_counter()
            for i, (r, blk, key) in enumerate(zip(group, tokens, keys)):
                if r.needs_probe:  # this call was its probe: its anchors now, its first block next call
                    r.probe_done(ranks[i])
                    self.counters["probes"] += 1
                else:
                    outputs.append(self._commit(r, blk.tolist(), key, steps, now))
            self.counters["blocks"] += 1
            self.counters["block_rows"] += len(group)
        return outputs

    def _prepare_affix(self, r: Request) -> None:
        """An admitted request's stored affix: built once (its K/V, alone), and for BiCache its hidden states and
        its K/V placed in the request's pages."""
        bm, entry = self.block_manager, r.affix_entry
        if self.before_call is not None:
            self.before_call([r.request_id])
        if not entry.ready:
            self.runner.build_affix(entry.tokens, bm.slots(entry.pages, len(entry.tokens)))
            bm.mark_ready(entry)
            self.counters["affix_builds"] += 1
        else:
            self.counters["affix_hits"] += 1
        if isinstance(r.technique, Shallow):  # BiCache: the prefix's hidden states (once), its K/V placed
            self.runner.store_hidden(entry.key, entry.tokens)
            s, e = r.affix_span
            private = bm.slots(r.pages, r.private_tokens())  # prompt first: index j is prompt token j
            self.runner.place(bm.slots(entry.pages, e - s), private[s:e], s)

    def _fault(self, group: list[Request], error: Exception) -> list[BlockOutput]:
        """A device call over `group` raised: fail those requests; if the call consumed the pool, rebuild it and
        fail every running request (see the class docstring)."""
        self.counters["faults"] += 1
        self.consecutive_faults += 1
        self.last_fault = f"{type(error).__name__}: {error}"
        lost = self.runner.pool_lost()
        failed = list(group) + ([r for r in self.scheduler.running if r not in group] if lost else [])
        log.error(
            "a device call failed (%d request(s) fail%s): %s",
            len(failed),
            "; the KV pool was lost and is rebuilt" if lost else "",
            self.last_fault,
            exc_info=error,
        )
        outputs = [self._end(r, "error") for r in failed if r.status != Status.FINISHED]
        if lost:
            self.runner.reset_pool()
            self.block_manager.drop_cached()  # every copy's K/V went with the pool; rebuilt on their next use
            self.runner.forget(self.block_manager.evictions())
            self.counters["pool_rebuilds"] += 1
        return outputs

    def _end(self, r: Request, reason: str) -> BlockOutput:
        """End a request unfinished ("error": its device call failed; "timeout": past its deadline)."""
        self._finish(r, reason)
        out = BlockOutput(r.request_id, r.blocks_done - 1, [], True, reason)
        if r.on_block is not None:
            r.on_block(out)
        return out

    def _program(self, req: Request) -> BlockRunner:
        """The block runner of a request's calls: its block length and BiCache depth (everything else is data)."""
        return self._runners[(req.block_length, req.depth if isinstance(req.technique, Shallow) else None)]

    def _commit(self, r: Request, block: list[int], key, steps: int, now: float) -> BlockOutput:
        stops = set(r.config.stop_token_ids(self.model.config))
        before = len(r.answer(tuple(stops)))
        ended = r.config.stop_at_eos and any(t in stops for t in r.generated)
        r.generated.extend(block)
        r.key, r.nfe = np.asarray(key, np.uint32), r.nfe + steps
        if r.first_block_time is None:
            r.first_block_time = now
        new = [] if ended else r.answer(tuple(stops))[before:] if r.config.stop_at_eos else block
        stopped = r.config.stop_at_eos and any(t in stops for t in block)
        reason = "stop" if stopped else "length" if r.blocks_done == r.n_blocks else None
        self.counters["generated_tokens"] += len(new)
        if reason is not None:
            self._finish(r, reason, now)
        out = BlockOutput(r.request_id, r.blocks_done - 1, new, reason is not None, reason)
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
        r = self._requests.get(request_id)
        if r is None or r.status == Status.FINISHED:
            return False
        self._finish(r, "abort")
        if r.on_block is not None:
            r.on_block(BlockOutput(r.request_id, r.blocks_done - 1, [], True, "abort"))
        return True

    def request(self, request_id: str) -> Request:
        """A request's record: while it waits or runs, and once finished until `release` (or until FINISHED_KEPT
        later requests finished). KeyError otherwise."""
        return self._requests[request_id]

    def release(self, request_id: str) -> None:
        """Forget a finished request's record (the server does this once it has answered)."""
        r = self._requests.get(request_id)
        if r is not None and r.status == Status.FINISHED:
            del self._requests[request_id]
            self._finished.pop(request_id, None)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        config: GenerationConfig | None = None,
        *,
        affix: Any = "auto",
        seeds: Sequence[int] | None = None,
        progress: bool = True,
    ) -> list[list[int]]:
        """Serve a list of prompts to the end (a progress bar over blocks); returns each one's answer tokens."""
        ids = [self.add_request(p, config, affix=affix, seed=seeds[i] if seeds else 0) for i, p in enumerate(prompts)]
        answers: dict[str, list[int]] = dict.fromkeys(ids)
        total = sum(self._requests[i].n_blocks for i in ids)
        with tqdm(total=total, desc="blocks", unit="block", disable=not progress) as bar:
            while any(a is None for a in answers.values()):
                for out in self.step() if self.has_unfinished() else []:
                    if out.request_id in answers:  # not another caller's request
                        bar.update(1)
                for rid in [rid for rid, a in answers.items() if a is None]:
                    r = self._requests[rid]
                    if r.status == Status.FINISHED:  # its answer now (ended by a step or an abort): released at once
                        answers[rid] = r.answer(tuple(r.config.stop_token_ids(self.model.config)))
                        self.release(rid)
        return list(answers.values())

    def program_count(self) -> int:
        """How many programs serving can ever run (a function of the settings only): what `warmup` compiles."""
        return len(self._programs)

    def warmup(self, progress: bool = True) -> dict:
        """Compile every program the engine can ever run (its settings fix them), before serving: afterwards no
        request compiles anything. Nothing is written to the pool. Returns the programs, the XLA compilations it
        took, those loaded from jax's persistent compilation cache instead, and the seconds."""
        t0 = time.perf_counter()
        c0, _, loads0 = compile_totals()
        seed_key(0)  # the tiny program that turns a seed into a key
        self.runner.warm(self._programs, progress)
        jax.block_until_ready(self.runner.k)
        seconds = time.perf_counter() - t0
        self.counters["warmup_seconds"] += seconds
        self.warmed = True
        c1, _, loads1 = compile_totals()
        loaded = loads1 - loads0
        return dict(programs=self.program_count(), compiles=c1 - c0 - loaded, loaded=loaded, seconds=seconds)

    # ---- state --------------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters and gauges (the server's /metrics). Compiles are XLA's, counted process-wide since the engine
        was made and since its warm-up."""
        bm = self.block_manager
        events, seconds, loads = compile_totals()
        return dict(
            self.counters,
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            pages_total=bm.num_pages,
            pages_free=bm.num_free_pages,
            pages_used=bm.num_used_pages,
            pages_shared=bm.num_shared_pages,
            pages_cached=bm.num_cached_pages,
            kv_bytes_used=bm.num_used_pages * bm.page_size * kv_bytes_per_token(self.model.config),
            peak_kv_bytes=self.counters["peak_pages"] * bm.page_size * kv_bytes_per_token(self.model.config),
            programs=self.program_count(),
            compiles=events - loads - (self._compiles_at_start[0] - self._compiles_at_start[2]),
            compiles_loaded=loads - self._compiles_at_start[2],
            compile_seconds=seconds - self._compiles_at_start[1],
            block_host_seconds=self.runner.host_seconds,
            block_device_seconds=self.runner.device_seconds,
            probe_seconds=self.runner.probe_seconds,
            consecutive_faults=self.consecutive_faults,
        )


def seed_key(seed: int) -> np.ndarray:
    """The key data `jax.random.key(seed)` holds: the request's random stream starts where generate's does."""
    return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)


def enable_compile_cache(path: str | os.PathLike) -> None:
    """Turn on jax's persistent compilation cache at `path` (created if missing): a restart with the same settings
    loads the engine's programs instead of compiling them. Every program is cached, however fast it compiled."""
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
