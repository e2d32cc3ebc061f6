"""Orbax checkpoints of a run: the train state, the data iterator, and the best params.

Layout under ``<workdir>``: ``checkpoints/<step>/{state,data}`` keeps the last N
steps (train state + grain iterator state); ``best/<step>/params`` keeps the
parameters with the best dev BLEU. Everything is data (arrays, JSON); no pickle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import orbax.checkpoint as ocp


class RunCheckpoints:
    """The two checkpoint managers of a run directory."""

    def __init__(self, workdir: str | Path, keep: int = 3):
        workdir = Path(workdir).absolute()
        self.latest = ocp.CheckpointManager(
            workdir / "checkpoints", item_names=("state", "data"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
        self.best = ocp.CheckpointManager(
            workdir / "best", item_names=("params",),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, best_fn=lambda m: m["bleu"],
                                                 best_mode="max", create=True))

    def latest_step(self) -> int | None:
        return self.latest.latest_step()

    def save(self, step: int, state: Any, data_iterator: Any) -> None:
        """Saves state and the data iterator's position (async; atomic on finalize)."""
        self.latest.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iterator)))

    def restore(self, step: int, abstract_state: Any, data_iterator: Any) -> Any:
        """Restores the state into ``abstract_state``'s structure and the iterator in place."""
        restored = self.latest.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(data_iterator)))
        return restored.state

    def save_best(self, step: int, params: Any, bleu: float) -> None:
        self.best.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                       metrics={"bleu": float(bleu)})

    def best_step(self) -> int | None:
        return self.best.best_step()

    def restore_params(self, abstract_state: Any) -> tuple[Any, int, str]:
        """Parameters to translate with: the best by dev BLEU, else the latest state's.

        Args:
          abstract_state: the train state's structure (``jax.eval_shape`` of it).

        Returns:
          ``(params, step, "best" | "latest")``.

        Raises:
          FileNotFoundError: the run directory has no checkpoint.
        """
        step = self.best.best_step()
        if step is not None:
            restored = self.best.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_state.params)))
            return restored.params, step, "best"
        step = self.latest.latest_step()
        if step is None:
            raise FileNotFoundError("No checkpoint in this run directory; train first.")
        restored = self.latest.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))
        return restored.state.params, step, "latest"

    def wait(self) -> None:
        self.latest.wait_until_finished()
        self.best.wait_until_finished()

    def close(self) -> None:
        self.latest.close()
        self.best.close()

