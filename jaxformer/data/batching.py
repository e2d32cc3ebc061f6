"""Tokenized pairs to fixed-shape batches: length filters, batch plans (length buckets or
packed rows, planned on lengths alone) and collation. Teacher forcing is explicit here
(``tgt_in`` = bos y1 … yn, ``tgt_out`` = y1 … yn eos), never inside the decoder. The
streaming pipeline that runs the plans is :mod:`jaxformer.data.streaming`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxformer.data.corpus import DataReport, Pair
from jaxformer.data.tokenizer import TextTokenizer

Plan = list[tuple[int, np.ndarray]]   # batches as (row length, indices; -1 = empty)


@dataclasses.dataclass(frozen=True)
class Examples:
    """Tokenized pairs in memory (ragged id lists, no bos/eos) with int64 ``[N]`` ``src_lengths``
    / ``tgt_lengths``, as a :class:`jaxformer.data.prepared.PreparedCorpus`, so either is batched."""

    src: list[list[int]]
    tgt: list[list[int]]

    def __len__(self):
        return len(self.src)

    @functools.cached_property
    def src_lengths(self) -> np.ndarray:
        return np.array([len(s) for s in self.src], np.int64)

    @functools.cached_property
    def tgt_lengths(self) -> np.ndarray:
        return np.array([len(t) for t in self.tgt], np.int64)


def length_filter(src_len: np.ndarray, tgt_len: np.ndarray, max_src: int, max_tgt: int,
                  max_ratio: float | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """Which pairs to keep (bool ``[N]``) and the counts dropped by reason: first a length ratio
    above ``max_ratio`` either way (Moses ``clean-corpus-n``), then a source longer than
    ``max_src`` or a target longer than ``max_tgt`` ids."""
    src, tgt = np.asarray(src_len), np.asarray(tgt_len)
    ratio_bad = (np.zeros(src.shape, bool) if max_ratio is None else
                 (src > max_ratio * tgt) | (tgt > max_ratio * src))
    long_bad = ~ratio_bad & ((src > max_src) | (tgt > max_tgt))
    reasons = {} if max_ratio is None else {f"length ratio above {max_ratio:g}": int(ratio_bad.sum())}
    return ~(ratio_bad | long_bad), {**reasons, f"longer than {max_src} tokens": int(long_bad.sum())}


def kept_records(corpus: Any, max_len: int, max_ratio: float | None = None,
                 report: DataReport | None = None) -> tuple[np.ndarray, int]:
    """int64 ``[M]``: the records of ``corpus`` (:class:`Examples` or a prepared corpus) that fit
    ``max_len`` (source ids, target ids + 1) and ``max_ratio``; and the number dropped (by
    reason in ``report``). Raises ValueError: none fits."""
    keep, dropped = length_filter(corpus.src_lengths, corpus.tgt_lengths, max_len, max_len - 1, max_ratio)
    records = np.flatnonzero(keep)
    if report is not None:
        report.skipped.update({reason: n for reason, n in dropped.items() if n})
        report.kept = records.size
    if records.size == 0:
        raise ValueError(f"No pair fits max_len={max_len} tokens (dropped: {dropped}); raise --max-len or "
                         f"--max-train-len.")
    return records, int(len(keep) - records.size)


def tokenize_pairs(pairs: Sequence[Pair], tokenizer: TextTokenizer, max_len: int,
                   report: DataReport | None = None, max_ratio: float | None = None) -> Examples:
    """``pairs`` encoded, less those :func:`kept_records` drops (counted in ``report``). Raises
    ValueError: no pair fits."""
    examples = Examples(tokenizer.encode_source([p[0] for p in pairs]),
                        tokenizer.encode_target([p[1] for p in pairs]))
    records, _ = kept_records(examples, max_len, max_ratio, report)
    return Examples([examples.src[i] for i in records], [examples.tgt[i] for i in records])


def bucket_boundaries(max_len: int, step: int = 16) -> tuple[int, ...]:
    """Padded lengths: multiples of ``step`` up to 64, then ×1.5 steps, ``max_len`` last (few
    buckets: few compiles, some padding)."""
    bounds = [b for b in range(step, min(64, max_len) + 1, step)] or [max_len]
    while bounds[-1] < max_len:   # at least one step more: ×1.5 rounded down can stay put
        bounds.append(min(max_len, max(bounds[-1] + step, int(bounds[-1] * 1.5) // step * step)))
    return tuple(bounds)


def rows_per_batch(batch_tokens: int, length: int, row_multiple: int = 1) -> int:
    """Rows of a batch of ``length``-token rows: ``batch_tokens // length`` rounded down to a
    multiple of ``row_multiple`` (at least one multiple). With the seed, these counts decide
    the whole batch plan, whatever the device count."""
    return max(row_multiple, batch_tokens // length // row_multiple * row_multiple)


def check_batch_rows(batch_tokens: int, row_length: int, row_multiple: int) -> str | None:
    """Checks that a full-length batch has at least ``row_multiple`` rows (data axis ×
    grad-accumulation steps × processes); returns a note when :func:`rows_per_batch` rounds.
    Raises ValueError: fewer rows, naming the ``--batch-tokens`` that fits."""
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


def bucket_plan(src_len: np.ndarray, tgt_len: np.ndarray, rng: np.random.Generator, *, batch_tokens: int,
                boundaries: Sequence[int], row_multiple: int = 1) -> Plan:
    """Length buckets: ``[N]`` pairs of ``src_len`` source ids and ``tgt_len`` target ids + 1
    (≤ ``boundaries[-1]``), each in the smallest boundary ``L`` that holds it. Returns ``(L,
    indices [rows])`` batches (:func:`rows_per_batch` rows, -1 = empty) in a random order."""
    bucket_of = np.searchsorted(np.asarray(boundaries), np.maximum(src_len, tgt_len))
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
              length: int, row_multiple: int = 1) -> Plan:
    """Sequence packing: ``[N]`` pairs of ``src_len`` source ids and ``tgt_len`` target ids + 1
    (each ≤ ``length``) concatenated into rows of ``length`` positions a side, best-fit over
    a random order sorted longest first; :func:`rows_per_batch` rows a batch. Returns
    ``(length, indices [rows, P])`` batches in a random order, row r holding the pairs
    ``indices[r] >= 0`` (segments 1, 2, … of :func:`collate_packed`)."""
    order = rng.permutation(len(src_len))
    order = order[np.argsort(-np.maximum(src_len, tgt_len)[order], kind="stable")]
    # Open rows grouped by free space (source, target); best fit = the fitting group with the
    # least space left, found on a (length+1)² table.
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


def padding_fraction(corpus: Any, batches: Plan) -> dict[str, float]:
    """Pad positions / processed positions of a plan over ``corpus``, per side and both."""
    src_len, tgt_len = corpus.src_lengths, corpus.tgt_lengths + 1
    processed = sum(length * len(idx) for length, idx in batches)
    real_src = sum(int(src_len[idx[idx >= 0]].sum()) for _, idx in batches)
    real_tgt = sum(int(tgt_len[idx[idx >= 0]].sum()) for _, idx in batches)
    return {"src": 1 - real_src / processed, "tgt": 1 - real_tgt / processed,
            "both": 1 - (real_src + real_tgt) / (2 * processed)}


def collate_packed(examples: Any, length: int, indices: np.ndarray, *, pad_id: int, bos_id: int,
                   eos_id: int) -> dict[str, np.ndarray]:
    """One packed batch of :func:`pack_plan` rows ``indices [rows, P]`` of ``examples``:
    :func:`collate`'s arrays plus int32 ``[rows, L]`` ``src_segments`` / ``tgt_segments``, 1,
    2, … for the pairs of a row (both sides alike), 0 on padding."""
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


def collate(examples: Any, length: int, indices: np.ndarray, *, pad_id: int, bos_id: int,
            eos_id: int) -> dict[str, np.ndarray]:
    """One padded batch, a pair a row (index -1: an all-pad row): int32 ``[rows, L]`` ``src``,
    ``tgt_in`` (bos y1 … yn) and ``tgt_out`` (y1 … yn eos)."""
    batch = collate_packed(examples, length, np.asarray(indices)[:, None], pad_id=pad_id, bos_id=bos_id,
                           eos_id=eos_id)
    return {name: batch[name] for name in ("src", "tgt_in", "tgt_out")}
