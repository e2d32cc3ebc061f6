"""Greedy, beam search and sampling against stubs with known answers, and the model; a
strategy defined here decodes through the same ``decode``."""

import dataclasses
import itertools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer as jf
from jaxformer.decode import decoding
from jaxformer.decode.beam_search import blocked_top_k, gather_beams
from jaxformer.decode.strategies import Beam, Greedy, Sample, autoregress, first_argmax, strategy_for

PAD, BOS, EOS = 0, 1, 2
VOCAB = 5          # pad, bos, eos and two real tokens 3, 4


def _stub(table):
    """tokens_to_logits whose log-probs depend on (step, previous token) only."""
    table = jnp.asarray(table, jnp.float32)        # [M, V(prev), V(next)]

    def tokens_to_logits(ids_B1, cache):
        logits = table[cache["index"], ids_B1[:, 0]]
        return logits, {"index": cache["index"] + 1}

    return tokens_to_logits


def _random_table(seed, max_len):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(max_len, VOCAB, VOCAB)) * 2.0
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits)), np.float64)


def _exhaustive(table, max_len, alpha, cut=False):
    """Every hypothesis ending in eos within max_len (``cut``: and every one of max_len tokens
    without eos), scored like the beam search."""
    hyps = []
    for n in range(1, max_len + 1):
        ends = ((3,), (4,), (EOS,)) if cut and n == max_len else ((EOS,),)
        for body, end in itertools.product(itertools.product((3, 4), repeat=n - 1), ends):
            seq, prev, logp = (*body, *end), BOS, 0.0
            for t, tok in enumerate(seq):
                logp += table[t, prev, tok]
                prev = tok
            hyps.append((logp / ((5 + n) / 6) ** alpha, seq))
    return sorted(hyps, reverse=True)


@pytest.mark.parametrize("forced_eos", [True, False], ids=["forced_eos", "cut"])
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_search_equals_exhaustive_search(seed, alpha, forced_eos):
    # At most 4 live prefixes × 3 tokens = 12 candidates per step: with k = 12 every
    # candidate is within the top k, so the beam search is exhaustive. At the limit (4 tokens)
    # eos is forced, or (cut) the 12 best of 8 × 3 extensions end there, and those all share
    # one length penalty: the best k overall are among them.
    max_len, k = 4, 12
    table = _random_table(seed, max_len)
    seqs, scores = jax.jit(lambda: Beam(k, alpha, forced_eos=forced_eos).search(
        _stub(table), {"index": jnp.zeros((), jnp.int32)}, batch_size=1, bos_id=BOS, eos_id=EOS, pad_id=PAD,
        max_decode_len=max_len))()
    expected = _exhaustive(table, max_len, alpha, cut=not forced_eos)[:k]
    for rank, (score, seq) in enumerate(expected):
        got = [int(t) for t in np.asarray(seqs[0, rank]) if t != PAD]
        assert tuple(got) == seq, (rank, got, seq)
        np.testing.assert_allclose(float(scores[0, rank]), score, rtol=1e-5)


def test_beam_size_one_equals_greedy():
    for seed in range(5):
        table = _random_table(seed, 6)
        cache = {"index": jnp.zeros((), jnp.int32)}
        loop = dict(batch_size=1, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_decode_len=6)
        greedy, _ = Greedy().search(_stub(table), cache, **loop)
        beam, _ = Beam(1, 0.0).search(_stub(table), cache, **loop)
        np.testing.assert_array_equal(np.asarray(beam), np.asarray(greedy))


