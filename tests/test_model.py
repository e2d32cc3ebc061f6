"""The whole Transformer: the shape table, padding, causality, chaining, parity with
an independent NumPy implementation, dropout modes, cached decoding, bad inputs.

Sizes are distinct so a swapped axis fails: B=2, S=5, T=7, H=3, K=11 (D=33), F=23,
V_src=31, V_tgt=29. ``pad_id`` is 2 (ids 0 and 1 are real tokens), so mask code that
hard-codes 0 fails. Parameters are random NumPy values (biases and LayerNorm
parameters included) poured into the shape tree of ``jax.eval_shape(model.init)``:
a compiled ``init`` costs several seconds on CPU and zero biases would hide bugs.
"""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import numpy_reference as ref
import pytest

from jaxformer import (
    DecoderLayer,
    EncoderLayer,
    PositionalEncoding,
    Transformer,
    TransformerConfig,
    create_causal_mask,
    create_decoder_mask,
    create_padding_mask,
    sinusoidal_positional_encoding,
)
from jaxformer.model.matmul import cast_matmul_weights

B, S, T, H, K, F = 2, 5, 7, 3, 11, 23
D = H * K
V_SRC, V_TGT = 31, 29
PAD = 2
MAX_LEN = 16


def make_config(**changes) -> TransformerConfig:
    fields = dict(src_vocab_size=V_SRC, tgt_vocab_size=V_TGT, d_model=D, num_heads=H, d_ff=F,
                  num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0,
                  attention_dropout_rate=0.0, max_len=MAX_LEN, pad_id=PAD)
    fields.update(changes)
    return TransformerConfig(**fields)


SHARED = dict(tgt_vocab_size=V_SRC, share_embeddings=True)


# ------------------------------------------------------------------------------------------
# Helpers: random parameters, random ids, one jitted forward per config.

def model_and_params(config: TransformerConfig, seed: int = 0):
    """(Transformer(config), random float32 params); the params depend only on the shapes."""
    shape_config = config.replace(dtype="float32", dropout_rate=0.0, attention_dropout_rate=0.0)
    return Transformer(config), _random_params(shape_config, seed)


@functools.cache
def _random_params(config: TransformerConfig, seed: int):
    shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0),
                            jax.ShapeDtypeStruct((1, 3), jnp.int32), jax.ShapeDtypeStruct((1, 3), jnp.int32))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        shape = leaf.shape
        if name.endswith("['scale']"):
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("bias']"):
            value = 0.2 * rng.standard_normal(shape)
        elif name.endswith("['embedding']"):
            value = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif name.endswith("['out_kernel']"):
            value = rng.standard_normal(shape) / np.sqrt(shape[0] * shape[1])
        else:                                   # [D, H, K], [D, F], [F, D], [D, V] kernels
            value = rng.standard_normal(shape) / np.sqrt(shape[0])
        return jnp.asarray(value, jnp.float32)

    return jax.tree_util.tree_map_with_path(fill, nn.unbox(shapes))


@functools.cache
def forward(config: TransformerConfig):
    """jit(apply) in eval mode (one compile per input shape, shared by the tests)."""
    model = Transformer(config)
    return jax.jit(lambda variables, src, tgt: model.apply(variables, src, tgt))


def ids(rng, shape, vocab, lengths=None):
    """Random ids in [0, vocab) without PAD; row b padded from lengths[b] on."""
    x = rng.integers(0, vocab - 1, size=shape)
    x = np.where(x >= PAD, x + 1, x).astype(np.int32)        # skip PAD
    if lengths is not None:
        for b, n in enumerate(lengths):
            x[b, n:] = PAD
    return x


def perturb(tree, rng, scale=0.5):
    return jax.tree.map(
        lambda a: jnp.asarray(np.asarray(a) + scale * rng.standard_normal(a.shape).astype(np.float32)), tree)


# ------------------------------------------------------------------------------------------
# 1. The shape table, every row.

def _capture_all(mdl, method_name):
    return True


