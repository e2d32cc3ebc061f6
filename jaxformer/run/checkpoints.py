"""Orbax checkpoints of a run: ``checkpoints/<step>/{state,data}`` (the last N train states and
data positions), ``best/<step>/params`` (the best dev BLEU's), ``averaged/<step>/params``; no
pickle. Orbax renames a step into place when complete (a killed save leaves a temporary
folder, cleaned up on the next start); an unreadable step is moved to ``corrupt/``. Unrolled
and scanned layers restore into each other (:mod:`jaxformer.model.scan`).
"""

from __future__ import annotations

import functools
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxformer.model import scan
from jaxformer.model.validation import DataPositionError
from jaxformer.run.checkpoint_files import Checkpoint, candidates
from jaxformer.run.positions import position_for_other_process_count


class CheckpointError(OSError):
    """No checkpoint of the run directory can be read."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's parameters have other names or shapes than the model's."""


def check_params_match(saved: Any, abstract_params: Any, where: str) -> None:
    """Raises :class:`CheckpointMismatchError` unless ``saved`` (metadata or arrays) has exactly
    ``abstract_params``' names and shapes (a partial restore would read a subset silently)."""
    def shapes(tree):
        return {jax.tree_util.keystr(path): tuple(leaf.shape)
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    have, want = shapes(saved), shapes(abstract_params)
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    reshaped = sorted(f"{k}: saved {have[k]} vs model {want[k]}" for k in want.keys() & have.keys()
                      if have[k] != want[k])
    if missing or extra or reshaped:
        def brief(items):
            return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
        parts = ([f"missing from the checkpoint: {brief(missing)}"] if missing else []) + (
            [f"not in the model: {brief(extra)}"] if extra else []) + (
            [f"other shapes: {brief(reshaped)}"] if reshaped else [])
        raise CheckpointMismatchError(
            f"{where} does not hold this model's parameters ({'; '.join(parts)}). Does config.json "
            f"still describe the run that saved it? Restore the run's own config.json.")


def saved_params(path: Path, key: str | None) -> Any:
    """The names and shapes stored at ``path`` (under ``key``), from orbax's item metadata."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(path).tree
    finally:
        handler.close()
    return tree[key] if key is not None else tree


def in_layout(saved: Any, abstract: Any, restore: Callable[[Any], Any]) -> Any:
    """``restore(target)`` into ``abstract``; a ``saved`` of the other layer layout (scanned or
    unrolled) is read in its own first, then converted."""
    saved_scanned, want_scanned = scan.layout_of(saved), scan.layout_of(abstract)
    if saved_scanned is None or want_scanned is None or saved_scanned == want_scanned:
        return restore(abstract)
    target = scan.to_layout(abstract, saved_scanned)
    restored = restore(target)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, abstract)
    return jax.jit(lambda tree: scan.to_layout(tree, want_scanned), out_shardings=shardings)(restored)


def _first_line(error: BaseException) -> str:
    """A one-line reason: the error's first line without TensorStore's spec dump."""
    text = str(error).strip().splitlines()
    line = text[0].split(" See full TensorStore details")[0] if text else ""
    return f"{type(error).__name__}: {line[:200]}"


def _ignore_stray_read_callbacks() -> None:
    """Drops only a failed restore's unraisable exceptions: tensorstore reads in flight calling
    orbax's closed event loop, and orbax's failed read coroutines."""
    previous = sys.unraisablehook
    if getattr(previous, "_jaxformer_filter", False):
        return

    def hook(unraisable):
        error, source = unraisable.exc_value, unraisable.object
        closed_loop = (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
                       and source is None)
        orbax_read = "orbax" in getattr(getattr(source, "cr_code", None), "co_filename", "")
        if not (closed_loop or orbax_read):
            previous(unraisable)

    hook._jaxformer_filter = True
    sys.unraisablehook = hook


def _read_params(path: Path, key: str | None, params: Any) -> Any:
    """Parameters shaped as ``params`` from the item at ``path`` (under ``key``: a partial restore)."""
    target = params if key is None else {key: params}
    with ocp.PyTreeCheckpointer() as checkpointer:
        out = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
            item=target, partial_restore=key is not None,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    return out if key is None else out[key]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


class _CheckpointManager(ocp.CheckpointManager):
    """An orbax ``CheckpointManager`` that leaves JAX's preemption sync point to the trainer's
    ``PreemptionGuard`` (orbax's finalize thread would report stale steps to it)."""

    def reached_preemption(self, step: int) -> bool:
        return False

    def close(self) -> None:
        """Waits for orbax's removal of leftover temporary folders (else a traceback at exit), closes."""
        getattr(self, "_maybe_await_cleanup_tmp_directory", lambda: None)()   # orbax >= 0.12
        super().close()


class RunCheckpoints:
    """The checkpoint managers of a run directory: ``checkpoints/`` and ``best/``, created unless
    ``read_only`` (a reader beside a running trainer never touches them; orbax's own
    read_only option warns on every open)."""

    def __init__(self, workdir: str | Path, keep: int = 3, read_only: bool = False):
        self.workdir = workdir = Path(workdir).absolute()
        self.saved_best_step: int | None = None   # the best step save_best wrote, if any
        common = dict(create=not read_only, cleanup_tmp_directories=not read_only)
        self.latest = _CheckpointManager(
            workdir / "checkpoints", item_names=("state", "data"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, **common))
        self.best = _CheckpointManager(
            workdir / "best", item_names=("params",),
            options=ocp.CheckpointManagerOptions(max_to_keep=1, best_fn=lambda m: m["bleu"],
                                                 best_mode="max", **common))

    def latest_step(self) -> int | None:
        """The newest training checkpoint's step."""
        return self.latest.latest_step()

    def save(self, step: int, state: Any, data_iterator: Any) -> None:
        """Saves state and the data iterator's position (async; atomic on finalize)."""
        import grain  # translating (params only) never loads grain

        self.latest.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(data_iterator)))

    def restore(self, step: int, abstract_state: Any, data_iterator: Any,
                report: Callable[[str], None] = _stderr, same_rows: bool = True) -> Any:
        """Restores the state into ``abstract_state`` and the iterator in place (a step of another
        process count continues when ``same_rows``). Raises ``DataPositionError`` when the
        step's data positions cannot be continued."""
        import grain

        other = position_for_other_process_count(self.latest.directory / str(step) / "data", same_rows)

        def restore(target):
            if other is None:   # grain reads this process's own file
                return self.latest.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target),
                    data=grain.checkpoint.CheckpointRestore(data_iterator))).state
            state = self.latest.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target))).state
            data_iterator.set_state(other[0])
            report(f"checkpoint step {step}: its data position, saved by {other[1]} process(es), "
                   f"continues on {jax.process_count()} (every process plans the same global batches)")
            return state

        saved = saved_params(self.latest.directory / str(step) / "state", None)
        return in_layout(saved, abstract_state, restore)

    def restore_latest(self, abstract_state: Any, data_iterator: Any,
                       report: Callable[[str], None] = _stderr, same_rows: bool = True
                       ) -> tuple[Any, int] | None:
        """``(state, step)`` of the newest readable step (``None``: no checkpoint yet); unreadable
        newer ones are reported and, once an older one restores, moved to ``corrupt/``.
        Raises ``CheckpointError`` (none readable) or ``DataPositionError``, changing nothing."""
        steps = sorted(self.latest.all_steps(), reverse=True)
        _ignore_stray_read_callbacks()   # before the first read: a failing one can fire them at once
        failures: list[tuple[int, str]] = []
        for step in steps:
            try:
                state = self.restore(step, abstract_state, data_iterator, report, same_rows)
            except DataPositionError as error:   # readable, but another pipeline's: refuse, move nothing
                raise DataPositionError(f"Checkpoint step {step} in {self.latest.directory}: {error} "
                                        f"Nothing was changed.") from error
            except Exception as error:  # any failure to read: this step is unusable
                failures.append((step, _first_line(error)))
                report(f"checkpoint step {step} is unreadable ({failures[-1][1]}); "
                       f"trying an older one")
                continue
            for bad, _ in failures:
                self._set_aside(self.latest.directory / str(bad), f"{bad}")
            if failures:
                self.latest.reload()
                report(f"moved unreadable step(s) {[b for b, _ in failures]} to "
                       f"{self.workdir / 'corrupt'}; resuming from step {step}")
            return state, step
        if failures:
            details = "; ".join(f"step {s}: {e}" for s, e in failures)
            raise CheckpointError(
                f"No readable checkpoint in {self.latest.directory} ({details}). Nothing was "
                f"changed. Start over with --fresh (moves these aside) or use another --workdir.")
        return None

    def _set_aside(self, path: Path, name: str) -> None:
        if jax.process_index() != 0 or not path.exists():   # one process moves shared files
            return
        target = self.workdir / "corrupt" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        target.parent.mkdir(exist_ok=True)
        shutil.move(str(path), str(target))

    def save_best(self, step: int, params: Any, bleu: float) -> None:
        """Saves ``params`` as step ``step``'s best (async; a step that has one keeps it) and
        records it in :attr:`saved_best_step`."""
        if step in self.best.all_steps():
            return
        self.best.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                       metrics={"bleu": float(bleu)})
        self.saved_best_step = step

    def best_step(self) -> int | None:
        """The best checkpoint's step."""
        return self.best.best_step()

    def best_bleu(self) -> float | None:
        """Dev BLEU of the best checkpoint, as recorded with it (``None`` if none)."""
        step = self.best.best_step()
        metrics = None if step is None else self.best.metrics(step)
        return float(metrics["bleu"]) if metrics else None

    def steps(self) -> list[int]:
        """The training checkpoints on disk, oldest first."""
        return sorted(self.latest.all_steps())

    def params_at(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of training checkpoint ``step``; raises as :meth:`restore_params`."""
        return self.restore_params(abstract_params, step)[0]

    def save_averaged(self, step: int, params: Any, info: dict[str, Any]) -> None:
        """Saves averaged parameters as the only ``averaged/<step>``, ``info`` (JSON) its metrics."""
        manager = _CheckpointManager(self.workdir / "averaged", item_names=("params",),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=1,
                                                                          enable_async_checkpointing=False))
        try:
            for old in manager.all_steps():
                manager.delete(old)
            manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                         metrics=info)
            manager.wait_until_finished()
        finally:
            manager.close()

    def restore_params(self, abstract_params: Any, which: str | int = "auto",
                       report: Callable[[str], None] = _stderr) -> tuple[Any, Checkpoint]:
        """:func:`restore_params` of checkpoint ``which`` (``"auto"``, ``"best"``, ``"latest"``,
        ``"averaged"`` or a training step: :func:`jaxformer.run.checkpoint_files.candidates`, whose
        ``FileNotFoundError`` names what the run has)."""
        return restore_params(candidates(self.workdir, which), abstract_params, report)

    def wait(self) -> None:
        """Waits for pending saves."""
        self.latest.wait_until_finished()
        self.best.wait_until_finished()

    def close(self) -> None:
        """Closes the managers."""
        self.latest.close()
        self.best.close()



def restore_params(chosen: Sequence[Checkpoint], abstract_params: Any,
                   report: Callable[[str], None] = _stderr) -> tuple[Any, Checkpoint]:
    """``(params, checkpoint)``: only the parameters of the first readable checkpoint of ``chosen``
    (:func:`jaxformer.run.checkpoint_files.candidates`' list, preferred first) read into
    ``abstract_params``, and which one they came from; an unreadable one is reported and the
    next tried (an unreadable best: the latest training checkpoint).

    Raises:
      CheckpointError: none of them is readable.
      CheckpointMismatchError: a checkpoint holds other parameters than the model's.
    """
    _ignore_stray_read_callbacks()
    failures = []
    for checkpoint in chosen:
        try:
            saved = saved_params(checkpoint.path, checkpoint.key)
            check_params_match(saved, scan.to_layout(abstract_params, bool(scan.layout_of(saved))),
                               checkpoint.name)
            read = functools.partial(_read_params, checkpoint.path, checkpoint.key)
            return in_layout(saved, abstract_params, read), checkpoint
        except CheckpointMismatchError:   # not damage: another run's config
            raise
        except Exception as error:  # any failure to read: this checkpoint is unusable
            failures.append(f"step {checkpoint.step}: {_first_line(error)}")
            fallback = checkpoint.kind == "best" and len(chosen) > 1
            report(f"{checkpoint.name} is unreadable ({_first_line(error)})"
                   + ("; using the latest training checkpoint" if fallback else ""))
    kind = chosen[0].kind if chosen else "auto"
    what = "checkpoint" if len(chosen) > 1 else f"{kind!r} checkpoint"
    where = chosen[0].path.parents[2] if chosen else "the run"
    raise CheckpointError(f"No readable {what} in {where} ({'; '.join(failures)}).")
