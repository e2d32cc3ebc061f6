"""Scaling out (issues #5, #19): meshes, partition specs, FSDP, sharded checkpoints, mixed
precision, gradient accumulation, remat and the fused attention backend, on 8 fake CPU devices."""

from __future__ import annotations

import functools

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxformer as jf
from jaxformer.data import batching, streaming
from jaxformer.model import sharding
from jaxformer.model.attention import fused_dot_product_attention
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.train import optimizer
from jaxformer.train import step as training

VOCAB, PAD, BOS, EOS = 16, 0, 2, 3


def _config(**overrides):
    # One layer each side keeps the compiles short; vocab 16, 4 heads and d_ff 64
    # divide by every model-axis size used here.
    return jf.preset("tiny", src_vocab_size=VOCAB, max_len=16, num_encoder_layers=1,
                     num_decoder_layers=1, **overrides)


def _batch(seed=0, rows=8, length=7):
    """Copy-task batch with ragged lengths (padding differs between rows)."""
    rng = np.random.default_rng(seed)
    src = np.full((rows, length), PAD, np.int32)
    tgt_in, tgt_out = src.copy(), src.copy()
    for r in range(rows):
        n = int(rng.integers(2, length))
        body = rng.integers(4, VOCAB, n)
        src[r, :n] = body
        tgt_in[r, :n + 1] = [BOS, *body]
        tgt_out[r, :n + 1] = [*body, EOS]
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


def _tx():
    return optimizer.make_optimizer(optimizer.transformer_schedule(32, 10, scale=2.0))


# ------------------------------------------------------------------------ meshes
def test_parse_mesh_defaults_and_errors():
    assert sharding.parse_mesh(None, 8) == {"data": 8, "fsdp": 1, "model": 1}
    assert sharding.parse_mesh("data=4,model=2", 8) == {"data": 4, "fsdp": 1, "model": 2}
    assert sharding.parse_mesh("model=2", 8) == {"data": 4, "fsdp": 1, "model": 2}
    assert sharding.parse_mesh("fsdp=4", 8) == {"data": 2, "fsdp": 4, "model": 1}
    with pytest.raises(ValueError, match="product of the axis sizes must equal the device count"):
        sharding.parse_mesh("data=4,model=4", 8)
    with pytest.raises(ValueError, match="unknown axis 'tensor'"):
        sharding.parse_mesh("data=4,tensor=2", 8)
    with pytest.raises(ValueError, match="axis=size"):
        sharding.parse_mesh("data:8", 8)
    with pytest.raises(ValueError, match="given twice"):
        sharding.parse_mesh("data=4,data=2", 8)
    mesh = sharding.make_mesh("data=2,model=4")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "model": 4}