@pytest.mark.parametrize("shared", [False, True], ids=["separate_vocab", "shared_vocab"])
def test_shape_table(shared):
    config = make_config(**(SHARED if shared else {}))
    v_tgt = config.tgt_vocab_size
    model, params = model_and_params(config)
    rng = np.random.default_rng(1)
    src = ids(rng, (B, S), config.src_vocab_size, lengths=[S, 3])
    tgt = ids(rng, (B, T), v_tgt, lengths=[T, 4])
    chex.assert_shape(src, (B, S))
    chex.assert_shape(tgt, (B, T))
    assert np.issubdtype(src.dtype, np.integer) and np.issubdtype(tgt.dtype, np.integer)

    run = jax.jit(lambda p, s, t: model.apply(p, s, t, capture_intermediates=_capture_all,
                                              mutable=["intermediates"]))
    logits, state = run(params, src, tgt)
    inter = state["intermediates"]

    # embedded + positional: the two PositionalEncoding calls (encoder, then decoder).
    src_x, tgt_x = inter["positional_encoding"]["__call__"]
    chex.assert_shape(src_x, (B, S, D))
    chex.assert_shape(tgt_x, (B, T, D))
    # positional table (a constant buffer) [1, max_len, D].
    chex.assert_shape(sinusoidal_positional_encoding(MAX_LEN, D), (1, MAX_LEN, D))
    chex.assert_shape(model.bind(params).positional_encoding.table, (1, MAX_LEN, D))

    for i in range(config.num_encoder_layers):
        layer = inter["encoder"][f"layer_{i}"]
        attention = layer["self_attention"]
        chex.assert_shape(attention["project_query"][0], (B, H, S, K))          # Q
        chex.assert_shape(list(attention["project_key_value"][0]), (B, H, S, K))  # K, V
        chex.assert_shape(attention["attention_weights"][0], (B, H, S, S))     # weights
        chex.assert_shape(layer["feed_forward"]["w1"]["__call__"][0], (B, S, F))  # FFN hidden
        chex.assert_shape(layer["__call__"][0], (B, S, D))
    chex.assert_shape(inter["encoder"]["__call__"][0], (B, S, D))              # encoder_output
    chex.assert_shape(inter["encode"][0], (B, S, D))

    for i in range(config.num_decoder_layers):
        layer = inter["decoder"][f"layer_{i}"]
        self_attention, cross = layer["self_attention"], layer["cross_attention"]
        chex.assert_shape(self_attention["project_query"][0], (B, H, T, K))
        chex.assert_shape(list(self_attention["project_key_value"][0]), (B, H, T, K))
        chex.assert_shape(self_attention["attention_weights"][0], (B, H, T, T))
        chex.assert_shape(cross["project_query"][0], (B, H, T, K))
        chex.assert_shape(list(cross["project_key_value"][0]), (B, H, S, K))
        chex.assert_shape(cross["attention_weights"][0], (B, H, T, S))
        chex.assert_shape(layer["feed_forward"]["w1"]["__call__"][0], (B, T, F))
    chex.assert_shape(inter["decoder"]["__call__"][0], (B, T, D))              # decoder_output
    chex.assert_shape(logits, (B, T, v_tgt))                                     # logits
    chex.assert_shape(inter["decode"][0], (B, T, v_tgt))

    # masks
    chex.assert_shape(create_padding_mask(src, PAD), (B, 1, 1, S))
    chex.assert_shape(create_padding_mask(tgt, PAD), (B, 1, 1, T))
    chex.assert_shape(create_causal_mask(T), (T, T))
    chex.assert_shape(create_decoder_mask(tgt, PAD), (B, 1, T, T))

    # The sown weights respect the masks: no weight on padded source keys.
    cross_w = np.asarray(inter["decoder"]["layer_0"]["cross_attention"]["attention_weights"][0])
    np.testing.assert_array_equal(cross_w[1, :, :, 3:], 0.0)
    np.testing.assert_allclose(cross_w.sum(-1), 1.0, atol=1e-5)
    self_w = np.asarray(inter["decoder"]["layer_0"]["self_attention"]["attention_weights"][0])
    np.testing.assert_array_equal(np.triu(self_w[0, 0], k=1), 0.0)