def test_length_penalty_lets_a_longer_hypothesis_beat_an_early_eos():
    # Step 0: eos 0.4, token 3 0.6. Step 1 after token 3: eos 0.638.
    # log 0.4 = -0.916 beats log 0.6 + log 0.638 = -0.960 without a penalty, but
    # with α = 0.6: -0.960 / ((5+2)/6)^0.6 = -0.875 > -0.916 / 1.
    eps = 1e-6
    table = np.full((3, VOCAB, VOCAB), np.log(eps))
    table[0, BOS, [EOS, 3]] = np.log([0.4, 0.6])
    table[1, 3, [EOS, 4]] = np.log([0.638, 0.362])
    table[2, :, EOS] = 0.0
    cache = {"index": jnp.zeros((), jnp.int32)}
    run = lambda alpha: Beam(2, alpha).search(  # noqa: E731
        _stub(table), cache, batch_size=1, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_decode_len=3)[0][0, 0]
    assert [int(t) for t in run(0.0)] == [EOS, PAD, PAD]
    assert [int(t) for t in run(0.6)] == [3, EOS, PAD]


def test_early_stopping_closes_a_sentence_at_k_finished_hypotheses():
    # Beam 2, α = 0. Step 0: eos 0.3 (finished, log 0.3), token 3 0.5, token 4 0.2. Step 1:
    # 4 → eos 0.9 finishes log 0.18: two finished, so early stopping closes the sentence
    # with [eos]; the exact rule sees the live 3 4 (log 0.49) still able to win, and it
    # does at step 2.
    eps = 1e-6
    table = np.full((3, VOCAB, VOCAB), np.log(eps))
    table[0, BOS, [EOS, 3, 4]] = np.log([0.3, 0.5, 0.2])
    table[1, 3, [EOS, 4]] = np.log([0.02, 0.98])
    table[1, 4, [EOS, 3]] = np.log([0.9, 0.1])
    table[2, :, EOS] = 0.0
    cache = {"index": jnp.zeros((), jnp.int32)}
    run = lambda early: Beam(2, 0.0, early_stopping=early).search(  # noqa: E731
        _stub(table), cache, batch_size=1, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_decode_len=3)
    early, exact = run(True), run(False)
    assert [int(t) for t in early[0][0, 0]] == [EOS, PAD, PAD]
    assert [int(t) for t in early[0][0, 1]] == [4, EOS, PAD]
    assert [int(t) for t in exact[0][0, 0]] == [3, 4, EOS]
    np.testing.assert_allclose(float(exact[1][0, 0]), np.log(0.49), rtol=1e-4)   # eps mass aside


@pytest.mark.parametrize("forced_eos", [True, False], ids=["forced_eos", "cut"])
def test_per_sentence_length_limit_ends_each_sentence(forced_eos):
    table = np.zeros((8, VOCAB, VOCAB))
    table[:, :, EOS] = -20.0                 # eos is very unlikely
    seqs, _ = Beam(2, forced_eos=forced_eos).search(
        _stub(table), {"index": jnp.zeros((), jnp.int32)}, batch_size=2, bos_id=BOS, eos_id=EOS, pad_id=PAD,
        max_decode_len=8, max_lengths=jnp.array([3, 8]))
    lengths = np.sum(np.asarray(seqs[:, :]) != PAD, axis=2)
    np.testing.assert_array_equal(lengths, [[3, 3], [8, 8]])
    assert np.all((np.asarray(seqs[0, :, 2]) == EOS) == forced_eos)
    assert np.all((np.asarray(seqs[1, :, 7]) == EOS) == forced_eos)


def test_sampling_is_reproducible_and_cold_sampling_is_greedy():
    table = _random_table(3, 6)
    cache = {"index": jnp.zeros((), jnp.int32)}
    kwargs = dict(batch_size=16, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_decode_len=6)
    stub = _stub(table)

    def sample(seed, **settings):
        keys_B = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.arange(16))
        return np.asarray(Sample(**settings).search(stub, cache, keys_B=keys_B, **kwargs)[0][:, 0])

    a, b, c = sample(0), sample(0), sample(1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    greedy = np.asarray(Greedy().search(stub, cache, **kwargs)[0][:, 0])
    with pytest.raises(ValueError, match="temperature must be greater than 0"):   # Greedy() is that
        Sample(temperature=0.0)
    np.testing.assert_array_equal(sample(5, temperature=1e-4), greedy)
    np.testing.assert_array_equal(sample(5, temperature=1e-38), greedy)   # no float32 overflow
    # top_k=1 and a tiny top_p are greedy too.
    for extra in (dict(top_k=1), dict(top_p=1e-6)):
        np.testing.assert_array_equal(sample(9, **extra), greedy)
    with pytest.raises(ValueError, match="top_p"):
        Sample(top_p=1.5)


@pytest.fixture(scope="module")
def tiny_model():
    config = jf.preset("tiny", src_vocab_size=23, max_len=24, pad_id=PAD)
    model = jf.Transformer(config)
    params = model.init(jax.random.key(3), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))
    return model, nn.unbox(params["params"])


