"""A run's metric records: ``metrics.jsonl``, TensorBoard events and the plots drawn
from them (process 0 only)."""

from __future__ import annotations

import contextlib
import importlib.abc
import json
import sys
import threading

from jaxformer.run.directory import RunDir
from jaxformer.run.logs import is_main_process


class ImportBlock(importlib.abc.MetaPathFinder):
    """A finder that makes ``import NAME`` fail in the threads inside :meth:`blocked` only (a
    ``None`` in ``sys.modules`` would fail other threads too)."""

    def __init__(self, name: str):
        self.name = name
        self._threads: set[int] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name and threading.get_ident() in self._threads:
            raise ModuleNotFoundError(f"{self.name} is not imported here", name=self.name)
        return None   # the next finder decides

    @contextlib.contextmanager
    def blocked(self):
        """``import NAME`` raises ``ModuleNotFoundError`` in this thread while inside."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        thread = threading.get_ident()
        self._threads.add(thread)
        try:
            yield
        finally:
            self._threads.discard(thread)


_NO_TORCH = ImportBlock("torch")


def _summary_writer() -> type:
    """tensorboardX's ``SummaryWriter`` imported without PyTorch, which it loads whenever
    installed only to accept torch tensors (seconds and 200 MB of a run's start)."""
    if "tensorboardX" not in sys.modules:
        with _NO_TORCH.blocked():
            import tensorboardX  # noqa: F401
    from tensorboardX import SummaryWriter

    return SummaryWriter


class MetricsLog:
    """``metrics.jsonl`` plus TensorBoard events, one record per call (process 0 only)."""

    def __init__(self, run_dir: RunDir):
        self.path = run_dir.metrics
        self.writer = _summary_writer()(str(run_dir.tensorboard)) if is_main_process() else None

    def write(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(run_dir: RunDir, key: str | None = None) -> list[dict[str, float]]:
    """``metrics.jsonl``'s records in order (none if missing); ``key``: only those holding it."""
    if not run_dir.metrics.exists():
        return []
    rows = [json.loads(line) for line in run_dir.metrics.read_text().splitlines() if line.strip()]
    return [row for row in rows if key is None or key in row]


def write_plots(run_dir: RunDir) -> None:
    """``plots/{loss,nll,lr,bleu}.png`` from ``metrics.jsonl`` (``Figure`` objects: ``pyplot``
    untouched); ``nll``: without label smoothing, the dev points of every evaluation."""
    from matplotlib.figure import Figure

    rows = read_metrics(run_dir)
    plots = run_dir.plots
    plots.mkdir(exist_ok=True)
    series = {"loss": [("train", "train/loss"), ("dev", "dev/loss")],
              "nll": [("train", "train/nll"), ("dev", "dev/nll")], "lr": [("learning rate", "train/lr")],
              "bleu": [("dev BLEU", "dev/bleu")]}
    for name, curves in series.items():
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        for label, key in curves:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                dots = key.startswith("dev/") or len(points) == 1   # the evaluations' few points
                ax.plot(*zip(*points), label=label, marker="o" if dots else None)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if ax.lines:   # a run too short to log has nothing to label
            ax.legend()
        fig.tight_layout()
        fig.savefig(plots / f"{name}.png", dpi=100)   # the Agg canvas, chosen by the file type