@pytest.mark.parametrize("share", [True, False])
def test_every_partition_spec_fits_its_parameter(share):
    """As many entries as dimensions, only existing mesh axes; every logical name in the table."""
    model = jf.Transformer(_config(share_embeddings=share))
    mesh = sharding.make_mesh("data=4,model=2")
    abstract, layout = training.abstract_train_state(model, _tx(), mesh)
    known = {name for name, _ in sharding.LOGICAL_AXIS_RULES}
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 8), jnp.int32),
                           jnp.ones((1, 8), jnp.int32))["params"]
    logical = jax.tree_util.tree_leaves(nn.get_partition_spec(boxed),
                                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for spec, leaf in zip(logical, jax.tree_util.tree_leaves(nn.unbox(boxed))):
        assert len(spec) == leaf.ndim, (spec, leaf.shape)
        assert set(spec) <= known, spec
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        spec = leaf.sharding.spec
        assert len(spec) <= len(leaf.shape), (jax.tree_util.keystr(path), spec, leaf.shape)
        assert {a for a in spec if a is not None} <= set(sharding.MESH_AXES)
    P, params = jax.sharding.PartitionSpec, layout.params
    assert params["encoder"]["layer_0"]["self_attention"]["query_kernel"].spec == P("fsdp", "model", None)
    assert params["encoder"]["layer_0"]["feed_forward"]["w1"]["kernel"].spec == P("fsdp", "model")
    assert params["src_embedding"]["embedding"].spec == P("model", "fsdp")
    # Adam's moments are laid out like their parameters; the step is replicated.
    mu = layout.state.opt_state[0].mu
    assert mu["encoder"]["layer_0"]["self_attention"]["out_kernel"].spec == P("model", None, "fsdp")
    assert layout.state.step.spec == P()


def test_model_axis_must_divide_heads_ffn_and_vocab():
    mesh = sharding.make_mesh("data=4,model=2")
    model = jf.Transformer(jf.preset("tiny", src_vocab_size=15, max_len=16))
    with pytest.raises(ValueError, match=r"params/.* has shape .*15.*does not divide"):
        training.abstract_train_state(model, _tx(), mesh)


def _train(mesh_spec, devices, steps=3, config_overrides=(), **train_kwargs):
    model = jf.Transformer(_config(**dict(config_overrides)))
    mesh = sharding.make_mesh(mesh_spec, devices)
    # SGD with momentum (state sharded like the params). Not Adam: its first steps move
    # each weight by about ±lr whatever the gradient's size, so a gradient that is 0 up
    # to rounding (the key bias's: softmax ignores a per-row constant) lands anywhere.
    tx = optax.sgd(0.5, momentum=0.9)
    state, layout = training.create_sharded_train_state(model, jax.random.key(0), tx, mesh)
    step = training.jit_train_step(model, 0.1, layout=layout, **train_kwargs)
    losses = []
    for i in range(steps):
        state, metrics = step(state, sharding.shard_batch(_batch(i), layout.batch), jax.random.key(1))
        losses.append(float(metrics["loss_sum"] / metrics["tokens"]))
    return state, losses


@functools.cache
def _reference_run():
    state, losses = _train("data=1,model=1", jax.devices()[:1])
    return jax.device_get(state.params), losses


def test_untied_output_projection_trains_the_same_on_a_4x2_mesh():
    """The fused projection loss with a vocabulary-sharded kernel and bias."""
    untied = (("share_embeddings", False),)
    ref_state, ref_losses = _train("data=1,model=1", jax.devices()[:1], config_overrides=untied)
    state, losses = _train("data=4,model=2", jax.devices(), config_overrides=untied)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    bias = state.params["output_projection"]["bias"]
    assert bias.sharding.spec == jax.sharding.PartitionSpec("model")
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                           jax.device_get(state.params), jax.device_get(ref_state.params))


def _mesh_sizes(spec):
    return sharding.parse_mesh(spec, len(jax.devices()))


@pytest.mark.parametrize("mesh_spec", ["data=8", "data=4,model=2", "data=2,model=4",
                                       "data=2,fsdp=4", "fsdp=4,model=2"])
def test_meshes_give_the_same_losses_and_parameters(mesh_spec):
    """Data parallel, tensor parallel and FSDP (alone and with a model axis) equal one
    device within float tolerance."""
    ref_params, ref_losses = _reference_run()
    state, losses = _train(mesh_spec, jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    # The state really is laid out on the mesh (not silently replicated): each device
    # holds 1/model of the heads and 1/fsdp of d_model of this kernel [D, H, K].
    sizes = _mesh_sizes(mesh_spec)
    kernel = state.params["decoder"]["layer_0"]["cross_attention"]["key_kernel"]
    d_model, heads, head_dim = kernel.shape
    assert kernel.addressable_shards[0].data.shape == (d_model // sizes["fsdp"], heads // sizes["model"],
                                                       head_dim)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                           jax.device_get(state.params), ref_params)


