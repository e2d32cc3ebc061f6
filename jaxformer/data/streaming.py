"""Prepared data streamed into batches: constant memory, exact resume.

A grain ``IterDataset``: a per-epoch shuffled record order, cut into blocks of
``block_pairs``, each block planned (:func:`jaxformer.data.batching.pack_plan` or
``bucket_plan``), this process's rows collated from the memory-mapped ids. Only per-pair
integers live in memory; the position is (epoch, block, batch), and restoring it re-plans
one block. Not ``grain.experimental.BestFitPackIterDataset``: it flushes all its bins
whenever a pair fits none, pair by pair in Python (8.8-10.6% padding at ~1 ms a pair on
the shipped en-de); best-fit-decreasing over a block pads less, faster
(benchmarks/README.md, "data at scale").
"""

from __future__ import annotations

import atexit
import functools
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from jaxformer.data import batching
from jaxformer.data.batching import Plan, kept_records  # noqa: F401  (kept_records: re-exported)
from jaxformer.data.prepared import PreparedCorpus
from jaxformer.model.validation import DataPositionError

Planner = Callable[[np.ndarray, np.ndarray, np.random.Generator], Plan]
Position = dict[str, int]   # {"epoch", "block", "batch"}: the next batch to emit
START: Position = {"epoch": 0, "block": 0, "batch": 0}
POSITION_KEY = "stream_position"   # a batch's int64 [3] (epoch, block, batch) after it


def check_position(state: Any) -> Position:
    """``state`` as a :data:`Position` (where a saved position enters). Raises DataPositionError:
    not ``{"epoch", "block", "batch"}`` of non-negative ints: grain's ``{"next_index": …}`` (an
    older jaxformer's in-memory pipeline) or a damaged file."""
    if (isinstance(state, dict) and set(state) == set(START)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in state.values())):
        return {k: int(state[k]) for k in START}
    raise DataPositionError(
        f"Data position from an older jaxformer (before streamed data), whose batches cannot be "
        f"continued exactly: start over with --fresh or finish with the version that began the "
        f"run (got {state!r})." if isinstance(state, dict) and "next_index" in state else
        f"Not a data position: expected {{\"epoch\", \"block\", \"batch\"}} of non-negative integers, "
        f"got {state!r}; the file was damaged or edited. Put back the file the run wrote, or move "
        f"this checkpoint step out of checkpoints/ to resume from an older one, or start over "
        f"with --fresh.")


