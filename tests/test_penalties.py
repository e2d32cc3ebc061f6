"""Repetition penalties (--no-repeat-ngram-size, --repetition-penalty) against stubs whose
right answer is known: hand-computed masks and greedy paths, and beam search equal to an
exhaustive search under the same rules."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.decode.evaluation import repeats_ngram
from jaxformer.decode.penalties import NoRepeatNGram, RepetitionPenalty, banned_ngram_mask, penalties
from jaxformer.decode.strategies import Beam, Greedy, Sample

PAD, BOS, EOS = 0, 1, 2

# A Markov chain over pad, bos, eos, 3, 4, 5: P(next | previous), the same at every step.
MARKOV = np.full((6, 6), 1e-9)
MARKOV[BOS, [3, 4, 5, EOS]] = [0.5, 0.3, 0.1, 0.1]
MARKOV[3, [3, 4, EOS, 5]] = [0.6, 0.2, 0.1, 0.1]
MARKOV[4, [3, EOS, 5, 4]] = [0.5, 0.3, 0.1, 0.1]
MARKOV[5, [EOS, 3, 4, 5]] = [0.7, 0.1, 0.1, 0.1]
LOG_MARKOV = np.log(MARKOV / MARKOV.sum(1, keepdims=True))


def _markov(ids_B1, cache):
    return jnp.asarray(LOG_MARKOV, jnp.float32)[ids_B1[:, 0]], cache


def _tokens(row):
    return [int(t) for t in np.asarray(row) if t != PAD]


def test_banned_ngram_mask_by_hand():
    seqs = jnp.array([[3, 4, 3, 0, 0],      # bigram (3, 4) seen: after a final 3, 4 is banned
                      [5, 5, 0, 0, 0],      # bigram (5, 5) seen: 5 banned after 5
                      [3, 4, 5, 0, 0]])     # final 5 never started a bigram: nothing banned
    banned = np.asarray(banned_ngram_mask(seqs, jnp.int32(3 - 0), 2, 6))
    assert banned[0].nonzero()[0].tolist() == [4]
    banned = np.asarray(banned_ngram_mask(seqs, jnp.int32(2), 2, 6))
    assert banned[1].nonzero()[0].tolist() == [5]
    assert not banned[0].any() and not banned[2].any()   # (3, 4) then 4: no earlier bigram starts with 4
    unigrams = np.asarray(banned_ngram_mask(seqs, jnp.int32(2), 1, 6))
    assert [r.nonzero()[0].tolist() for r in unigrams] == [[3, 4], [5], [3, 4]]
    # Positions at and after `step` are ignored; a step before n-1 tokens bans nothing.
    assert not np.asarray(banned_ngram_mask(seqs, jnp.int32(1), 2, 6)).any()
    trigram = np.asarray(banned_ngram_mask(jnp.array([[3, 4, 5, 3, 4, 0]]), jnp.int32(5), 3, 6))
    assert trigram[0].nonzero()[0].tolist() == [5]


def test_repetition_penalty_by_hand():
    scores = jnp.array([[2.0, -1.0, 4.0, -3.0]])
    seqs = jnp.array([[0, 1, 3, 2]])            # only positions < step = 3 count: 0, 1, 3
    out = np.asarray(RepetitionPenalty(2.0)(scores, seqs, jnp.int32(3)))
    np.testing.assert_allclose(out, [[1.0, -2.0, 4.0, -6.0]])


def test_penalties_reject_bad_values():
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be at least 0"):
        penalties(no_repeat_ngram_size=-1)
    with pytest.raises(ValueError, match="repetition_penalty must be greater than 0"):
        penalties(repetition_penalty=0.0)
    assert penalties() == () and penalties(2) == (NoRepeatNGram(2),)
    assert penalties(2, 1.2) == (RepetitionPenalty(1.2), NoRepeatNGram(2))   # transformers' order
    for bad, words in ((dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size must be an integer"),
                       (dict(no_repeat_ngram_size=True), "no_repeat_ngram_size must be an integer"),
                       (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite")):
        with pytest.raises(ValueError, match=words):
            penalties(**bad)
    # Stored as Python int and float: a NumPy 2 and 2 are one static argument, one program.
    same = penalties(np.int64(2), np.float32(1.5))
    assert same == penalties(2, 1.5) and type(same[1].size) is int


@pytest.mark.parametrize("rules, expected", [
    ({}, [3, 3, 3, 3, 3, 3]),                                          # loops without a rule
    (dict(no_repeat_ngram_size=1), [3, 4, EOS]),                       # 3 and 4 banned after use
    (dict(no_repeat_ngram_size=2), [3, 3, 4, 3, EOS]),                 # (3,3), (3,4) banned after 3
    (dict(repetition_penalty=2.0), [3, 3, 3, 3, 3, 3]),                # 2·log .6 > log .2: still 3
    (dict(repetition_penalty=4.0), [3, 4, EOS]),                       # 4·log .6 < log .2; then eos
])
def test_greedy_with_penalties_by_hand(rules, expected):
    out, _ = Greedy(processors=penalties(**rules)).search(_markov, jnp.zeros((1,)), batch_size=1, bos_id=BOS,
                                                         eos_id=EOS, pad_id=PAD, max_decode_len=6)
    assert _tokens(out[0, 0]) == expected


def test_beam_with_penalties_by_hand():
    """k = 2, α = 0, M = 4, worked out step by step in the comments."""
    def run(processors):
        return Beam(2, 0.0, processors=processors).search(_markov, jnp.zeros((2,)), batch_size=1, bos_id=BOS,
                                                          eos_id=EOS, pad_id=PAD, max_decode_len=4)

    seqs, scores = run(())
    # Live (3) .5, (4) .3 → (3 3) .30, (4 3) .15 → (3 3 3) .18, (4 3 3) .09 → eos forced at M.
    assert _tokens(seqs[0, 0]) == [3, 3, 3, EOS]
    np.testing.assert_allclose(float(scores[0, 0]), math.log(0.5 * 0.6 * 0.6 * 0.1), rtol=1e-5)
    seqs, scores = run(penalties(no_repeat_ngram_size=1))
    # (4 3) .15, (3 4) .10 live; then 3 and 4 are banned in both: (3 4 eos) .03 beats (4 3 eos) .015.
    assert [_tokens(s) for s in seqs[0]] == [[3, 4, EOS], [4, 3, EOS]]
    np.testing.assert_allclose(np.asarray(scores[0]), np.log([0.5 * 0.2 * 0.3, 0.3 * 0.5 * 0.1]), rtol=1e-5)
    seqs, scores = run(penalties(repetition_penalty=3.0))
    # log-probabilities of seen tokens × 3: (4 3) -1.90 overtakes (3 3) -2.23 and stays ahead.
    assert _tokens(seqs[0, 0]) == [4, 3, 3, EOS]
    np.testing.assert_allclose(float(scores[0, 0]), math.log(0.3) + math.log(0.5) + 3 * math.log(0.6)
                               + math.log(0.1), rtol=1e-5)


def _random_table(seed, max_len, vocab=5):
    logits = np.random.default_rng(seed).normal(size=(max_len, vocab, vocab)) * 2.0
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits)), np.float64)


def _exhaustive(table, max_len, n, p):
    """Every hypothesis ending in eos, scored by the rules themselves (in plain Python)."""
    hyps = []
    for length in range(1, max_len + 1):
        for body in itertools.product((3, 4), repeat=length - 1):
            seq, logp = (*body, EOS), 0.0
            grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)] if n else []
            if len(set(grams)) < len(grams):
                continue                                         # repeats an n-gram: banned
            for t, tok in enumerate(seq):
                score = table[t, (BOS, *seq)[t], tok]
                hyps_before = seq[:t]
                logp += score * p if tok in hyps_before else score   # log-probs are negative
            hyps.append((logp, seq))
    return sorted(hyps, reverse=True)


@pytest.mark.parametrize("rules", [(1, 1.0), (2, 1.0), (0, 1.7), (2, 1.3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_beam_search_with_penalties_equals_exhaustive_search(seed, rules):
    # As test_decoding's exhaustive test: k = 12 covers every candidate at M = 4.
    max_len, k = 4, 12
    table = jnp.asarray(_random_table(seed, max_len), jnp.float32)

    def stub(ids_B1, cache):
        return table[cache["index"], ids_B1[:, 0]], {"index": cache["index"] + 1}

    seqs, scores = jax.jit(lambda: Beam(k, 0.0, processors=penalties(*rules)).search(
        stub, {"index": jnp.zeros((), jnp.int32)}, batch_size=1, bos_id=BOS, eos_id=EOS, pad_id=PAD,
        max_decode_len=max_len))()
    expected = _exhaustive(np.asarray(table, np.float64), max_len, *rules)
    got = [(float(s), tuple(_tokens(q))) for s, q in zip(scores[0], seqs[0]) if s > -1e8]
    assert [q for _, q in got] == [q for _, q in expected[:len(got)]]
    np.testing.assert_allclose([s for s, _ in got], [s for s, _ in expected[:len(got)]], rtol=1e-5)
    assert len(got) == min(k, len(expected))


def test_sampling_with_no_repeat_unigrams_never_repeats_a_token():
    keys_B = jax.random.split(jax.random.key(0), 64)
    out, _ = Sample(processors=penalties(no_repeat_ngram_size=1)).search(
        _markov, jnp.zeros((64,)), keys_B=keys_B, batch_size=64, bos_id=BOS, eos_id=EOS, pad_id=PAD,
        max_decode_len=6)
    for row in np.asarray(out[:, 0]):
        tokens = _tokens(row)
        assert len(set(tokens)) == len(tokens), tokens


def test_repeats_ngram_counts_loops_only():
    assert repeats_ngram("Funktionen , Funktionen , Funktionen ,".split())
    assert repeats_ngram("sehr sehr sehr gut".split())
    assert not repeats_ngram("a b a b c".split()) and not repeats_ngram([])
    assert not repeats_ngram("Klicken Sie auf Import . . . und".split())   # 13a's split of "..."
    assert repeats_ngram("ISTPT ( Zins ; Zins ; Zins ; Zins )".split())
    assert repeats_ngram("a b c a b c a b c".split())
    assert not repeats_ngram("a b c d e a b c d e a b c d e".split())   # n = 5 > max_n
