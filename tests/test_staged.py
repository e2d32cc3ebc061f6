"""Staged beam search (:mod:`jaxformer.decode.staged`) against ``decode``'s one-loop ``Beam``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import decoding
from jaxformer.decode.staged import StagedBeamSearch
from jaxformer.decode.strategies import Beam, Greedy

BOS, M = 1, 24


@pytest.fixture(scope="module")
def model_params_src():
    """A random tiny model, 8 sources of 3-12 tokens, and an eos id the model does produce
    (the token that greedy decoding without eos emits first at the most different steps),
    so the sentences end at different steps."""
    config = jf.TransformerConfig(src_vocab_size=40, tgt_vocab_size=40, d_model=32, num_heads=4, d_ff=64,
                                  num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0,
                                  max_len=48, norm_position="post")
    model = jf.Transformer(config)
    rng = np.random.default_rng(0)
    src = np.zeros((8, 12), np.int32)
    for row, length in enumerate(rng.permutation(np.arange(3, 13))[:8]):
        src[row, :length] = rng.integers(4, 40, length)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(src), jnp.asarray(src))["params"]
    greedy = np.asarray(decoding.decode(model, params, jnp.asarray(src), Greedy(), max_decode_len=M,
                                        bos_id=BOS, eos_id=99)[0][:, 0])
    first_steps = {t: {int(np.argmax(row == t)) for row in greedy if t in row} for t in range(4, 40)}
    eos = max(first_steps, key=lambda t: len(first_steps[t]))
    return model, params, src, eos


@pytest.mark.parametrize("rule", [dict(extra_len=10),
                                  dict(early_stopping=True, length_normalization="hf", extra_len=None)])
def test_staged_beam_search_equals_decode(model_params_src, rule):
    model, params, src, eos = model_params_src
    extra_len = rule.pop("extra_len")
    beam = Beam(beam_size=3, alpha=0.6, **rule)
    staged = StagedBeamSearch(model, beam, bos_id=BOS, eos_id=eos, extra_len=extra_len, first_length=4)
    seqs, scores = staged(params, src, M)
    expected_seqs, expected_scores = jax.device_get(decoding.decode(
        model, params, jnp.asarray(src), beam, max_decode_len=M, bos_id=BOS, eos_id=eos, extra_len=extra_len))
    np.testing.assert_array_equal(seqs, expected_seqs)
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)
    rows = [r for r, _, _ in staged.stages]
    lengths = [n for _, n, _ in staged.stages]
    assert lengths[0] == 4 and lengths[-1] > 4, staged.stages   # the cache grew
    assert rows[0] == 8 and rows == sorted(rows, reverse=True), staged.stages
    assert rows[-1] < 8, staged.stages   # closed sentences left the batch
