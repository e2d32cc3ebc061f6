"""Layers under ``nn.scan`` (issue #19): the scanned model is the unrolled one with its
parameters stacked on a ``layers`` axis; it decodes and restores checkpoints of either
layout, on 8 fake CPU devices (training it end to end: ``tests/test_train_e2e.py``)."""

from __future__ import annotations

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxformer as jf
from jaxformer.decode import decoding
from jaxformer.decode.strategies import Beam
from jaxformer.model import scan, sharding
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.train import step as training

VOCAB, PAD, BOS, EOS = 16, 0, 2, 3
SRC = np.array([[5, 6, 7, 8, 9, 0, 0], [10, 11, 12, 4, 0, 0, 0], [13, 14, 0, 0, 0, 0, 0]], np.int32)
TGT = np.array([[BOS, 5, 6, 7, 8, 9], [BOS, 10, 11, 12, 0, 0], [BOS, 13, 14, 15, 4, 0]], np.int32)


def _config(**overrides):
    # Three encoder layers, two decoder layers: stacks of different depths.
    return jf.preset("tiny", src_vocab_size=VOCAB, max_len=16,
                     **{"num_encoder_layers": 3, "num_decoder_layers": 2, **overrides})


def _unrolled_and_scanned(seed=0, **overrides):
    unrolled = jf.Transformer(_config(**overrides))
    variables = nn.unbox(unrolled.init(jax.random.key(seed), SRC, TGT))
    scanned = jf.Transformer(_config(scan_layers=True, **overrides))
    return unrolled, variables, scanned, scan.stack_layers(variables)


def test_scanned_model_equals_unrolled_forward_and_backward():
    """Logits and gradients; remat on, so the scanned body is rematerialised too."""
    unrolled, variables, scanned, stacked = _unrolled_and_scanned(remat=True)

    def loss(model, params):
        logits = model.apply({"params": params}, SRC, TGT)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 4]), logits

    def grads_and_logits(model, params):
        return jax.jit(jax.grad(lambda p: loss(model, p), has_aux=True))(params)

    grads, logits = grads_and_logits(unrolled, variables["params"])
    scanned_grads, scanned_logits = grads_and_logits(scanned, stacked["params"])
    # float32 round-off only: XLA fuses the scanned body differently from the unrolled one.
    np.testing.assert_allclose(scanned_logits, logits, rtol=1e-5, atol=1e-5)
    # Per leaf, relative to its own size and (for gradients that are 0 up to round-off,
    # the key biases') to the whole gradient's.
    floor = 1e-6 * float(optax.global_norm(grads))
    for path, want in jax.tree_util.tree_leaves_with_path(scan.stack_layers(grads)):
        got = scanned_grads
        for key in path:
            got = got[key.key]
        error = float(jnp.linalg.norm((got - want).ravel()))
        assert error <= 1e-5 * float(jnp.linalg.norm(want.ravel())) + floor, jax.tree_util.keystr(path)


def test_scanned_parameters_stack_on_a_replicated_layers_axis():
    _, variables, scanned, stacked = _unrolled_and_scanned()
    boxed = jax.eval_shape(scanned.init, jax.random.key(1), SRC, TGT)
    assert jax.tree_util.tree_structure(nn.unbox(boxed)) == jax.tree_util.tree_structure(stacked)
    kernel = nn.unbox(boxed)["params"]["encoder"]["layers"]["self_attention"]["query_kernel"]
    config = _config()
    assert kernel.shape == (3, config.d_model, config.num_heads, config.head_dim)
    P = jax.sharding.PartitionSpec
    spec = nn.get_partition_spec(boxed)["params"]["encoder"]["layers"]["self_attention"]["query_kernel"]
    assert spec == P("layers", "embed", "heads", "kv")
    # Round trips are exact, for arrays and for abstract trees with shardings.
    jax.tree_util.tree_map(np.testing.assert_array_equal, scan.unstack_layers(stacked), variables)
    assert scan.layout_of(stacked) and not scan.layout_of(variables)
    mesh = sharding.make_mesh("fsdp=4,model=2")
    abstract, layout = training.abstract_train_state(scanned, optax.adam(1e-3), mesh)
    kernel = layout.params["decoder"]["layers"]["cross_attention"]["key_kernel"]
    assert kernel.spec == P(None, "fsdp", "model", None)
    unstacked = scan.unstack_layers(abstract)
    assert unstacked.params["decoder"]["layer_1"]["cross_attention"]["key_kernel"].sharding.spec == P(
        "fsdp", "model", None)
    structure = jax.tree_util.tree_structure
    assert structure(scan.stack_layers(unstacked)) == structure(abstract)


