"""Sequence packing (issue #7, padding waste): segment masks and positions, packed batches.

The one property that matters: a packed row gives every sentence pair exactly the
logits, loss and gradients it gets alone.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.data import batching, streaming
from jaxformer.model.masks import create_segment_mask, segment_positions
from jaxformer.train.step import _batch_loss

# Source / target id lists of distinct lengths (target + 1 for bos/eos).
EXAMPLES = batching.Examples(src=[[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15]],
                         tgt=[[20, 21], [22, 23, 24, 25], [26, 27, 28], [29]])


def test_segment_positions_and_mask_literals():
    segments = jnp.array([[1, 1, 1, 2, 2, 0], [1, 2, 2, 2, 0, 0]])
    np.testing.assert_array_equal(segment_positions(segments), [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 0, 1]])
    mask = create_segment_mask(jnp.array([[1, 1, 2]]), jnp.array([[1, 2]]))
    assert mask.shape == (1, 1, 3, 2)
    np.testing.assert_array_equal(mask[0, 0], [[1, 0], [1, 0], [0, 1]])


def test_pack_batches_covers_every_example_once_with_fixed_shapes():
    rng = np.random.default_rng(0)
    examples = batching.Examples(src=[list(range(4, 4 + n)) for n in rng.integers(1, 16, 300)],
                             tgt=[list(range(4, 4 + n)) for n in rng.integers(1, 16, 300)])
    src_len, tgt_len = examples.src_lengths, examples.tgt_lengths + 1
    plan = functools.partial(batching.pack_plan, src_len, tgt_len, batch_tokens=128, length=16,
                             row_multiple=4)
    batches = plan(np.random.default_rng(0))
    assert {(length, idx.shape[0]) for length, idx in batches} == {(16, 8)}
    seen = np.concatenate([idx.ravel() for _, idx in batches])
    assert sorted(seen[seen >= 0].tolist()) == list(range(len(examples)))
    for _, idx in batches:
        for row in idx:
            members = row[row >= 0]
            assert src_len[members].sum() <= 16 and tgt_len[members].sum() <= 16
    again = plan(np.random.default_rng(0))
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(batches, again))
    packed = batching.padding_fraction(examples, batches)["both"]
    bucketed_batches = batching.bucket_plan(src_len, tgt_len, np.random.default_rng(0), batch_tokens=128,
                                            boundaries=(8, 16))
    bucketed = batching.padding_fraction(examples, bucketed_batches)["both"]
    assert packed < bucketed


def test_collate_packed_concatenates_pairs_with_segment_ids():
    batch = batching.collate_packed(EXAMPLES, 8, np.array([[0, 2, -1], [-1, -1, -1]]),
                                pad_id=0, bos_id=2, eos_id=3)
    np.testing.assert_array_equal(batch["src"][0], [5, 6, 7, 13, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["src_segments"][0], [1, 1, 1, 2, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["tgt_in"][0], [2, 20, 21, 2, 26, 27, 28, 0])
    np.testing.assert_array_equal(batch["tgt_out"][0], [20, 21, 3, 26, 27, 28, 3, 0])
    np.testing.assert_array_equal(batch["tgt_segments"][0], [1, 1, 1, 2, 2, 2, 2, 0])
    assert not batch["src"][1].any() and not batch["tgt_segments"][1].any()


def _model(norm_position):
    config = jf.preset("tiny", src_vocab_size=40, norm_position=norm_position, max_len=16)
    model = jf.Transformer(config)
    params = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))["params"]
    return model, params


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_packed_logits_equal_each_pair_alone(norm_position):
    model, params = _model(norm_position)
    rows = np.array([[0, 1, 3], [2, -1, -1]])
    packed = batching.collate_packed(EXAMPLES, 12, rows, pad_id=0, bos_id=2, eos_id=3)
    logits = model.apply({"params": params}, packed["src"], packed["tgt_in"],
                         src_segments=packed["src_segments"], tgt_segments=packed["tgt_segments"])
    for r, members in enumerate(rows):
        at = 0
        for i in members[members >= 0]:
            alone = batching.collate(EXAMPLES, 6, np.array([i]), pad_id=0, bos_id=2, eos_id=3)
            want = model.apply({"params": params}, alone["src"], alone["tgt_in"])
            n = len(EXAMPLES.tgt[i]) + 1
            np.testing.assert_allclose(logits[r, at:at + n], want[0, :n], atol=2e-5, rtol=2e-5)
            at += n


def test_packed_loss_and_gradients_equal_the_bucketed_batch():
    model, params = _model("post")
    packed = batching.collate_packed(EXAMPLES, 12, np.array([[0, 1, 3], [2, -1, -1]]),
                                 pad_id=0, bos_id=2, eos_id=3)
    bucketed = batching.collate(EXAMPLES, 6, np.arange(4), pad_id=0, bos_id=2, eos_id=3)
    loss = functools.partial(_batch_loss, rng=jax.random.key(0), model=model, smoothing=0.1,
                             deterministic=True)
    (packed_loss, packed_metrics), packed_grads = jax.value_and_grad(loss, has_aux=True)(params, packed)
    (loss_b, metrics_b), grads_b = jax.value_and_grad(loss, has_aux=True)(params, bucketed)
    assert float(packed_metrics["tokens"]) == float(metrics_b["tokens"]) == 14.0
    np.testing.assert_allclose(packed_loss, loss_b, rtol=1e-5)
    jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, atol=1e-5, rtol=1e-4),
                           packed_grads, grads_b)


def test_decode_needs_both_segment_arrays():
    model, params = _model("post")
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="both src_segments and tgt_segments"):
        model.apply({"params": params}, ids, ids, src_segments=ids)


def test_packed_train_dataset_compiles_the_train_step_once():
    from jaxformer.train.optimizer import make_optimizer, transformer_schedule
    from jaxformer.train.step import create_train_state, jit_train_step

    rng = np.random.default_rng(1)
    examples = batching.Examples(src=[list(rng.integers(4, 40, n)) for n in rng.integers(1, 12, 120)],
                             tgt=[list(rng.integers(4, 40, n)) for n in rng.integers(1, 12, 120)])
    model, _ = _model("pre")
    state = create_train_state(model, jax.random.key(0), make_optimizer(transformer_schedule(32, 10)))
    step = jit_train_step(model, 0.1)
    it = streaming.BatchStream(lambda start: streaming.stream_dataset(
        examples, max_len=16, batch_tokens=64, boundaries=(8, 16), seed=0, pad_id=0, bos_id=2, eos_id=3,
        pack=True, start=start))
    per_epoch = len(batching.pack_plan(examples.src_lengths, examples.tgt_lengths + 1,
                                       np.random.default_rng(0), batch_tokens=64, length=16))
    for _ in range(per_epoch + 2):
        state, metrics = step(state, next(it), jax.random.key(1))
    assert step._cache_size() == 1
    assert np.isfinite(float(metrics["loss_sum"]))