# ------------------------------------------------------------------------------------------
# 5. All-padding rows: finite logits and gradients in every compute dtype.

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_all_padding_rows_finite_logits_and_gradients(dtype):
    config = make_config(num_encoder_layers=1, num_decoder_layers=1, dtype=dtype)
    model, params = model_and_params(config)
    rng = np.random.default_rng(2)
    # row 0: normal; row 1: all-padding source; row 2: all-padding source AND target.
    src = ids(rng, (3, S), V_SRC, lengths=[S, 0, 0])
    tgt = ids(rng, (3, T), V_TGT, lengths=[T, T, 0])
    labels = ids(rng, (3, T), V_TGT)

    def loss_fn(p):
        logits = model.apply(p, src, tgt)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        # every position counts, so a NaN anywhere (forward or backward) shows up
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)
        return nll.mean(), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    assert logits.dtype == jnp.dtype(dtype)
    chex.assert_shape(logits, (3, T, V_TGT))
    chex.assert_tree_all_finite(logits)
    assert np.isfinite(float(loss))
    chex.assert_tree_all_finite(grads)
    for leaf in jax.tree.leaves(grads):
        assert leaf.dtype == jnp.float32                      # params stay float32
    assert float(_global_norm(grads)) > 0.0


def _global_norm(tree):
    return np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(tree)))


# ------------------------------------------------------------------------------------------
# 6. Causality: target tokens after t never change the logits at positions <= t.

def test_causality_every_position():
    config = make_config()
    _, params = model_and_params(config)
    rng = np.random.default_rng(3)
    src = ids(rng, (1, S), V_SRC, lengths=[4])
    base = ids(rng, (1, T), V_TGT)
    rows = [base[0]]
    for t in range(T):                       # variant t: every token after t changed
        row = base[0].copy()
        for j in range(t + 1, T):
            row[j] = rng.choice([x for x in range(V_TGT) if x not in (PAD, row[j])])
        rows.append(row)
    tgt = np.stack(rows)                     # [T+1, T]
    logits = np.asarray(forward(config)(params, np.repeat(src, T + 1, axis=0), tgt))
    for t in range(T):
        np.testing.assert_allclose(logits[t + 1, : t + 1], logits[0, : t + 1], atol=1e-5, rtol=1e-5,
                                   err_msg=f"logits at <= {t} depend on later tokens")
        if t + 1 < T:                        # the test can fail: later positions do change
            assert np.abs(logits[t + 1, t + 1] - logits[0, t + 1]).max() > 1e-3


# ------------------------------------------------------------------------------------------
# 7. Padding invariance.

def test_appending_source_pads_leaves_logits_unchanged():
    config = make_config()
    _, params = model_and_params(config)
    rng = np.random.default_rng(4)
    src = ids(rng, (1, S), V_SRC)
    tgt = ids(rng, (1, T), V_TGT)
    padded = np.concatenate([src, np.full((1, 3), PAD, np.int32)], axis=1)
    fwd = forward(config)
    np.testing.assert_allclose(fwd(params, padded, tgt), fwd(params, src, tgt), atol=1e-5, rtol=1e-5)


def test_appending_target_pads_leaves_real_logits_unchanged():
    config = make_config()
    _, params = model_and_params(config)
    rng = np.random.default_rng(5)
    src = ids(rng, (1, S), V_SRC)
    tgt = ids(rng, (1, T), V_TGT)
    padded = np.concatenate([tgt, np.full((1, 3), PAD, np.int32)], axis=1)
    fwd = forward(config)
    out_padded = np.asarray(fwd(params, src, padded))
    chex.assert_tree_all_finite(out_padded)
    np.testing.assert_allclose(out_padded[:, :T], fwd(params, src, tgt), atol=1e-5, rtol=1e-5)


def test_mixed_length_batch_equals_each_sentence_alone():
    config = make_config()
    _, params = model_and_params(config)
    rng = np.random.default_rng(6)
    src_lengths, tgt_lengths = [S, 3, 1], [T, 4, 2]
    src = ids(rng, (3, S), V_SRC, lengths=src_lengths)
    tgt = ids(rng, (3, T), V_TGT, lengths=tgt_lengths)
    fwd = forward(config)
    batch = np.asarray(fwd(params, src, tgt))
    for b, (n, m) in enumerate(zip(src_lengths, tgt_lengths, strict=True)):
        alone = np.asarray(fwd(params, src[b: b + 1, :n], tgt[b: b + 1, :m]))
        np.testing.assert_allclose(batch[b, :m], alone[0], atol=1e-5, rtol=1e-5, err_msg=f"row {b}")


