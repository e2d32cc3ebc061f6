"""Masks (literal 0/1 matrices), the positional table, the config and the presets."""

from __future__ import annotations

import dataclasses
import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer
from jaxformer import (
    TransformerConfig,
    create_causal_mask,
    create_decoder_mask,
    create_padding_mask,
    sinusoidal_positional_encoding,
)

# ----------------------------------------------------------------------------- masks

TOKENS = jnp.array([[5, 6, 0, 0],
                    [7, 0, 0, 0]], jnp.int32)


def test_padding_mask_literal_pad_id_0():
    mask = create_padding_mask(TOKENS, pad_id=0)
    chex.assert_shape(mask, (2, 1, 1, 4))
    assert mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask[:, 0, 0].astype(int), [[1, 1, 0, 0],
                                                              [1, 0, 0, 0]])


def test_padding_mask_literal_pad_id_3_comes_from_argument():
    tokens = jnp.array([[5, 6, 3, 3],
                        [0, 3, 3, 3]], jnp.int32)      # 0 is a real token here
    mask = create_padding_mask(tokens, pad_id=3)
    chex.assert_shape(mask, (2, 1, 1, 4))
    np.testing.assert_array_equal(mask[:, 0, 0].astype(int), [[1, 1, 0, 0],
                                                              [1, 0, 0, 0]])
    # The same tokens with pad_id=0 give a different mask: the id is not hard-coded.
    np.testing.assert_array_equal(create_padding_mask(TOKENS, pad_id=3)[:, 0, 0].astype(int),
                                  [[1, 1, 1, 1], [1, 1, 1, 1]])


def test_causal_mask_literal():
    mask = create_causal_mask(4)
    chex.assert_shape(mask, (4, 4))
    assert mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask.astype(int), [[1, 0, 0, 0],
                                                     [1, 1, 0, 0],
                                                     [1, 1, 1, 0],
                                                     [1, 1, 1, 1]])
    chex.assert_shape(create_causal_mask(7), (7, 7))


def test_decoder_mask_literal():
    tgt = jnp.array([[5, 6, 0, 0],
                     [7, 8, 9, 0]], jnp.int32)
    mask = create_decoder_mask(tgt, pad_id=0)
    chex.assert_shape(mask, (2, 1, 4, 4))
    assert mask.dtype == jnp.bool_
    np.testing.assert_array_equal(mask[0, 0].astype(int), [[1, 0, 0, 0],
                                                           [1, 1, 0, 0],
                                                           [1, 1, 0, 0],
                                                           [1, 1, 0, 0]])
    np.testing.assert_array_equal(mask[1, 0].astype(int), [[1, 0, 0, 0],
                                                           [1, 1, 0, 0],
                                                           [1, 1, 1, 0],
                                                           [1, 1, 1, 0]])
    # pad_id comes from the argument.
    mask3 = create_decoder_mask(jnp.array([[0, 3, 3]], jnp.int32), pad_id=3)
    np.testing.assert_array_equal(mask3[0, 0].astype(int), [[1, 0, 0],
                                                            [1, 0, 0],
                                                            [1, 0, 0]])


def test_decoder_mask_start_token_is_never_padding():
    """Marian starts decoding with the pad id: position 0 stays attendable, later pads do not."""
    tgt = jnp.array([[9, 5, 6, 9],
                     [9, 7, 9, 9]], jnp.int32)
    mask = create_decoder_mask(tgt, pad_id=9)
    np.testing.assert_array_equal(mask[0, 0].astype(int), [[1, 0, 0, 0],
                                                           [1, 1, 0, 0],
                                                           [1, 1, 1, 0],
                                                           [1, 1, 1, 0]])
    np.testing.assert_array_equal(mask[1, 0].astype(int), [[1, 0, 0, 0],
                                                           [1, 1, 0, 0],
                                                           [1, 1, 0, 0],
                                                           [1, 1, 0, 0]])


def test_mask_helpers_take_numpy_and_traced_integers():
    assert create_causal_mask(np.int64(2)).shape == (2, 2)
    tgt = jnp.array([[2, 5, 0]], jnp.int32)
    traced = jax.jit(create_decoder_mask)(tgt, jnp.int32(0))
    np.testing.assert_array_equal(traced, create_decoder_mask(tgt, 0))


# ----------------------------------------------------------------------- positional table