def test_cached_decoding_matches_the_full_forward_pass(tiny_model):
    model, params = tiny_model
    src = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    tgt = jnp.array([[BOS, 4, 6, 8, 10, 12, 14], [BOS, 5, 7, 9, 11, 13, 15]])
    full = model.apply({"params": params}, src, tgt)
    tokens_to_logits, cache = decoding._model_callback(model, params, src, tgt.shape[1])
    for t in range(tgt.shape[1]):
        logits, cache = tokens_to_logits(tgt[:, t:t + 1], cache)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, t]), atol=1e-5, rtol=1e-5)


def test_a_sentence_decodes_the_same_alone_in_a_batch_and_padded(tiny_model):
    model, params = tiny_model
    sentence = [5, 6, 7, 8]
    alone = jnp.array([sentence])
    batch = jnp.array([[9, 10, 11, 12, 13, 14, 0, 0], sentence + [0] * 4, [15, 16, 0, 0, 0, 0, 0, 0]])
    kw = dict(max_decode_len=10, bos_id=BOS, eos_id=EOS)
    g_alone = decoding.decode(model, params, alone, Greedy(), **kw)[0]
    g_batch = decoding.decode(model, params, batch, Greedy(), **kw)[0]
    np.testing.assert_array_equal(np.asarray(g_alone[0]), np.asarray(g_batch[1]))
    b_alone, s_alone = decoding.decode(model, params, alone, Beam(3), extra_len=50, **kw)
    b_batch, s_batch = decoding.decode(model, params, batch, Beam(3), extra_len=50, **kw)
    np.testing.assert_array_equal(np.asarray(b_alone[0]), np.asarray(b_batch[1]))
    np.testing.assert_allclose(np.asarray(s_alone[0]), np.asarray(s_batch[1]), rtol=1e-5)


def test_decode_loop_compiles_once_per_shape(tiny_model):
    model, params = tiny_model
    jax.clear_caches()
    kw = dict(max_decode_len=6, bos_id=BOS, eos_id=EOS)
    for src in ([[5, 6, 7]], [[8, 9, 10]], [[5, 6, 7, 8, 9]], [[1 + 4, 6, 7, 8, 9]]):
        decoding.decode(model, params, jnp.array(src), Greedy(), **kw)
    assert decoding._decode_jit._cache_size() == 2


def test_a_sampled_sentence_is_the_same_alone_and_in_a_batch(tiny_model):
    """Its key is folded from the seed and its index in the input, not from its batch."""
    model, params = tiny_model
    sources = [[9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 0, 0], [15, 16, 0, 0, 0, 0], [17, 18, 19, 0, 0, 0]]
    kw = dict(max_decode_len=10, bos_id=BOS, eos_id=EOS, rng=jax.random.key(7))
    batch = np.asarray(decoding.decode(model, params, jnp.array(sources), Sample(temperature=2.0), **kw)[0])
    for i in range(4):
        alone = decoding.decode(model, params, jnp.array(sources[i:i + 1]), Sample(temperature=2.0),
                                indices_B=jnp.array([i]), **kw)[0]
        np.testing.assert_array_equal(np.asarray(alone)[0], batch[i])
    assert len({tuple(row[0]) for row in batch}) > 1