class BlockPlanDataset(grain.IterDataset):
    """Endless ``(length, indices, position after the batch)`` plans, block by block.

    Epoch ``e`` visits the records in ``default_rng([seed, e]).permutation(N)`` order, cut
    into blocks of ``block_pairs``; ``planner(src_len, tgt_len, default_rng([seed, e,
    block]))`` plans each block (indices into the records, -1 = empty). No batch spans two
    blocks. ``src_lengths`` / ``tgt_lengths``: ``[N]`` source ids / target ids + 1 (N ≥ 1).
    """

    def __init__(self, src_lengths: np.ndarray, tgt_lengths: np.ndarray, *, planner: Planner,
                 block_pairs: int, seed: int, start: Position = START):
        super().__init__()
        self.src_lengths, self.tgt_lengths = np.asarray(src_lengths), np.asarray(tgt_lengths)
        self.planner, self.block_pairs, self.seed = planner, block_pairs, seed
        self.start = dict(start)
        self.slice = (0, 1)   # (offset, step) of the batches this copy emits

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Emit only batches ``sl.start, sl.start + sl.step, …`` (grain's worker sharding)."""
        self.slice = (sl.start or 0, sl.step or 1)

    def __iter__(self) -> _BlockPlanIterator:
        iterator = _BlockPlanIterator(self)
        iterator.set_state(self.start)
        return iterator


class _BlockPlanIterator(grain.DatasetIterator):
    """Iterator of :class:`BlockPlanDataset`; its state is the next batch's position."""

    def __init__(self, dataset: BlockPlanDataset):
        super().__init__()
        self._ds = dataset
        self._epoch = self._block = self._batch = 0
        self._order: np.ndarray | None = None   # this epoch's record order
        self._plan: Plan | None = None          # this block's batches
        self._seen = 0   # batches passed since the last set_state (for the slice)

    def __next__(self) -> tuple[int, np.ndarray, Position]:
        ds, (offset, step) = self._ds, self._ds.slice
        while True:
            if self._plan is None:
                self._plan = self._plan_block()
            if self._batch == len(self._plan):
                self._plan, self._batch, self._block = None, 0, self._block + 1
                if self._block * ds.block_pairs >= len(ds.src_lengths):
                    self._epoch, self._block, self._order = self._epoch + 1, 0, None
                continue
            self._batch, self._seen = self._batch + 1, self._seen + 1
            if (self._seen - 1) % step == offset:
                return *self._plan[self._batch - 1], self.get_state()

    def _plan_block(self) -> Plan:
        ds = self._ds
        if self._order is None:
            self._order = np.random.default_rng([ds.seed, self._epoch]).permutation(
                len(ds.src_lengths)).astype(np.int32 if len(ds.src_lengths) < 2**31 else np.int64)
        records = self._order[self._block * ds.block_pairs:(self._block + 1) * ds.block_pairs]
        rng = np.random.default_rng([ds.seed, self._epoch, self._block])
        plan = ds.planner(ds.src_lengths[records], ds.tgt_lengths[records], rng)
        return [(length, np.where(idx >= 0, records[np.maximum(idx, 0)], -1)) for length, idx in plan]

    def get_state(self) -> Position:
        return {"epoch": self._epoch, "block": self._block, "batch": self._batch}

    def set_state(self, state: Position) -> None:
        """``state``: a :data:`Position` (checked by :meth:`BatchStream.set_state`)."""
        if state["epoch"] != self._epoch:
            self._order = None
        self._epoch, self._block, self._batch = state["epoch"], state["block"], state["batch"]
        self._plan, self._seen = None, 0


def process_plans(corpus: PreparedCorpus, *, max_len: int, batch_tokens: int,
                  boundaries: tuple[int, ...], seed: int, row_multiple: int = 1, process_index: int = 0,
                  process_count: int = 1, pack: bool = True, block_pairs: int = 8192,
                  start: Position = START) -> grain.IterDataset:
    """This process's contiguous rows of every global batch from ``start`` on: ``(length, record
    ids [rows / process_count, P] packed or [rows / process_count] bucketed (-1 = empty),
    position after)``; ``row_multiple`` is a multiple of ``process_count``. Raises ValueError:
    no pair fits (:func:`jaxformer.data.batching.kept_records`)."""
    records, _ = kept_records(corpus, max_len)
    planner = (functools.partial(batching.pack_plan, length=boundaries[-1]) if pack else
               functools.partial(batching.bucket_plan, boundaries=boundaries))
    planner = functools.partial(planner, batch_tokens=batch_tokens, row_multiple=row_multiple)
    plans = BlockPlanDataset(corpus.src_lengths[records], corpus.tgt_lengths[records] + 1,
                             planner=planner, block_pairs=block_pairs, seed=seed, start=start)

    def share(item: tuple[int, np.ndarray, Position]) -> tuple[int, np.ndarray, Position]:
        length, indices, position = item
        rows = len(indices) // process_count
        mine = indices[process_index * rows:(process_index + 1) * rows]
        return length, np.where(mine >= 0, records[np.maximum(mine, 0)], -1), position

    return plans.map(share)


def stream_dataset(corpus: PreparedCorpus, *, pad_id: int, bos_id: int, eos_id: int, pack: bool = True,
                   **plan_options: Any) -> grain.IterDataset:
    """An endless, deterministic grain pipeline of this process's batches of ``corpus`` (a prepared
    corpus or :class:`jaxformer.data.batching.Examples`), planned by :func:`process_plans`; each
    holds :data:`POSITION_KEY` (int64 ``[3]``, the position after it). Raises ValueError: no
    pair fits."""
    build = batching.collate_packed if pack else batching.collate

    def collate(item: tuple[int, np.ndarray, Position]) -> dict[str, np.ndarray]:
        length, record_ids, position = item
        batch = build(corpus, length, record_ids, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
        batch[POSITION_KEY] = np.asarray([position[k] for k in START], np.int64)
        return batch

    return process_plans(corpus, pack=pack, **plan_options).map(collate)


class BatchStream(grain.DatasetIterator):
    """The training batches as a data source (:class:`jaxformer.data.sources.DataSource`).

    ``build(start)``: a ``grain.IterDataset`` of batches carrying their position
    (:func:`stream_dataset` bound); ``workers``: 0 = collate in this process (between
    train steps, while the device runs), ``n`` = in ``n`` grain processes, each ``buffer``
    batches ahead (worker ``i`` collates batches ``i, i + n, …``). ``get_state()`` is the
    position after the last batch returned, never the workers' lookahead, so a checkpoint
    resumes exactly with any ``workers``. Workers start on the first batch or
    :meth:`start_prefetch` and stop on :meth:`close`. ``set_state`` raises DataPositionError
    (:func:`check_position`).
    """

    def __init__(self, build: Callable[[Position], grain.IterDataset], workers: int = 0, buffer: int = 2,
                 fingerprint: dict[str, Any] | None = None):
        super().__init__()
        self._build, self._workers, self._buffer, self._fingerprint = build, workers, buffer, fingerprint
        self._position: Position = dict(START)
        self._batches: Any = None   # the running pipeline's iterator, started on demand
        if workers:
            _close_at_exit(self)

    def start_prefetch(self) -> None:
        if self._batches is None:
            dataset = self._build(dict(self._position))
            if self._workers:
                _absl_flags_parsed()
                dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(
                    num_workers=self._workers, per_worker_buffer_size=self._buffer),
                    worker_init_fn=_worker_init)
            self._batches = iter(dataset)
            if self._workers:
                self._batches.start_prefetch()

    def __next__(self) -> dict[str, np.ndarray]:
        self.start_prefetch()
        # Workers' arrays live in shared memory until dropped: copies release it at once.
        batch = {name: np.array(value) for name, value in next(self._batches).items()}
        self._position = dict(zip(START, map(int, batch.pop(POSITION_KEY))))
        return batch

    def records(self) -> BatchStream:
        """The batches from the position on (endless)."""
        return self

    def fingerprint(self) -> dict[str, Any] | None:
        return self._fingerprint

    def get_state(self) -> Position:
        return dict(self._position)

    def set_state(self, state: Any) -> None:
        position = check_position(state)
        self.close()
        self._position = position

    def close(self) -> None:
        """Stops the pipeline and its workers; using the stream again restarts it."""
        if self._batches is not None:
            self._batches.close()
            self._batches = None


def _worker_init(index: int, count: int, poll_s: float = 1.0) -> None:
    """In each worker: SIGINT and SIGTERM (sent to the whole process group) are left to the
    trainer, which checkpoints; a worker whose trainer died exits; JAX, if touched, gets the
    CPU, never the trainer's accelerator."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="jaxformer-parent-watch").start()


def _close_at_exit(stream: BatchStream) -> None:
    """Stops the workers at exit even if the stream was never closed (they ignore the SIGTERM
    of multiprocessing's own exit hook, which runs after this one)."""
    ref = weakref.ref(stream)
    atexit.register(lambda: ref() is not None and ref().close())


def _absl_flags_parsed() -> None:
    """grain 0.2.18's workers read an absl flag, which raises unless parsed (google/grain#1355)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()

