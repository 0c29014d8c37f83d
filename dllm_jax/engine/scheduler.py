"""Which requests run: a FIFO waiting queue, admission while pages and batch slots last, and the running requests
grouped into device calls at block boundaries (host bookkeeping only). Admission is strictly first come, first
served: a head that does not fit yet blocks the queue, so a long request is never starved by short ones."""

from __future__ import annotations

import collections
from typing import Callable, Hashable

from dllm_jax.engine.block_manager import BlockManager, OutOfPages, pages_for
from dllm_jax.engine.request import Request, Status


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: try again later (the server answers 429)."""


class Scheduler:
    """The waiting queue (at most max_queue) and the running requests (at most max_batch)."""

    def __init__(self, block_manager: BlockManager, max_batch: int, max_queue: int):
        self.bm, self.max_batch, self.max_queue = block_manager, max_batch, max_queue
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"the waiting queue holds {self.max_queue} requests")
        self.waiting.append(req)

    def pages_needed(self, req: Request) -> tuple[int, tuple[int, ...] | None]:
        """(private pages, the affix tokens whose stored copy the request holds, or None)."""
        affix = None if req.technique is None else tuple(req.prompt[req.affix_span[0] : req.affix_span[1]])
        return pages_for(req.private_tokens(), self.bm.page_size), affix

    def fits_ever(self, req: Request) -> bool:
        private, affix = self.pages_needed(req)
        return private + (0 if affix is None else pages_for(len(affix), self.bm.page_size)) <= self.bm.num_pages

    def admit(self) -> list[Request]:
        """Admit from the head of the queue while a batch slot and its pages are free (all or nothing per request:
        its affix entry first, then every private page it will ever write)."""
        start = len(self.running)
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            try:
                req.pages, req.affix_entry, _ = self.bm.admit(*self.pages_needed(req), owner=req.request_id)
            except OutOfPages:  # which changed nothing: the head waits until it fits
                break
            self.waiting.popleft().status = Status.RUNNING  # (req)
            self.running.append(req)
        return self.running[start:]

    def batches(self, key: Callable[[Request], Hashable]) -> list[list[Request]]:
        """The running requests (at most max_batch) grouped by `key`, what one program runs, in admission order."""
        groups: dict[Hashable, list[Request]] = {}
        for r in self.running:
            groups.setdefault(key(r), []).append(r)
        return list(groups.values())

    def finish(self, req: Request) -> None:
        """Free a running request's pages and its hold on the affix at once; drop a waiting one from the queue."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self.bm.free(req.pages, owner=req.request_id)
            if req.affix_entry is not None:
                self.bm.release_affix(req.affix_entry)
            req.pages, req.affix_entry = [], None
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
