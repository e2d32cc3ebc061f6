"""Issue 53: the attention-dropout flag, and the recipe a corpus of a given shape gets."""

import pytest

from jaxformer.model.config import preset
from jaxformer.run.config import DEFAULT_CPU_RUN
from jaxformer.run.recipe import CorpusShape
from jaxformer.run.train_flags import parse_train_args


def test_attention_dropout_flag_reaches_the_model_config():
    cfg = parse_train_args(["--attention-dropout-rate", "0.15", "--dropout-rate", "0.3"], DEFAULT_CPU_RUN).cfg
    config = preset(cfg.model.preset, src_vocab_size=100, **cfg.model.overrides())
    assert (config.attention_dropout_rate, config.dropout_rate) == (0.15, 0.3)
    untouched = parse_train_args([], DEFAULT_CPU_RUN).cfg
    assert "attention_dropout_rate" not in untouched.model.overrides()   # the preset's (0) stays


def test_attention_dropout_with_a_fused_backend_is_refused_with_the_fix():
    cfg = parse_train_args(["--attention-dropout-rate", "0.1", "--attention-backend", "xla"],
                           DEFAULT_CPU_RUN).cfg
    with pytest.raises(ValueError, match="attention_backend='reference' or attention_dropout_rate=0"):
        preset(cfg.model.preset, src_vocab_size=100, **cfg.model.overrides())


def test_corpus_shape_counts_pairs_characters_and_the_covered_alphabet():
    pairs = [("ab", "ba")] * 10_000 + [("a", "z")]   # z: 1 of 40,002 characters, under sentencepiece's 0.05%
    shape = CorpusShape.of(pairs)
    assert (shape.pairs, shape.characters, shape.alphabet) == (10_001, 40_002, 2)
    assert shape.mean_characters == pytest.approx(40_002 / 20_002)
    assert CorpusShape.of([("ab", "cd")]).alphabet == 4