def test_fsdp_shards_parameters_and_moments_not_activations():
    """The rules table gives ``fsdp`` to parameters' ``embed`` axis, to activations' batch."""
    mesh = sharding.make_mesh("fsdp=8")
    P = jax.sharding.PartitionSpec
    with jax.set_mesh(mesh):
        assert sharding.logical_to_mesh_spec(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
        assert sharding.logical_to_mesh_spec(("vocab", "embed")) == P("model", "fsdp")
    _, layout = training.abstract_train_state(jf.Transformer(_config()), _tx(), mesh)
    assert layout.data_size == 8 and layout.batch.spec == P(("data", "fsdp"), None)
    d_model = _config().d_model
    for path, shard in jax.tree_util.tree_leaves_with_path(layout.state.opt_state[0].nu):
        name = jax.tree_util.keystr(path)
        if "kernel" in name or "embedding" in name:   # every weight matrix is split 8 ways on D
            assert "fsdp" in shard.spec, name
    leaf = layout.params["src_embedding"]["embedding"]
    assert leaf.shard_shape((VOCAB, d_model)) == (VOCAB, d_model // 8)


def test_checkpoint_saved_on_4x2_restores_on_1x1_and_8x1(tmp_path):
    model = jf.Transformer(_config())
    mesh = sharding.make_mesh("data=4,model=2")
    state, _ = training.create_sharded_train_state(model, jax.random.key(5), _tx(), mesh)
    iterator = iter(grain.MapDataset.range(10).to_iter_dataset())
    checkpoints = RunCheckpoints(tmp_path)
    checkpoints.save(1, state, iterator)
    checkpoints.wait()
    expected = jax.device_get(state)
    for spec, devices in (("data=1,model=1", jax.devices()[:1]), ("data=8,model=1", jax.devices())):
        target, layout = training.abstract_train_state(model, _tx(), sharding.make_mesh(spec, devices))
        restored = checkpoints.restore(1, target, iter(grain.MapDataset.range(10).to_iter_dataset()))
        leaf = restored.params["encoder"]["layer_0"]["self_attention"]["query_kernel"]
        assert leaf.sharding == layout.params["encoder"]["layer_0"]["self_attention"]["query_kernel"]
        for got, want in zip(jax.tree_util.tree_leaves(jax.device_get(restored)),
                             jax.tree_util.tree_leaves(expected), strict=True):
            np.testing.assert_array_equal(got, want)
    checkpoints.close()


def test_each_process_collates_its_block_of_rows():
    examples = batching.Examples(src=[[5] * (i % 7 + 1) for i in range(40)],
                             tgt=[[6] * (i % 5 + 1) for i in range(40)])
    kwargs = dict(max_len=16, batch_tokens=64, boundaries=(8, 16), seed=3, pad_id=PAD, bos_id=BOS, eos_id=EOS,
                  row_multiple=4)
    for pack in (False, True):
        whole = next(iter(streaming.stream_dataset(examples, **kwargs, pack=pack)))
        parts = [next(iter(streaming.stream_dataset(examples, **kwargs, pack=pack, process_index=i,
                                                    process_count=2))) for i in range(2)]
        for batch in (whole, *parts):   # the position after the batch: the same in every process
            np.testing.assert_array_equal(batch.pop(streaming.POSITION_KEY), [0, 0, 1])
        for name in whole:
            np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), whole[name])


# ------------------------------------------------------------ precision and memory
def test_bfloat16_trains_close_to_float32():
    """bf16 compute, float32 params and Adam state; losses within 2% of float32's."""
    model32, model16 = jf.Transformer(_config()), jf.Transformer(_config(dtype="bfloat16"))
    state32 = training.create_train_state(model32, jax.random.key(0), _tx())
    logits = jax.eval_shape(functools.partial(model16.apply, {"params": state32.params}),
                            _batch()["src"], _batch()["tgt_in"])
    assert logits.dtype == jnp.bfloat16
    losses = {}
    for name, model in (("f32", model32), ("bf16", model16)):
        state = state32   # the same float32 initial parameters and Adam state
        step = jax.jit(functools.partial(training.train_step, model=model, smoothing=0.1))
        losses[name] = []
        for i in range(4):
            state, metrics = step(state, _batch(i), jax.random.key(1))
            losses[name].append(float(metrics["loss_sum"] / metrics["tokens"]))
        leaves = jax.tree_util.tree_leaves(state.params) + jax.tree_util.tree_leaves(state.opt_state)
        assert all(x.dtype in (jnp.float32, jnp.int32) for x in leaves)
    np.testing.assert_allclose(losses["bf16"], losses["f32"], rtol=2e-2)
    assert losses["bf16"][-1] < losses["bf16"][0]


@functools.cache
def _sgd_state():
    return training.create_train_state(jf.Transformer(_config()), jax.random.key(0), optax.sgd(1.0))


def _one_sgd_step(model, batch, **kwargs):
    state = _sgd_state()   # remat changes no parameter name: one initial state serves all
    step = jax.jit(functools.partial(training.train_step, model=model, smoothing=0.1, **kwargs))
    new_state, metrics = step(state, batch, jax.random.key(1))
    grads = jax.tree_util.tree_map(jnp.subtract, state.params, new_state.params)   # sgd(1): Δ = grad
    return jax.device_get(grads), jax.device_get(metrics)