def test_scanned_model_decodes_as_the_unrolled_one():
    """Every decoder enters through the same callback (``decoding._model_callback``), which
    unrolls a scanned model: one decoder shows it."""
    unrolled, variables, scanned, stacked = _unrolled_and_scanned(seed=3)
    kwargs = dict(max_decode_len=10, bos_id=BOS, eos_id=EOS, extra_len=50)
    seqs, scores = decoding.decode(scanned, stacked["params"], SRC, Beam(3), **kwargs)
    ref_seqs, ref_scores = decoding.decode(unrolled, variables["params"], SRC, Beam(3), **kwargs)
    np.testing.assert_array_equal(seqs, ref_seqs)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5)
    encoder_output = scanned.apply(stacked, SRC, method=jf.Transformer.encode)
    with pytest.raises(ValueError, match=r"scan_layers=True; decode with jaxformer.model.scan.unrolled"):
        scanned.apply(stacked, encoder_output, SRC, 8, method=jf.Transformer.init_cache)
    model, params = scan.unrolled(scanned, stacked)
    cache = model.apply(params, encoder_output, SRC, 8, method=jf.Transformer.init_cache)
    assert len(cache.layers) == 2   # decoder layers


def _restore(checkpoints, model, mesh_spec):
    target, layout = training.abstract_train_state(model, optax.adam(1e-3), sharding.make_mesh(mesh_spec))
    iterator = iter(grain.MapDataset.range(10).to_iter_dataset())
    return checkpoints.restore(1, target, iterator), layout


def _assert_same_state(got, want):
    """Step, parameters and Adam moments equal (not the states' model and optimizer objects)."""
    fields = lambda s: jax.device_get((s.step, s.params, s.opt_state))  # noqa: E731
    jax.tree_util.tree_map(np.testing.assert_array_equal, fields(got), fields(want))


def test_checkpoints_restore_across_layer_layouts_and_meshes(tmp_path):
    """An unrolled run's checkpoint resumes scanned (on an FSDP mesh), and back: train
    state (parameters and Adam moments) and the parameter-only paths (best, step)."""
    unrolled, scanned = jf.Transformer(_config()), jf.Transformer(_config(scan_layers=True))
    tx = optax.adam(1e-3)
    state, _ = training.create_sharded_train_state(unrolled, jax.random.key(5), tx,
                                                   sharding.make_mesh("data=4,model=2"))
    # Adam's moments and count as after some steps (zeros would hide a moment restored as zeros)
    state = state.replace(opt_state=jax.tree_util.tree_map(
        lambda x: x + jnp.asarray(0.75 if jnp.issubdtype(x.dtype, jnp.floating) else 3, x.dtype),
        state.opt_state))
    checkpoints = RunCheckpoints(tmp_path / "unrolled")
    checkpoints.save(1, state, iter(grain.MapDataset.range(10).to_iter_dataset()))
    checkpoints.save_best(1, state.params, 12.5)
    checkpoints.wait()
    expected = jax.device_get(scan.stack_layers(state))

    restored, layout = _restore(checkpoints, scanned, "fsdp=4,model=2")
    query = restored.params["encoder"]["layers"]["self_attention"]["query_kernel"]
    assert query.sharding == layout.params["encoder"]["layers"]["self_attention"]["query_kernel"]
    _assert_same_state(restored, expected)
    abstract_params = layout.state.params
    abstract_params = jax.tree_util.tree_map(
        lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params, restored.params)
    for kind in ("best", 1):   # parameters alone: the best checkpoint, a training step's
        params, _ = checkpoints.restore_params(abstract_params, kind)
        jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(params), expected.params)
    checkpoints.close()

    back = RunCheckpoints(tmp_path / "scanned")      # and a scanned run's checkpoint, unrolled
    back.save(1, restored, iter(grain.MapDataset.range(10).to_iter_dataset()))
    back.wait()
    again, _ = _restore(back, unrolled, "data=8")
    _assert_same_state(again, state)
    back.close()