# ------------------------------------------------------------------------------------------
# 8. Layer chaining.

@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_perturbing_layer_0_changes_the_output(stack):
    config = make_config()
    _, params = model_and_params(config)
    rng = np.random.default_rng(7)
    src = ids(rng, (B, S), V_SRC, lengths=[S, 3])
    tgt = ids(rng, (B, T), V_TGT)
    fwd = forward(config)
    base = np.asarray(fwd(params, src, tgt))
    changed = jax.tree.map(lambda x: x, params)               # new dicts, same leaves
    changed["params"][stack]["layer_0"] = perturb(params["params"][stack]["layer_0"], rng)
    out = np.asarray(fwd(changed, src, tgt))
    # If only the last layer's output were used (or every layer got the same input and
    # only the last counted), layer_0 would not matter.
    assert np.abs(out - base).max() > 1e-2


def test_each_layer_is_fed_the_previous_layers_output():
    config = make_config(num_encoder_layers=3, num_decoder_layers=3)
    model, params = model_and_params(config)
    rng = np.random.default_rng(8)
    src = ids(rng, (B, S), V_SRC, lengths=[S, 2])
    tgt = ids(rng, (B, T), V_TGT, lengths=[T, 5])
    names = []

    def run(p, s, t):
        records = []
        names.clear()

        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            module = context.module
            if context.method_name == "__call__" and isinstance(
                    module, (EncoderLayer, DecoderLayer, PositionalEncoding)):
                names.append((type(module).__name__, module.name))
                records.append(([a for a in args if isinstance(a, jax.Array)], out))
            return out

        with nn.intercept_methods(interceptor):
            logits = model.apply(p, s, t)
        return logits, records

    _, records = jax.jit(run)(params, src, tgt)
    calls = {}
    for key, (args, out) in zip(names, records, strict=True):
        calls.setdefault(key, []).append((args, out))
    (_, src_x), (_, tgt_x) = calls[("PositionalEncoding", "positional_encoding")]

    enc = [calls[("EncoderLayer", f"layer_{i}")][0] for i in range(3)]
    np.testing.assert_array_equal(enc[0][0][0], src_x)
    for i in (1, 2):
        np.testing.assert_array_equal(enc[i][0][0], enc[i - 1][1])
        assert np.abs(np.asarray(enc[i][0][0]) - np.asarray(src_x)).max() > 1e-3
    encoder_output = enc[2][1]            # post-norm: the last layer's output is the stack's

    dec = [calls[("DecoderLayer", f"layer_{i}")][0] for i in range(3)]
    np.testing.assert_array_equal(dec[0][0][0], tgt_x)
    for i in (1, 2):
        np.testing.assert_array_equal(dec[i][0][0], dec[i - 1][1])
        # fails for the seed tutorial's loop, which feeds every layer the embedded target
        assert np.abs(np.asarray(dec[i][0][0]) - np.asarray(tgt_x)).max() > 1e-3
    for i in range(3):                    # every decoder layer attends to the encoder output
        np.testing.assert_array_equal(dec[i][0][1], encoder_output)


# ------------------------------------------------------------------------------------------
# 9. Parity with an independent NumPy implementation.