def test_four_accumulated_micro_batches_equal_one_four_times_batch():
    model = jf.Transformer(_config())
    batch = _batch(rows=16)           # ragged: the micro-batches hold different token counts
    big_grads, big_metrics = _one_sgd_step(model, batch)
    acc_grads, acc_metrics = _one_sgd_step(model, batch, grad_accum_steps=4)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           acc_grads, big_grads)
    for key in ("loss_sum", "nll_sum", "correct", "tokens"):
        np.testing.assert_allclose(acc_metrics[key], big_metrics[key], rtol=1e-5)


def test_remat_gives_the_same_gradients():
    batch = _batch()
    plain, _ = _one_sgd_step(jf.Transformer(_config()), batch)
    remat, _ = _one_sgd_step(jf.Transformer(_config(remat=True)), batch)
    # Recomputed activations may fuse differently: rounding-level differences only.
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                           remat, plain)


# ------------------------------------------------------------------ attention backend
def test_dot_product_attention_backend_matches_the_reference_core():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 3, 5, 4)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 3, 7, 4)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 3, 7, 4)), jnp.float32)
    padding = jnp.asarray([[1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]], bool)[:, None, None, :]
    for mask in (None, padding, jnp.asarray(rng.random((2, 1, 5, 7)) < 0.5)):
        ref, _ = jf.scaled_dot_product_attention(q, k, v, mask)
        out = fused_dot_product_attention(q, k, v, mask, implementation="xla")
        np.testing.assert_allclose(out, ref, atol=1e-5)
    # The all-padding source (row 1): zeros and finite gradients, not NaN.
    np.testing.assert_array_equal(np.asarray(out)[1] if mask is None else
                                  np.asarray(fused_dot_product_attention(q, k, v, padding))[1], 0.0)
    grads = jax.grad(lambda q, k, v: fused_dot_product_attention(q, k, v, padding).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(g)) for g in grads)

    config = _config()
    src, tgt = _batch()["src"], _batch()["tgt_in"]
    params = nn.unbox(jax.jit(jf.Transformer(config).init)(jax.random.key(0), src, tgt)["params"])
    reference = jax.jit(jf.Transformer(config).apply)({"params": params}, src, tgt)   # jit: eager is slow
    fused_model = jf.Transformer(config.replace(attention_backend="xla"))
    fused = jax.jit(fused_model.apply)({"params": params}, src, tgt)
    np.testing.assert_allclose(fused, reference, atol=1e-5)
    with pytest.raises(ValueError, match="attention_backend"):
        config.replace(attention_backend="flash")
    with pytest.raises(ValueError, match="no attention dropout"):
        config.replace(attention_backend="cudnn", attention_dropout_rate=0.1)


def test_decoders_have_explicit_shardings_and_match_one_device():
    """Greedy and beam decoding on a (data 2, fsdp 2, model 2) mesh: inputs and outputs laid
    out as asked, the same tokens (and beam scores) as the plain decoder on one device."""
    from jaxformer.decode.decoding import jit_decoder
    from jaxformer.decode.strategies import Beam, Greedy

    model = jf.Transformer(_config())
    mesh = sharding.make_mesh("data=2,fsdp=2,model=2")
    state, layout = training.create_sharded_train_state(model, jax.random.key(3), _tx(), mesh)
    src = sharding.shard_batch({"src": _batch(4)["src"]}, layout.batch)["src"]
    params_1 = jax.device_get(state.params)
    src_1 = np.asarray(jax.device_get(src))
    static = dict(max_decode_len=9, bos_id=BOS, eos_id=EOS)
    for strategy, extra in ((Greedy(), {}), (Beam(3, 0.6), dict(extra_len=50))):
        sharded = jit_decoder(model, strategy, layout, **static, **extra)
        out = sharded(state.params, src)
        for leaf in jax.tree_util.tree_leaves(out):
            assert leaf.sharding.spec[0] == ("data", "fsdp"), leaf.sharding
        expected = jit_decoder(model, strategy, None, **static, **extra)(params_1, src_1)
        for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(out)), jax.tree_util.tree_leaves(expected)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
