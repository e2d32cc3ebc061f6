"""Sequence packing (issue #7, padding waste): packed batches."""

import numpy as np
import pytest

from jaxformer import data

# Source / target id lists of distinct lengths (target + 1 for bos/eos).
EXAMPLES = data.Examples(src=[[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15]],
                         tgt=[[20, 21], [22, 23, 24, 25], [26, 27, 28], [29]])


def test_pack_batches_covers_every_example_once_with_fixed_shapes():
    rng = np.random.default_rng(0)
    examples = data.Examples(src=[list(range(4, 4 + n)) for n in rng.integers(1, 16, 300)],
                             tgt=[list(range(4, 4 + n)) for n in rng.integers(1, 16, 300)])
    batches = data.pack_batches(examples, batch_tokens=128, length=16, seed=0, row_multiple=4)
    assert {(length, idx.shape[0]) for length, idx in batches} == {(16, 8)}
    seen = np.concatenate([idx.ravel() for _, idx in batches])
    assert sorted(seen[seen >= 0].tolist()) == list(range(len(examples)))
    src_len, tgt_len = data.example_lengths(examples)
    for _, idx in batches:
        for row in idx:
            members = row[row >= 0]
            assert src_len[members].sum() <= 16 and tgt_len[members].sum() <= 16
    again = data.pack_batches(examples, batch_tokens=128, length=16, seed=0, row_multiple=4)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(batches, again))
    packed = data.padding_fraction(examples, batches)["both"]
    bucketed = data.padding_fraction(examples, data.bucket_batches(examples, 128, (8, 16), seed=0))["both"]
    assert packed < bucketed


def test_pack_batches_rejects_examples_longer_than_the_row():
    with pytest.raises(ValueError, match="length=2"):
        data.pack_batches(EXAMPLES, batch_tokens=8, length=2, seed=0)


def test_collate_packed_concatenates_pairs_with_segment_ids():
    batch = data.collate_packed(EXAMPLES, 8, np.array([[0, 2, -1], [-1, -1, -1]]),
                                pad_id=0, bos_id=2, eos_id=3)
    np.testing.assert_array_equal(batch["src"][0], [5, 6, 7, 13, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["src_segments"][0], [1, 1, 1, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["tgt_in"][0], [2, 20, 21, 2, 26, 27, 28, 0])
    np.testing.assert_array_equal(batch["tgt_out"][0], [20, 21, 3, 26, 27, 28, 3, 0])
    np.testing.assert_array_equal(batch["tgt_segments"][0], [1, 1, 1, 2, 2, 2, 2, 0])
    assert not batch["src"][1].any() and not batch["tgt_segments"][1].any()