@pytest.mark.parametrize("d_model", [33, 32])
def test_positional_table_shape_and_values(d_model):
    table = sinusoidal_positional_encoding(13, d_model)
    chex.assert_shape(table, (1, 13, d_model))
    assert table.dtype == np.float32
    assert isinstance(table, np.ndarray)
    pos = np.arange(13)[:, None].astype(np.float64)
    for j in range(d_model):
        two_i = j - j % 2
        angle = pos[:, 0] / 10000.0 ** (two_i / d_model)
        expected = np.sin(angle) if j % 2 == 0 else np.cos(angle)
        np.testing.assert_allclose(table[0, :, j], expected, atol=1e-6, err_msg=f"dim {j}")
    # Row 0: sin(0)=0 on even dims, cos(0)=1 on odd dims.
    np.testing.assert_array_equal(table[0, 0, 0::2], 0.0)
    np.testing.assert_array_equal(table[0, 0, 1::2], 1.0)


def test_positional_table_is_not_a_parameter():
    c = jaxformer.preset("tiny", src_vocab_size=31, tgt_vocab_size=29)
    shapes = jax.eval_shape(jaxformer.Transformer(c).init, jax.random.key(0),
                            jnp.ones((2, 5), jnp.int32), jnp.ones((2, 7), jnp.int32))
    leaves = jax.tree_util.tree_leaves_with_path(nn.unbox(shapes["params"]))
    for path, leaf in leaves:
        assert leaf.shape != (1, c.max_len, c.d_model), jax.tree_util.keystr(path)
        assert "positional" not in jax.tree_util.keystr(path)


# ------------------------------------------------------------------------------ config

def _config(**kw):
    fields = dict(src_vocab_size=31, tgt_vocab_size=29, d_model=32, num_heads=4, d_ff=64,
                  num_encoder_layers=2, num_decoder_layers=2, max_len=16)
    fields.update(kw)
    return TransformerConfig(**fields)


def test_head_dim_not_divisible_message_names_both_values():
    with pytest.raises(ValueError) as e:
        _config(d_model=30, num_heads=4)
    assert "30" in str(e.value) and "4" in str(e.value)
    assert "d_model" in str(e.value) and "num_heads" in str(e.value)


def test_share_embeddings_needs_one_vocabulary():
    with pytest.raises(ValueError, match="share_embeddings"):
        _config(share_embeddings=True)
    _config(share_embeddings=True, tgt_vocab_size=31)          # same sizes are fine


@pytest.mark.parametrize("field,value", [
    ("norm_position", "middle"),
    ("norm_position", "Post"),
    ("dtype", "float64"),
    ("dtype", "int32"),
    ("param_dtype", "bf16"),
    ("matmul_dtype", "int8"),
    ("dropout_rate", 1.0),
    ("dropout_rate", -0.1),
    ("dropout_rate", float("nan")),
    ("attention_dropout_rate", 1.5),
    ("d_model", 0),
    ("num_heads", -1),
    ("d_ff", 2.5),
    ("num_encoder_layers", True),
    ("max_len", 0),
    ("src_vocab_size", 0),
    ("pad_id", 29),        # >= tgt_vocab_size
    ("pad_id", -1),
    ("activation", "tanh"),
    ("positional_layout", "rotary"),
    ("layer_norm_epsilon", 0.0),
    ("share_embeddings", "no"),   # a truthy string would silently mean True
    ("remat", "false"),
    ("scan_layers", 1),
    ("final_logits_bias", None),
    ("pad_id", 0.0),
    ("pad_id", True),
    ("dropout_rate", "0.1"),
])
def test_bad_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError) as e:
        _config(**{field: value})
    assert field in str(e.value)
    with pytest.raises(ValueError, match=field):   # as config.json is read
        TransformerConfig.from_dict({**_config().to_dict(), field: value})


def test_numpy_scalar_fields_are_kept_as_python_scalars():
    c = _config(d_model=np.int64(32), pad_id=np.int32(0), remat=np.bool_(True), dropout_rate=np.float32(0.5))
    assert c == _config(d_model=32, pad_id=0, remat=True, dropout_rate=0.5)
    assert [type(v) for v in (c.d_model, c.pad_id, c.remat, c.dropout_rate)] == [int, int, bool, float]


def test_replace_validates_again():
    c = _config()
    with pytest.raises(ValueError):
        c.replace(num_heads=5)
    assert c.replace(dtype="bfloat16").compute_dtype == jnp.bfloat16
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 64  # type: ignore[misc]


def test_dict_round_trip():
    c = _config(share_embeddings=False, norm_position="pre", dtype="float16", dropout_rate=0.25,
                attention_dropout_rate=0.125, pad_id=3, matmul_dtype="bfloat16")
    assert TransformerConfig.from_dict(c.to_dict()) == c
    assert TransformerConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="bogus"):
        TransformerConfig.from_dict({**c.to_dict(), "bogus": 1})


def test_config_json_without_the_marian_fields_loads_with_paper_defaults():
    old = {k: v for k, v in _config().to_dict().items()
           if k not in ("activation", "positional_layout", "final_logits_bias", "layer_norm_epsilon")}
    c = TransformerConfig.from_dict(old)
    assert (c.activation, c.positional_layout, c.final_logits_bias, c.layer_norm_epsilon) == \
        ("relu", "interleaved", False, 1e-6)


