"""A model's generation rules (:mod:`jaxformer.decode.generation`): which ids are banned and a
forced first token, with stub models whose right answer is known (start = eos, as M2M100)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.decode.generation import ForcedFirstToken, banned_mask, with_forced_first
from jaxformer.decode.strategies import Beam, Greedy

PAD, EOS = 1, 2        # M2M100's ids: the decoder starts with eos
VOCAB = 6


def _stub(preferred):
    """tokens_to_logits preferring ``preferred[step]`` (logit 5), then pad (3), then eos (2)."""
    table = np.zeros((len(preferred), VOCAB), np.float32)
    table[:, PAD], table[:, EOS] = 3.0, 2.0
    for step, token in enumerate(preferred):
        table[step, token] = 5.0
    table = jnp.asarray(table)

    def tokens_to_logits(ids_B1, cache):
        logits_BV = jnp.broadcast_to(table[cache["index"]], (ids_B1.shape[0], VOCAB))
        return logits_BV, {"index": cache["index"] + 1}

    return tokens_to_logits


def _search(strategy, preferred, **rules):
    cache = {"index": jnp.zeros((), jnp.int32)}
    seqs, _ = strategy.search(_stub(preferred), cache, batch_size=1, bos_id=EOS, eos_id=EOS, pad_id=PAD,
                              max_decode_len=len(preferred), keys_B=None, **rules)
    return [int(t) for t in np.asarray(seqs)[0, 0]]


def test_banned_mask_defaults_to_pad_and_start():
    assert np.asarray(banned_mask(4, bos_id=3, pad_id=0)).tolist() == [True, False, False, True]
    assert not np.asarray(banned_mask(4, bos_id=3, pad_id=0, banned_ids=())).any()
    only_2 = banned_mask(4, bos_id=3, pad_id=0, banned_ids=(2,))
    assert np.asarray(only_2).tolist() == [False, False, True, False]


@pytest.mark.parametrize("strategy", [Greedy(), Beam(2, 1.0, "hf")], ids=["greedy", "beam"])
def test_start_equal_to_eos_still_ends_and_nothing_is_banned(strategy):
    """Start = eos (M2M100): by default eos would be banned and no sentence could end; with the
    model's rules (nothing banned) pad may be generated as ``generate`` allows, and eos ends."""
    preferred = [4, 3, EOS, 5]
    assert EOS not in _search(strategy, preferred)[:3]   # the default bans the start (eos, but at the limit)
    assert _search(strategy, [PAD, 3, EOS, 5], banned_ids=())[:3] == [PAD, 3, EOS]
    assert _search(strategy, preferred, banned_ids=())[:3] == [4, 3, EOS]


@pytest.mark.parametrize("strategy", [Greedy(), Beam(2, 1.0, "hf")], ids=["greedy", "beam"])
def test_forced_first_token(strategy):
    forced = with_forced_first(strategy, 5)
    assert forced.processors == (ForcedFirstToken(5),) and with_forced_first(strategy, None) is strategy
    assert _search(forced, [4, 3, EOS, 0], banned_ids=())[:3] == [5, 3, EOS]
