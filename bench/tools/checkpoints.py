"""Resumable training: the whole training state (params, optimizer state, step, the loop's bookkeeping) saved
through orbax every N steps, so a run longer than one device session continues where it stopped. The step's
randomness is `fold_in(key, step)`, so a resumed run takes the same steps as an uninterrupted one (tested)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class TrainCheckpoints:
    """The latest `keep` states of a run under `directory` (created if missing)."""

    def __init__(self, directory: str | Path, keep: int = 2):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(Path(directory).resolve(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """state: a pytree of arrays (params, optimizer state); meta: JSON (the loop's counters and settings)."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args)
        self.manager.wait_until_finished()  # a run killed right after still has this step

    def restore(self, like: Any, step: int | None = None) -> tuple[int, Any, dict]:
        """(step, state shaped like `like`, meta) of `step` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.manager.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        out = self.manager.restore(step, args=args)
        return step, out.state, dict(out.meta)

    def close(self) -> None:
        self.manager.close()