def test_a_run_resumes_with_another_matmul_dtype_but_not_another_width():
    """``matmul_dtype`` is how the weights are multiplied, not what they are: an older
    run's record without the field, or with another value, resumes; d_model does not."""
    from jaxformer.run.directory import check_resume_compatible

    saved = {"model": {k: v for k, v in _config().to_dict().items() if k != "matmul_dtype"}}
    check_resume_compatible(saved, _config(matmul_dtype="bfloat16"))
    with pytest.raises(ValueError, match="another architecture .*d_model: saved"):
        check_resume_compatible(saved, _config(d_model=64, num_heads=4))
    # Another dropout is not another architecture: the message says how to train on with it.
    with pytest.raises(ValueError, match=r"other model settings \(dropout_rate: saved 0\.1 vs now 0\.3\)"
                                         r".*fine-tune from this run: jaxformer-train --init-from"):
        check_resume_compatible(saved, _config(dropout_rate=0.3))


def test_split_positional_layout_is_sines_then_cosines():
    """Marian's table (HF ``MarianSinusoidalPositionalEmbedding``): the interleaved one's
    even dimensions, then its odd ones."""
    interleaved = sinusoidal_positional_encoding(11, 6)
    split = sinusoidal_positional_encoding(11, 6, "split")
    np.testing.assert_array_equal(split[0, :, :3], interleaved[0, :, 0::2])
    np.testing.assert_array_equal(split[0, :, 3:], interleaved[0, :, 1::2])
    np.testing.assert_allclose(split[0, 2, [0, 3]], [np.sin(2.0), np.cos(2.0)], rtol=1e-6)


def test_head_dim():
    assert _config(d_model=33, num_heads=3).head_dim == 11
    with pytest.raises(ValueError, match="positional_layout='split' needs an even d_model, got 33"):
        _config(d_model=33, num_heads=3, positional_layout="split")


# ------------------------------------------------------------------------------ presets

def _param_count(config):
    model = jaxformer.Transformer(config)
    src = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    tgt = jax.ShapeDtypeStruct((2, 11), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), src, tgt)
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes["params"]))


def _analytic_count(D, F, N, V, shared=True):
    attention = 4 * (D * D + D)                  # Q, K, V, O kernels and biases
    ffn = D * F + F + F * D + D
    norm = 2 * D
    encoder = N * (attention + ffn + 2 * norm)
    decoder = N * (2 * attention + ffn + 3 * norm)
    embeddings = V * D if shared else 2 * V * D + D * V + V
    return encoder + decoder + embeddings


@pytest.mark.parametrize("name,D,F,paper,loose", [
    ("base", 512, 2048, 65e6, (60e6, 66e6)),
    ("big", 1024, 4096, 213e6, (205e6, 215e6)),
])
def test_paper_presets_parameter_count(name, D, F, paper, loose, capsys):
    config = jaxformer.preset(name, src_vocab_size=37000)
    assert (config.d_model, config.d_ff, config.num_encoder_layers, config.share_embeddings) == (
        D, F, 6, True)
    count = _param_count(config)
    with capsys.disabled():
        print(f"\n{name}: {count:,} parameters (paper: ~{paper / 1e6:.0f}M)")
    # Tight: exactly the paper's architecture with a shared 37k vocabulary.
    assert count == _analytic_count(D, F, 6, 37000)
    # Loose: within a few % of the paper's Table 3.
    assert loose[0] <= count <= loose[1], count
    assert abs(count - paper) / paper < 0.04


def test_unknown_preset():
    with pytest.raises(ValueError, match="tiny"):
        jaxformer.preset("huge", src_vocab_size=100)


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_dropout_keeps_one_minus_rate_and_is_unbiased(rate):
    from jaxformer.model.dropout import dropout, keep_mask

    shape = (7, 11, 1001)                     # odd size: the last 16-bit half-word is dropped
    keep, keep_probability = keep_mask(jax.random.key(0), rate, shape)
    assert keep.shape == shape and keep.dtype == jnp.bool_
    assert abs(keep_probability - (1 - rate)) <= 2.0 ** -16
    assert abs(float(keep.mean()) - keep_probability) < 3e-3
    other, _ = keep_mask(jax.random.key(1), rate, shape)
    assert 0.05 < float(jnp.mean(keep != other))      # another key, another mask
    x = jnp.full(shape, 2.0)
    y = dropout(x, rate, jax.random.key(0))
    assert set(np.unique(np.asarray(y)).tolist()) == {0.0, float(np.float32(2.0 / keep_probability))}
    assert abs(float(y.mean()) - 2.0) < 0.02