class _Digits:
    """A tokenizer stub: a sentence of digits is its ids (+ 5), and back."""

    bos_id, eos_id = BOS, EOS

    def encode_source(self, texts):
        return [[int(c) + 5 for c in text] + [EOS] for text in texts]

    def decode(self, ids):
        return [" ".join(str(int(t)) for t in row if t != PAD) for row in ids]


def test_a_seed_samples_each_line_the_same_whatever_the_batch_or_input_path(tiny_model):
    """The Evaluator (the Translator's and bulk mode's decoding) with sentence indices: the
    whole input at once, one line at a time (a pipe), or in other batches, the same samples."""
    from jaxformer.decode.evaluation import Evaluator

    model, params = tiny_model
    lines = ["1234", "56", "789012", "3", "45678"]
    evaluator = Evaluator(model, _Digits(), batch_size=4, target_language="de", scoring=False)
    sample = Sample(temperature=2.0)
    rng = jax.random.key(11)
    whole = evaluator.decode(params, lines, sample, rng=rng)
    one_by_one = [evaluator.decode(params, [line], sample, rng=rng, indices=[i])[0]
                  for i, line in enumerate(lines)]
    reversed_ = evaluator.decode(params, lines[::-1], sample, rng=rng, indices=range(4, -1, -1))[::-1]
    assert whole == one_by_one == reversed_
    assert len({best[0][0] for best in whole}) > 1


@dataclasses.dataclass(frozen=True)
class Argmin:
    """A strategy in one class: the least likely token, never pad or bos."""

    beams: ClassVar[int] = 1

    def search(self, tokens_to_logits, cache, *, keys_B=None, **loop):
        def pick(logits_BV, step, out_BM, at_limit_B):
            never = jnp.isin(jnp.arange(logits_BV.shape[-1]), jnp.array([loop["pad_id"], loop["bos_id"]]))
            return jnp.argmin(jnp.where(never, jnp.inf, logits_BV), axis=-1).astype(jnp.int32)

        return autoregress(tokens_to_logits, cache, pick, **loop)


def test_a_strategy_defined_here_decodes_through_decode(tiny_model):
    model, params = tiny_model
    src = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    seqs, scores = decoding.decode(model, params, src, Argmin(), max_decode_len=7, bos_id=BOS, eos_id=EOS)
    assert seqs.shape == (2, 1, 7) and scores.shape == (2, 1)
    tokens_to_logits, cache = decoding._model_callback(model, params, src, 7)
    ids, done = jnp.full((2, 1), BOS), np.zeros(2, bool)
    for t in range(7):   # the same as picking the least likely token by hand; pad after eos
        logits, cache = tokens_to_logits(ids, cache)
        ids = jnp.argmin(logits.at[:, :2].set(jnp.inf), axis=-1)[:, None]
        np.testing.assert_array_equal(np.asarray(seqs[:, 0, t]), np.where(done, PAD, np.asarray(ids[:, 0])))
        done |= np.asarray(ids[:, 0]) == EOS


def test_strategies_check_their_settings_when_made():
    for make, words in ((lambda: Beam(beam_size=0), "beam_size must be at least 1"),
                        (lambda: Beam(beam_size=2.0), r"beam_size must be an integer, got 2.0 \(float\)"),
                        (lambda: Beam(early_stopping="no"), "early_stopping must be True or False"),
                        (lambda: Beam(length_normalization="fairseq"), "length_normalization must be"),
                        (lambda: Beam(forced_eos=None), "forced_eos must be True or False"),
                        (lambda: Sample(temperature=float("nan")), "temperature must be a finite number"),
                        (lambda: Sample(top_k=2.5), "top_k must be an integer"),
                        (lambda: Sample(top_p=True), "top_p must be a finite number, got True")):
        with pytest.raises(ValueError, match=words):
            make()
    assert Beam(4, np.float32(0.5), early_stopping=np.bool_(True)) == Beam(4, 0.5, early_stopping=True)


