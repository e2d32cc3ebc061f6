"""Run messages on the ``"jaxformer"`` :mod:`logging` logger: the console (above the progress
bar), ``train.log`` (:class:`RunLog`) and the training :class:`Progress`; process 0 only."""

from __future__ import annotations

import logging
import logging.handlers
import time
from pathlib import Path

LOGGER_NAME = "jaxformer"
logger = logging.getLogger(LOGGER_NAME)


def is_main_process() -> bool:
    """Whether this is process 0, which writes the run's logs and records."""
    import jax  # here: the run directory's readers (CTranslate2 serving) import no JAX

    return jax.process_index() == 0


def log(message: str, level: int = logging.INFO) -> None:
    """Logs ``message`` on the ``jaxformer`` logger."""
    logger.log(level, message)


class _TqdmHandler(logging.StreamHandler):
    """Writes records above a running tqdm bar (``tqdm.write``) to the current stdout."""

    def __init__(self):
        super().__init__()
        self.addFilter(lambda record: is_main_process())

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record))
        except Exception:  # logging must never break the run; this is logging's own policy
            self.handleError(record)


def console_logging(level: int = logging.INFO) -> None:
    """Prints ``jaxformer`` records of ``level`` and up on stdout (process 0), unless the logger
    has handlers; they stop propagating to the root logger (where absl prints them again)."""
    if logger.handlers:
        return
    handler = _TqdmHandler()
    handler.setLevel(level)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False


class RunLog:
    """``train.log``: every ``jaxformer`` record, appended across resumes (process 0). Records
    are buffered from ``__enter__`` to :meth:`open` (after ``--fresh`` moved the old log); an
    error that ends the run after that is written, one during setup writes no file."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.buffer = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1)
        self.buffer.setLevel(logging.DEBUG)
        self.file: logging.FileHandler | None = None

    def __enter__(self) -> RunLog:
        # No JAX call here: jax.distributed.initialize() comes first (in setup).
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self.buffer)
        return self

    def open(self) -> None:
        """Opens ``train.log`` and writes the buffered records (other processes drop them)."""
        if self.file is not None:
            return
        if not is_main_process():
            logger.removeHandler(self.buffer)
            self.buffer.buffer.clear()
            return
        self.file = logging.FileHandler(self.path, mode="a", encoding="utf-8")
        self.file.setLevel(logging.DEBUG)
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.buffer.setTarget(self.file)
        self.buffer.flush()
        logger.removeHandler(self.buffer)
        logger.addHandler(self.file)

    def __exit__(self, kind, error, traceback) -> None:
        logger.removeHandler(self.buffer)
        self.buffer.buffer.clear()
        if self.file is not None:
            if error is not None:
                self.file.handle(logger.makeRecord(LOGGER_NAME, logging.ERROR, __file__, 0,
                                                   f"stopped: {kind.__name__}: {error}", None, None))
            logger.removeHandler(self.file)
            self.file.close()


class Progress:
    """Training progress: a tqdm bar, or (``enabled=False``) one log line per window. The bar
    counts the seconds of a budget (``deadline``, ``time.perf_counter()``), else the steps."""

    def __init__(self, *, enabled: bool, step: int, max_steps: int, t_start: float,
                 deadline: float | None, file=None):
        from tqdm import tqdm

        self.enabled, self.deadline, self.t_start = enabled, deadline, t_start
        counts = dict(total=max_steps, initial=step, unit="step") if deadline is None else dict(
            total=round(max(deadline - t_start, 1.0)), initial=0, unit="s",
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}s "
                       "[{elapsed}<{remaining}{postfix}]")
        self.bar = tqdm(disable=not enabled, dynamic_ncols=True, desc="train", file=file, **counts)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()

    def time_left(self) -> float | None:
        """Seconds left of the budget (``None`` without one)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())

    def step(self, step: int) -> None:
        """After each update: the bar advances (to the elapsed seconds under a budget)."""
        if not self.enabled:
            return
        if self.deadline is not None:
            elapsed = min(time.perf_counter() - self.t_start, self.bar.total)
            self.bar.update(elapsed - self.bar.n)   # redraws at tqdm's own rate (mininterval)
        else:
            self.bar.update(1)

    def window(self, step: int, loss: float, tokens_per_s: float, lr: float) -> None:
        """One logging window: the bar's postfix, and a line (printed with ``--no-progress``)."""
        left = self.time_left()
        line = (f"step {step} | loss {loss:.3f} | {tokens_per_s:,.0f} tok/s | lr {lr:.2e}"
                + ("" if left is None else f" | {left / 60:.1f} min left"))
        if self.enabled:
            postfix = dict(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:.0f}")
            if self.deadline is not None:
                postfix = {"step": str(step), **postfix}
            self.bar.set_postfix(postfix)
        logger.log(logging.DEBUG if self.enabled else logging.INFO, line)