@pytest.mark.parametrize("changes", [
    dict(),
    SHARED,
    dict(norm_position="pre"),
], ids=["post_separate", "post_shared", "pre_separate"])
def test_numpy_reference_parity(changes):
    config = make_config(**changes)
    _, params = model_and_params(config, seed=9)
    if config.norm_position == "pre":
        for stack in ("encoder", "decoder"):
            assert "final_norm" in params["params"][stack]
    rng = np.random.default_rng(9)
    src = ids(rng, (B, S), config.src_vocab_size, lengths=[S, 3])
    tgt = ids(rng, (B, T), config.tgt_vocab_size, lengths=[T, 5])
    logits = np.asarray(forward(config)(params, src, tgt))
    expected = ref.transformer_logits(params["params"], src=src, tgt=tgt, pad_id=PAD,
                                      share_embeddings=config.share_embeddings,
                                      norm_position=config.norm_position)
    assert np.abs(expected).max() > 0.5                      # not a trivially small output
    np.testing.assert_allclose(logits, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# 10. Dropout: eval ignores the rng; rate 0 in training equals eval; rate 0.3 depends on it.

@functools.cache
def _train_forward(config):
    model = Transformer(config)
    return jax.jit(lambda p, s, t, key: model.apply(p, s, t, deterministic=False,
                                                    rngs={"dropout": key}))


@functools.cache
def _eval_forward_with_rng(config):
    model = Transformer(config)
    return jax.jit(lambda p, s, t, key: model.apply(p, s, t, rngs={"dropout": key}))


def _dropout_data():
    rng = np.random.default_rng(10)
    src = ids(rng, (B, S), V_SRC, lengths=[S, 3])
    tgt = ids(rng, (B, T), V_TGT)
    # "rbg" keys: the threefry bit generator takes seconds to compile on CPU.
    keys = jax.random.key(1, impl="rbg"), jax.random.key(2, impl="rbg")
    return src, tgt, keys


NOISY = dict(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.3, attention_dropout_rate=0.3)


def test_eval_mode_ignores_dropout_rng():
    src, tgt, (k1, k2) = _dropout_data()
    noisy = make_config(**NOISY)
    _, params = model_and_params(noisy)
    plain = np.asarray(forward(noisy)(params, src, tgt))      # default deterministic=True
    eval_rng = _eval_forward_with_rng(noisy)
    np.testing.assert_array_equal(eval_rng(params, src, tgt, k1), plain)
    np.testing.assert_array_equal(eval_rng(params, src, tgt, k2), plain)


def test_training_mode_without_dropout_equals_eval_mode():
    src, tgt, (k1, k2) = _dropout_data()
    clean = make_config(**{**NOISY, "dropout_rate": 0.0, "attention_dropout_rate": 0.0})
    _, params = model_and_params(clean)
    plain = np.asarray(forward(clean)(params, src, tgt))
    train_clean = _train_forward(clean)
    np.testing.assert_allclose(train_clean(params, src, tgt, k1), plain, atol=1e-6)
    np.testing.assert_allclose(train_clean(params, src, tgt, k2), plain, atol=1e-6)


def test_training_dropout_depends_on_rng_and_is_reproducible():
    src, tgt, (k1, k2) = _dropout_data()
    noisy = make_config(**NOISY)
    _, params = model_and_params(noisy)
    train = _train_forward(noisy)
    a, a_again, b = (np.asarray(train(params, src, tgt, k)) for k in (k1, k1, k2))
    np.testing.assert_array_equal(a, a_again)                 # reproducible
    assert np.abs(a - b).max() > 1e-2                         # rng-dependent
    clean = make_config(**{**NOISY, "dropout_rate": 0.0, "attention_dropout_rate": 0.0})
    plain = np.asarray(_train_forward(clean)(params, src, tgt, k1))
    assert np.abs(a - plain).max() > 1e-2                     # dropout does something


def test_each_dropout_site_is_active_in_training():
    src, tgt, (k1, k2) = _dropout_data()
    rate = 0.3
    # (a) embedding + residual dropout only: look at what the Dropout modules return.
    config = make_config(**{**NOISY, "dropout_rate": rate, "attention_dropout_rate": 0.0})
    model, params = model_and_params(config)
    run = jax.jit(lambda p, s, t, key: model.apply(
        p, s, t, deterministic=False, rngs={"dropout": key}, capture_intermediates=True,
        mutable=["intermediates"])[1]["intermediates"])
    inter = run(params, src, tgt, k1)
    # embedding dropout (§5.4) on embedding × √D + PE
    src_x, tgt_x = (np.asarray(a) for a in inter["positional_encoding"]["__call__"])
    embedded = np.asarray(inter["src_embedding"]["__call__"][0])
    pre_dropout = embedded + sinusoidal_positional_encoding(MAX_LEN, D)[:, :S]
    for out in (src_x, tgt_x):
        assert 0.15 < np.mean(out == 0) < 0.45
    kept = src_x != 0
    np.testing.assert_allclose(src_x[kept], pre_dropout[kept] / (1 - rate), rtol=1e-5, atol=1e-5)
    # residual dropout on every sub-layer output
    for stack, norms in (("encoder", ["attention_norm", "feed_forward_norm"]),
                         ("decoder", ["self_attention_norm", "cross_attention_norm", "feed_forward_norm"])):
        for norm in norms:
            dropped = np.asarray(inter[stack]["layer_0"][norm]["dropout"]["__call__"][0])
            assert 0.15 < np.mean(dropped == 0) < 0.45, (stack, norm)

    # (b) attention dropout only: the output depends on the key, the sown weights do not.
    config = make_config(**{**NOISY, "dropout_rate": 0.0, "attention_dropout_rate": rate})
    model, params = model_and_params(config)
    run = jax.jit(lambda p, s, t, key: model.apply(
        p, s, t, deterministic=False, rngs={"dropout": key}, mutable=["intermediates"]))
    (a, state_a), (b, state_b) = run(params, src, tgt, k1), run(params, src, tgt, k2)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-2
    # The first attention of each stack sees dropout-free inputs: same pre-dropout weights.
    for stack, name in (("encoder", "self_attention"), ("decoder", "self_attention")):
        chex.assert_trees_all_close(state_a["intermediates"][stack]["layer_0"][name],
                                    state_b["intermediates"][stack]["layer_0"][name], atol=1e-6)


# ------------------------------------------------------------------------------------------
# 11. Cached decoding equals teacher forcing.

@pytest.mark.parametrize("changes", [dict(), dict(norm_position="pre", **SHARED)],
                         ids=["post_separate", "pre_shared"])
def test_cached_decoding_matches_teacher_forcing(changes):
    config = make_config(**changes)
    model, params = model_and_params(config)
    rng = np.random.default_rng(11)
    src = ids(rng, (3, S), config.src_vocab_size, lengths=[S, 2, 0])   # padded, all-pad rows
    tgt = ids(rng, (3, T), config.tgt_vocab_size)
    max_decode_len = T + 2                     # cache longer than what is fed

    @jax.jit
    def prepare(p, s, t):
        encoder_output = model.apply(p, s, method=Transformer.encode)
        full = model.apply(p, encoder_output, s, t, method=Transformer.decode)
        cache = model.apply(p, encoder_output, s, max_decode_len, method=Transformer.init_cache)
        return full, cache

    step = jax.jit(lambda p, token, cache: model.apply(p, token, cache, method=Transformer.decode_step))
    full, cache = prepare(params, src, tgt)
    full = np.asarray(full)
    chex.assert_shape(cache.layers[0].cross_k, (3, H, S, K))
    chex.assert_shape(cache.layers[0].self_k, (3, H, max_decode_len, K))
    for t in range(T):
        logits, cache = step(params, tgt[:, t: t + 1], cache)
        chex.assert_shape(logits, (3, config.tgt_vocab_size))
        assert int(cache.index) == t + 1
        np.testing.assert_allclose(logits, full[:, t], atol=1e-5, rtol=1e-5, err_msg=f"position {t}")


def test_bfloat16_weight_matmuls_round_the_operands_and_sum_in_float32():
    """``matmul_dtype="bfloat16"`` (jaxformer.model.matmul): every weight matmul takes
    bfloat16 operands and returns float32; the logits stay within bfloat16 rounding of the
    float32 model's; parameters cast once by ``cast_matmul_weights`` give the same
    logits bit for bit; cached decoding still equals teacher forcing."""
    config = make_config(**SHARED)
    narrow = config.replace(matmul_dtype="bfloat16")
    _, variables = model_and_params(config)
    params = variables["params"]
    rng = np.random.default_rng(12)
    src = ids(rng, (B, S), V_SRC, lengths=[S, 3])
    tgt = ids(rng, (B, T), V_SRC)
    wide_logits = np.asarray(forward(config)({"params": params}, src, tgt))
    narrow_logits = forward(narrow)({"params": params}, src, tgt)
    assert narrow_logits.dtype == jnp.float32
    gap = np.abs(np.asarray(narrow_logits) - wide_logits).max()
    assert 0 < gap < 0.03 * np.abs(wide_logits).max(), gap

    lowered = {c.matmul_dtype: jax.jit(lambda p, c=c: Transformer(c).apply(p, src, tgt)).lower(
        {"params": params}).as_text() for c in (config, narrow)}
    dots = [line for line in lowered["bfloat16"].splitlines() if "dot_general" in line]
    weight_dots = [line for line in dots if "bf16" in line]
    # per layer 4 (encoder: Q K V out, FFN 2) / decoder (self 4, cross 4, FFN 2), plus the logits
    assert len(weight_dots) == 2 * 6 + 2 * 10 + 1, "\n".join(dots)
    assert all("-> tensor<" in line and "xf32>" in line.split("->")[-1] for line in weight_dots)
    assert "bf16" not in lowered[None]

    cast = cast_matmul_weights(params, narrow)
    kinds = {jax.tree_util.keystr(path): x.dtype for path, x in jax.tree_util.tree_leaves_with_path(cast)}
    assert kinds["['src_embedding']['embedding']"] == jnp.bfloat16
    for name, dtype in kinds.items():
        wants = jnp.bfloat16 if name.endswith("kernel']") or name.endswith("['embedding']") else jnp.float32
        assert dtype == wants, name
    assert cast_matmul_weights(params, config) is params
    np.testing.assert_array_equal(forward(narrow)({"params": cast}, src, tgt), narrow_logits)

    model = Transformer(narrow)
    encoder_output = model.apply({"params": cast}, src, method=Transformer.encode)
    cache = model.apply({"params": cast}, encoder_output, src, T, method=Transformer.init_cache)
    step = jax.jit(lambda p, token, cache: model.apply(p, token, cache, method=Transformer.decode_step))
    for t in range(T):
        logits, cache = step({"params": cast}, tgt[:, t: t + 1], cache)
        np.testing.assert_allclose(logits, narrow_logits[:, t], atol=0.02, rtol=0.02, err_msg=f"position {t}")


# ------------------------------------------------------------------------------------------
# 12. Bad inputs → ValueError naming the argument.

@pytest.fixture
def tiny():
    config = make_config(num_encoder_layers=1, num_decoder_layers=1)
    model, params = model_and_params(config)
    rng = np.random.default_rng(12)
    return model, params, ids(rng, (B, S), V_SRC), ids(rng, (B, T), V_TGT)


def _set(x, value):
    x = x.copy()
    x[1, 2] = value
    return x


def _encoder_output():
    return np.zeros((B, S, D), np.float32)


@pytest.mark.parametrize("value,match", [(V_SRC, r"src.*\[0, 31\)"), (V_SRC + 5, r"src.*\[0, 31\)"),
                                         (-1, r"src.*\[0, 31\)")])
def test_bad_src_ids(tiny, value, match):
    model, params, src, tgt = tiny
    with pytest.raises(ValueError, match=match):
        model.apply(params, _set(src, value), tgt)
    with pytest.raises(ValueError, match=match):
        model.apply(params, _set(src, value), method=Transformer.encode)


@pytest.mark.parametrize("value", [V_TGT, V_SRC - 1, -3])   # 30 is a valid src id, not a tgt id
def test_bad_tgt_ids(tiny, value):
    model, params, src, tgt = tiny
    with pytest.raises(ValueError, match=r"tgt.*\[0, 29\)"):
        model.apply(params, _encoder_output(), src, _set(tgt, value), method=Transformer.decode)


def test_bad_tgt_ids_through_call(tiny):
    model, params, src, tgt = tiny
    with pytest.raises(ValueError, match=r"tgt.*\[0, 29\)"):
        model.apply(params, src, _set(tgt, V_TGT))


@pytest.mark.parametrize("arg", ["src", "tgt"])
def test_float_ids(tiny, arg):
    model, params, src, tgt = tiny
    if arg == "src":
        with pytest.raises(ValueError, match="src must hold integer"):
            model.apply(params, src.astype(np.float32), tgt)
    else:
        with pytest.raises(ValueError, match="tgt must hold integer"):
            model.apply(params, _encoder_output(), src, tgt.astype(np.float32), method=Transformer.decode)


@pytest.mark.parametrize("arg", ["src", "tgt"])
@pytest.mark.parametrize("rank", [1, 3])
def test_wrong_rank_ids(tiny, arg, rank):
    model, params, src, tgt = tiny
    if arg == "src":
        bad = src[:, 0] if rank == 1 else src[..., None]
        with pytest.raises(ValueError, match="src must be integer token ids of rank 2"):
            model.apply(params, bad, tgt)
        with pytest.raises(ValueError, match="src must be integer token ids of rank 2"):
            model.apply(params, bad, method=Transformer.encode)
    else:
        bad = tgt[:, 0] if rank == 1 else tgt[..., None]
        with pytest.raises(ValueError, match="tgt must be integer token ids of rank 2"):
            model.apply(params, _encoder_output(), src, bad, method=Transformer.decode)


def test_rank_0_src_through_call(tiny):
    model, params, _, tgt = tiny
    with pytest.raises(ValueError, match="src must be integer token ids of rank 2"):
        model.apply(params, np.int32(3), tgt)


def test_python_list_ids_are_named_with_the_conversion(tiny):
    model, params, src, tgt = tiny
    with pytest.raises(ValueError, match=r"src must be an array .* got a list; convert it with jnp.asarray"):
        model.apply(params, src.tolist(), tgt)


def test_too_long_inputs_name_max_len(tiny):
    model, params, src, tgt = tiny
    rng = np.random.default_rng(13)
    long_src = ids(rng, (B, MAX_LEN + 1), V_SRC)
    long_tgt = ids(rng, (B, MAX_LEN + 1), V_TGT)
    with pytest.raises(ValueError, match=r"src has length 17 > max_len=16"):
        model.apply(params, long_src, tgt)
    with pytest.raises(ValueError, match=r"tgt has length 17 > max_len=16"):
        model.apply(params, _encoder_output(), src, long_tgt, method=Transformer.decode)


def test_batch_mismatch(tiny):
    model, params, src, tgt = tiny
    with pytest.raises(ValueError, match="same batch size"):
        model.apply(params, src, tgt[:1])
    with pytest.raises(ValueError, match="same batch size"):
        model.apply(params, _encoder_output(), src, tgt[:1], method=Transformer.decode)


def test_init_cache_rejects_bad_length(tiny):
    model, params, src, _ = tiny
    for bad in (0, MAX_LEN + 1, 4.0, True):   # a float or a bool: named, not a shape error in JAX
        with pytest.raises(ValueError, match="max_decode_len"):
            model.apply(params, _encoder_output(), src, bad, method=Transformer.init_cache)


def test_deterministic_must_be_a_bool(tiny):
    """deterministic="no" is truthy: it would silently switch dropout off."""
    model, params, src, tgt = tiny
    with pytest.raises(ValueError, match="deterministic must be True or False, got 'no'"):
        model.apply(params, src, tgt, deterministic="no")


# ------------------------------------------------------------------------------------------
# 13. No silent retracing.

def test_jitted_apply_does_not_retrace():
    config = make_config(num_encoder_layers=1, num_decoder_layers=1)
    model, params = model_and_params(config)
    rng = np.random.default_rng(14)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def apply(p, s, t):
        return model.apply(p, s, t)

    first = apply(params, ids(rng, (B, S), V_SRC), ids(rng, (B, T), V_TGT))
    second = apply(params, ids(rng, (B, S), V_SRC, lengths=[2, 3]), ids(rng, (B, T), V_TGT))
    assert not np.allclose(first, second)
    # The guard can fail: a new shape means a new trace.
    with pytest.raises(AssertionError):
        apply(params, ids(rng, (B, S + 1), V_SRC), ids(rng, (B, T), V_TGT))


# ------------------------------------------------------------------------------------------
# Strict rank promotion (conftest) holds for the whole model.

def test_model_runs_under_rank_promotion_raise():
    config = make_config(num_encoder_layers=1, num_decoder_layers=1)
    model, params = model_and_params(config)
    rng = np.random.default_rng(15)
    src = ids(rng, (B, S), V_SRC)
    tgt = ids(rng, (B, T), V_TGT)
    with jax.numpy_rank_promotion("raise"):
        jax.eval_shape(model.init, jax.random.key(0), src, tgt)
        logits = jax.jit(model.apply)(params, src, tgt)
    chex.assert_shape(logits, (B, T, V_TGT))