def test_strategy_for_keeps_our_runs_rule_unless_the_model_states_one():
    """No rule (our runs): eos at the limit for beams, for greedy only with "hf" (OPUS-MT's
    forced_eos_token_id); an imported model's rule (decode.defaults.forced_eos) for both."""
    assert strategy_for(4) == Beam(4) and Beam(4).forced_eos
    assert strategy_for(1) == Greedy(False) and strategy_for(1, 1.0, "hf") == Greedy(True)
    for rule in (False, True):
        assert strategy_for(4, 1.0, "hf", forced_eos=rule) == Beam(4, 1.0, "hf", forced_eos=rule)
        assert strategy_for(1, 1.0, "hf", forced_eos=rule) == Greedy(rule)
    assert strategy_for(1, scored=True) == Beam(1)   # n-best lists: beam 1 scores its hypothesis


def test_beam_search_reorders_the_cache_like_recomputing_the_prefix(tiny_model):
    """The K/V cache reordered per step (self-attention K/V only; the source side is
    shared by a sentence's beams) gives the beams of a decoder re-run on each prefix."""
    model, params = tiny_model
    src = jnp.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14], [15, 16, 17, 0, 0, 0]])
    kw = dict(batch_size=3, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_decode_len=9)
    cached = Beam(4).search(*decoding._model_callback(model, params, src, 9, 4), **kw)
    prefix = Beam(4).search(*decoding.uncached_model_callback(model, params, src, 9, 4), **kw)
    np.testing.assert_array_equal(np.asarray(cached[0]), np.asarray(prefix[0]))
    np.testing.assert_allclose(np.asarray(cached[1]), np.asarray(prefix[1]), rtol=1e-5)

    _, cache = decoding._model_callback(model, params, src, 9, 4)
    cache = cache.map_beam_state(lambda x: jax.random.normal(jax.random.key(0), x.shape))   # not zeros
    order = jnp.array([[3, 0, 0, 1]] * 3)
    moved = gather_beams(cache, order, 3)
    assert moved.layers[0].cross_k is cache.layers[0].cross_k      # not copied
    rows = (np.arange(3)[:, None] * 4 + np.asarray(order)).reshape(-1)
    np.testing.assert_array_equal(np.asarray(moved.layers[1].self_v),
                                  np.asarray(cache.layers[1].self_v)[rows])


def test_first_argmax_equals_argmax_ties_included():
    logits = jax.random.normal(jax.random.key(0), (6, 50))
    logits = logits.at[1, [7, 30]].set(9.0).at[2, :].set(0.0).at[3, 49].set(jnp.inf)
    np.testing.assert_array_equal(np.asarray(first_argmax(logits)),
                                  np.asarray(jnp.argmax(logits, axis=-1)))
    assert int(first_argmax(logits)[1]) == 7        # the first of a tie
    nan_row = first_argmax(logits.at[0, 5].set(jnp.nan))
    assert 0 <= int(nan_row[0]) < 50                           # a valid id, never out of range
    assert first_argmax(logits[1]).shape == ()        # any rank, like argmax
    np.testing.assert_array_equal(np.asarray(first_argmax(logits.reshape(2, 3, 50))),
                                  np.asarray(jnp.argmax(logits, axis=-1)).reshape(2, 3))


@pytest.mark.parametrize("length", [4096, 4000, 300])
def test_blocked_top_k_equals_lax_top_k_ties_and_inf_included(length):
    rng = np.random.default_rng(length)
    for high in (3, 50, 10_000):                 # few distinct values: ties everywhere
        x = jnp.asarray(rng.integers(0, high, (6, length)).astype(np.float32))
        x = x.at[0, :].set(-jnp.inf).at[1, : length // 2].set(-1e9).at[2, 7].set(jnp.inf)
        for k in (1, 8):
            expected = jax.lax.top_k(x, k)
            got = blocked_top_k(x, k)
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(expected[0]))
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(expected[1]))
