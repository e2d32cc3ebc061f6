"""Batching: tokenized pairs → fixed-shape padded or packed batches → a grain pipeline.

Teacher forcing is explicit here (``tgt_in`` = bos y1 … yn, ``tgt_out`` = y1 … yn eos),
never inside the decoder. Few shapes mean few compiles: length buckets
(:func:`bucket_plan`) or one packed shape (:func:`pack_plan`), planned on lengths alone
by :mod:`jaxformer.data.streaming`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
import numpy as np

from jaxformer.data.corpus import DataReport, Pair
from jaxformer.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Examples:
    """Tokenized pairs in memory: ragged id lists, without bos/eos. Indexed and measured as
    a :class:`jaxformer.data.prepared.PreparedCorpus` is, so the streaming pipeline
    (:func:`jaxformer.data.streaming.stream_dataset`) batches either."""

    src: list[list[int]]
    tgt: list[list[int]]

    def __len__(self):
        return len(self.src)

    @functools.cached_property
    def src_lengths(self) -> np.ndarray:
        """``[N]`` int64: source ids per pair."""
        return np.array([len(s) for s in self.src], np.int64)

    @functools.cached_property
    def tgt_lengths(self) -> np.ndarray:
        """``[N]`` int64: target ids per pair (no bos/eos)."""
        return np.array([len(t) for t in self.tgt], np.int64)


def tokenize_pairs(pairs: Sequence[Pair], tokenizer: Tokenizer, max_len: int,
                   report: DataReport | None = None, max_ratio: float | None = None) -> Examples:
    """Encodes pairs; drops (and counts) those that do not fit ``max_len``.

    A pair fits when the source has at most ``max_len`` ids and the target plus one
    (bos for the decoder input, eos for the output) at most ``max_len``. With
    ``max_ratio``, a pair whose id counts differ by more than that factor is dropped
    first (Moses clean-corpus-n; the filter :mod:`jaxformer.data.prepare` applies).
    """
    src = tokenizer.encode_source([p[0] for p in pairs])
    tgt = tokenizer.encode_target([p[1] for p in pairs])
    keep_src, keep_tgt = [], []
    for s, t in zip(src, tgt):
        if max_ratio is not None and (len(s) > max_ratio * len(t) or len(t) > max_ratio * len(s)):
            reason = f"length ratio above {max_ratio:g}"
        elif len(s) > max_len or len(t) + 1 > max_len:
            reason = f"longer than {max_len} tokens"
        else:
            keep_src.append(s)
            keep_tgt.append(t)
            continue
        if report is not None:
            report.skip(reason)
    if report is not None:
        report.kept = len(keep_src)
    if not keep_src:
        raise ValueError(f"Every pair is longer than max_len={max_len} tokens; raise --max-len.")
    return Examples(keep_src, keep_tgt)


def bucket_boundaries(max_len: int, step: int = 16) -> tuple[int, ...]:
    """Padded lengths: multiples of ``step`` up to 64, then ×1.5 steps up to ``max_len``.

    Few buckets mean few compiles (each costs seconds on a CPU) at the price of
    some padding; ``max_len`` is always the last boundary.
    """
    bounds = [b for b in range(step, min(64, max_len) + 1, step)] or [max_len]
    while bounds[-1] < max_len:
        # at least one step more: ×1.5 rounded down to a step can stay put (32 → 48 → 32)
        bounds.append(min(max_len, max(bounds[-1] + step, int(bounds[-1] * 1.5) // step * step)))
    return tuple(bounds)


def rows_per_batch(batch_tokens: int, length: int, row_multiple: int = 1) -> int:
    """Rows of a batch of ``length``-token rows: ``batch_tokens // length``, rounded down to
    a multiple of ``row_multiple`` (at least one multiple). With the seed, these counts
    decide the whole batch plan: two settings that give the same counts give the same
    batches, whatever the device count."""
    return max(row_multiple, batch_tokens // length // row_multiple * row_multiple)


def check_batch_rows(batch_tokens: int, row_length: int, row_multiple: int) -> str | None:
    """Rows of a full-length batch: ``batch_tokens // row_length``, rounded down to a multiple
    of ``row_multiple`` (data axis × grad-accumulation steps × processes), as
    :func:`rows_per_batch` does. Too small a budget is an error; a rounded one returns a
    note to report, so the batch is never silently another size.

    Raises:
      ValueError: fewer rows than ``row_multiple``, naming the ``--batch-tokens`` that fits.
    """
    rows = batch_tokens // row_length
    if rows < row_multiple:
        raise ValueError(f"--batch-tokens {batch_tokens} gives {rows} row(s) of {row_length} tokens, but "
                         f"a batch needs a multiple of {row_multiple} rows (data axis × "
                         f"--grad-accum-steps × processes); use --batch-tokens "
                         f"{row_length * row_multiple} or more.")
    if rows % row_multiple:
        return (f"note: a batch of {row_length}-token rows has {rows // row_multiple * row_multiple} rows, "
                f"not {rows}: rounded down to a multiple of {row_multiple} (data axis × "
                f"--grad-accum-steps × processes)")
    return None


def _lengths(src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
    return np.maximum(src_len, tgt_len)


def bucket_plan(src_len: np.ndarray, tgt_len: np.ndarray, rng: np.random.Generator, *, batch_tokens: int,
                boundaries: Sequence[int], row_multiple: int = 1) -> list[tuple[int, np.ndarray]]:
    """Groups pairs into fixed-shape batches by padded length.

    ``src_len``/``tgt_len`` ``[N]`` are the source ids and the target ids + 1 of each pair
    (each at most ``boundaries[-1]``). Each pair goes to the smallest bucket ``L`` that
    holds both; a bucket's batches all have :func:`rows_per_batch` rows, so the step
    compiles once per bucket. A bucket's last batch is filled with index -1 (all-pad rows).

    Returns:
      a list of ``(L, indices [rows])`` (positions in the lengths), in a random order.
    """
    bucket_of = np.searchsorted(np.asarray(boundaries), _lengths(src_len, tgt_len))
    batches = []
    for b, length in enumerate(boundaries):
        members = np.flatnonzero(bucket_of == b)
        if members.size == 0:   # no draw: the plan of a saved position stays the same
            continue
        members = rng.permutation(members)
        rows = rows_per_batch(batch_tokens, length, row_multiple)
        for start in range(0, members.size, rows):
            chunk = members[start:start + rows]
            batches.append((int(length), np.concatenate([chunk, np.full(rows - chunk.size, -1)])))
    return [batches[i] for i in rng.permutation(len(batches))]


def pack_plan(src_len: np.ndarray, tgt_len: np.ndarray, rng: np.random.Generator, *, batch_tokens: int,
              length: int, row_multiple: int = 1) -> list[tuple[int, np.ndarray]]:
    """Packs several sentence pairs into each row of one shape (sequence packing).

    ``src_len``/``tgt_len`` ``[N]`` are the source ids and the target ids + 1 of each pair,
    each at most ``length`` (the callers keep only pairs that fit). Every row has
    ``length`` source and ``length`` target positions and holds whole pairs,
    concatenated on both sides (pair j of a row is segment j + 1, see
    :func:`collate_packed`). Rows are filled best-fit over a random order of the pairs
    sorted longest first, so only a few per cent of the positions stay padding and the
    train step compiles once; a batch has :func:`rows_per_batch` rows, the last filled
    with empty rows.

    Returns:
      a list of ``(length, indices [rows, P])`` in a random order: row r holds the pairs
      ``indices[r]`` that are ``>= 0``, in order (P = the most pairs of any row).
    """
    order = rng.permutation(len(src_len))
    order = order[np.argsort(-_lengths(src_len, tgt_len)[order], kind="stable")]
    # Open rows grouped by their free space (source, target): best fit = the fitting
    # group with the least free space left, found on a (length+1)² table.
    open_rows: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    count = np.zeros((length + 1, length + 1), np.int64)
    waste = np.add.outer(np.arange(length + 1), np.arange(length + 1))
    rows: list[list[int]] = []
    for i in order:
        need_s, need_t = int(src_len[i]), int(tgt_len[i])
        fits = count[need_s:, need_t:] > 0
        if fits.any():
            free_s, free_t = np.unravel_index(np.argmin(np.where(fits, waste[need_s:, need_t:], 1 << 30)),
                                              fits.shape)
            free_s, free_t = int(free_s) + need_s, int(free_t) + need_t
            row = open_rows[free_s, free_t].pop()
            count[free_s, free_t] -= 1
        else:
            free_s, free_t, row = length, length, len(rows)
            rows.append([])
        rows[row].append(int(i))
        free_s, free_t = free_s - need_s, free_t - need_t
        open_rows[free_s, free_t].append(row)
        count[free_s, free_t] += 1
    per_batch = rows_per_batch(batch_tokens, length, row_multiple)
    width = max((len(r) for r in rows), default=1)
    table = np.full((-(-len(rows) // per_batch) * per_batch, width), -1, np.int64)
    for r, members in enumerate(rng.permutation(len(rows))):
        table[r, : len(rows[members])] = rows[members]
    return [(length, table[start:start + per_batch]) for start in range(0, len(table), per_batch)]


def padding_fraction(corpus, batches: Sequence[tuple[int, np.ndarray]]) -> dict[str, float]:
    """Pad positions / processed positions of ``batches`` (bucketed or packed) of ``corpus``
    (:class:`Examples` or a prepared corpus), per side and both."""
    src_len, tgt_len = corpus.src_lengths, corpus.tgt_lengths + 1
    processed = sum(length * len(idx) for length, idx in batches)
    real_src = sum(int(src_len[idx[idx >= 0]].sum()) for _, idx in batches)
    real_tgt = sum(int(tgt_len[idx[idx >= 0]].sum()) for _, idx in batches)
    return {"src": 1 - real_src / processed, "tgt": 1 - real_tgt / processed,
            "both": 1 - (real_src + real_tgt) / (2 * processed)}


def collate_packed(examples: Examples, length: int, indices: np.ndarray, *, pad_id: int, bos_id: int,
                   eos_id: int) -> dict[str, np.ndarray]:
    """Builds one packed batch from :func:`pack_plan` rows of ``examples`` (:class:`Examples`
    or a prepared corpus: ``examples.src[i]`` the ids of pair ``i``).

    Returns:
      the :func:`collate` arrays plus ``src_segments`` / ``tgt_segments`` ``[rows, L]``
      int32: 1, 2, … for the pairs of a row in order (a pair's source and target have
      the same number), 0 on padding. The model builds its masks and positions from them.
    """
    rows = len(indices)
    out = {name: np.full((rows, length), pad_id, np.int32) for name in ("src", "tgt_in", "tgt_out")}
    out.update({name: np.zeros((rows, length), np.int32) for name in ("src_segments", "tgt_segments")})
    for r, members in enumerate(indices):
        at_s = at_t = 0
        for segment, i in enumerate(members[members >= 0], start=1):
            s, t = examples.src[i], examples.tgt[i]
            out["src"][r, at_s:at_s + len(s)] = s
            out["src_segments"][r, at_s:at_s + len(s)] = segment
            out["tgt_in"][r, at_t:at_t + len(t) + 1] = [bos_id, *t]
            out["tgt_out"][r, at_t:at_t + len(t) + 1] = [*t, eos_id]
            out["tgt_segments"][r, at_t:at_t + len(t) + 1] = segment
            at_s, at_t = at_s + len(s), at_t + len(t) + 1
    return out


def collate(examples: Examples, length: int, indices: np.ndarray, *, pad_id: int, bos_id: int,
            eos_id: int) -> dict[str, np.ndarray]:
    """Builds one padded batch; teacher forcing is explicit here.

    Returns:
      ``src [b, L]``, ``tgt_in [b, L]`` (bos y1 … yn), ``tgt_out [b, L]`` (y1 … yn eos),
      all int32; index -1 gives an all-pad row.
    """
    rows = len(indices)
    src = np.full((rows, length), pad_id, np.int32)
    tgt_in = np.full((rows, length), pad_id, np.int32)
    tgt_out = np.full((rows, length), pad_id, np.int32)
    for r, i in enumerate(indices):
        if i < 0:
            continue
        s, t = examples.src[i], examples.tgt[i]
        src[r, : len(s)] = s
        tgt_in[r, : len(t) + 1] = [bos_id, *t]
        tgt_out[r, : len(t) + 1] = [*t, eos_id]
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}
