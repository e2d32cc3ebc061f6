"""Loss, schedule, optimizer and train step (issue: the main job)."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxformer as jf
from jaxformer.train.losses import label_smoothed_cross_entropy, projected_cross_entropy
from jaxformer.train.optimizer import make_optimizer, make_schedule, transformer_schedule, wsd_schedule
from jaxformer.train.step import create_train_state, jit_train_step, train_step

# One layer per stack where what is tested does not depend on depth: each layer more
# costs tracing and compiling time (the pads test keeps two: masks through a second layer).
ONE_LAYER = dict(num_encoder_layers=1, num_decoder_layers=1)


@pytest.mark.parametrize("d_model,warmup", [(512, 4000), (256, 100)])
def test_schedule_matches_formula(d_model, warmup):
    schedule = transformer_schedule(d_model, warmup, scale=2.0)

    def formula(step):
        return 2.0 * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)

    # optax counts from 0: count c is the paper's step c + 1.
    for step in (1, warmup, 2 * warmup):
        np.testing.assert_allclose(float(schedule(step - 1)), formula(step), rtol=1e-6)
    assert float(schedule(0)) > 0.0, "the first update must not get learning rate 0"
    # Peak at the end of warmup.
    assert float(schedule(warmup - 1)) > float(schedule(warmup // 2))
    assert float(schedule(warmup - 1)) > float(schedule(2 * warmup))


def test_wsd_schedule_warms_up_holds_the_paper_peak_and_reaches_zero_at_the_budget():
    d_model, warmup, total = 128, 10, 100
    schedule = wsd_schedule(d_model, warmup, total, decay_fraction=0.2, scale=0.5)
    peak = 0.5 * d_model ** -0.5 * warmup ** -0.5   # Eq. 3 at the end of warm-up
    np.testing.assert_allclose(float(schedule(warmup - 1)),
                               float(transformer_schedule(d_model, warmup, 0.5)(warmup - 1)), rtol=1e-6)
    lrs = np.array([float(schedule(c)) for c in range(total)])
    np.testing.assert_allclose(lrs[:warmup], peak * np.arange(1, warmup + 1) / warmup, rtol=1e-6)
    np.testing.assert_allclose(lrs[warmup:80], peak, rtol=1e-6)                 # stable
    np.testing.assert_allclose(lrs[80:], peak * (total - np.arange(80, total)) / 20, rtol=1e-5)
    assert lrs[-1] == pytest.approx(peak / 20) and float(schedule(total)) == 0.0
    same = make_schedule("wsd", d_model=d_model, warmup_steps=warmup, total_steps=total, decay_fraction=0.2,
                         scale=0.5)
    assert [float(same(c)) for c in range(total)] == list(lrs)


@pytest.mark.parametrize("field, value, words", [
    ("decay_fraction", 0.0, "--decay-fraction must be > 0 and at most 1"),
    ("lr_schedule", "cosine", "--lr-schedule must be one of"),
    ("warmup_steps", 0, "--warmup-steps must be at least 1"),
    ("label_smoothing", 1.0, "--label-smoothing must be at least 0 and < 1"),
])
def test_schedule_and_loss_settings_are_checked_where_they_enter(field, value, words):
    """The schedules and losses trust their settings: the run's config checks them once."""
    from jaxformer.run.config import TrainConfig

    with pytest.raises(ValueError, match=re.escape(words)):
        TrainConfig.flat(**{field: value})


def _reference_smoothed_loss(logits, targets, smoothing):
    """Dense one-hot reference: KL(q || p) with q = (1-ε) on the target, ε/(V-1) elsewhere."""
    vocab = logits.shape[-1]
    log_p = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)), np.float64)
    q = np.full(logits.shape, smoothing / (vocab - 1))
    np.put_along_axis(q, targets[..., None], 1.0 - smoothing, axis=-1)
    return np.sum(q * (np.log(q) - log_p), axis=-1)


def test_label_smoothing_matches_dense_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5))
    weights = np.ones((2, 5), np.float32)
    loss_sum, nll_sum = label_smoothed_cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                                     jnp.asarray(weights), 0.1)
    np.testing.assert_allclose(float(loss_sum), _reference_smoothed_loss(logits, targets, 0.1).sum(),
                               rtol=1e-5)
    nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), targets[..., None], -1).sum()
    np.testing.assert_allclose(float(nll_sum), nll, rtol=1e-5)
    # A perfect prediction of the smoothed target has zero loss.
    q = np.full((1, 1, 11), 0.1 / 10)
    q[0, 0, 3] = 0.9
    perfect, _ = label_smoothed_cross_entropy(jnp.log(jnp.asarray(q, jnp.float32)), jnp.array([[3]]),
                                              jnp.ones((1, 1)), 0.1)
    assert abs(float(perfect)) < 1e-5


def test_pads_change_neither_loss_nor_smoothing_and_get_zero_gradient():
    """The loss with pads equals the loss computed without the pad positions."""
    config = jf.preset("tiny", src_vocab_size=17)
    model = jf.Transformer(config)
    pad = config.pad_id
    src = jnp.array([[5, 6, 7, 8]])
    tgt_in = jnp.array([[2, 9, 10]])
    tgt_out = jnp.array([[9, 10, 3]])
    params = model.init(jax.random.key(0), src, tgt_in)["params"]

    def loss(params, src, tgt_in, tgt_out):
        logits = model.apply({"params": params}, src, tgt_in)
        weights = (tgt_out != pad).astype(jnp.float32)
        return label_smoothed_cross_entropy(logits, tgt_out, weights, 0.1)[0]

    padded = lambda x, n: jnp.concatenate([x, jnp.full((1, n), pad, x.dtype)], axis=1)  # noqa: E731
    plain = loss(params, src, tgt_in, tgt_out)
    with_pads = loss(params, padded(src, 3), padded(tgt_in, 2), padded(tgt_out, 2))
    np.testing.assert_allclose(float(with_pads), float(plain), rtol=1e-6)

    # Pad positions get zero gradient: d loss / d logits at padded target rows is 0.
    logits = model.apply({"params": params}, padded(src, 3), padded(tgt_in, 2))
    tgt = padded(tgt_out, 2)
    grad = jax.grad(lambda lg: label_smoothed_cross_entropy(
        lg, tgt, (tgt != pad).astype(jnp.float32), 0.1)[0])(logits)
    assert np.all(np.asarray(grad[0, 3:]) == 0.0)
    assert np.any(np.asarray(grad[0, :3]) != 0.0)


def _unfused_loss(x, kernel, bias, targets, weights, smoothing):
    logits = jnp.einsum("BTD,DV->BTV", x, kernel) + (0.0 if bias is None else bias[None, None, :])
    loss_sum, nll_sum = label_smoothed_cross_entropy(logits, targets, weights, smoothing)
    reference = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    correct = jnp.sum((reference >= jnp.max(logits, axis=-1)) * weights)
    return loss_sum, nll_sum, correct


@pytest.mark.parametrize("smoothing,with_bias", [(0.1, True), (0.0, True), (0.2, False)])
def test_projected_cross_entropy_equals_projection_then_loss(smoothing, with_bias):
    """The fused custom-VJP loss: same values and gradients (x, kernel, bias, weights) for
    any mix of loss_sum and nll_sum cotangents, pads and repeated targets included."""
    keys = jax.random.split(jax.random.key(0), 4)
    batch, length, d_model, vocab = 3, 5, 8, 13
    x = jax.random.normal(keys[0], (batch, length, d_model))
    kernel = jax.random.normal(keys[1], (d_model, vocab))
    bias = jax.random.normal(keys[2], (vocab,)) if with_bias else None
    targets = jax.random.randint(keys[3], (batch, length), 0, vocab).at[0, :3].set(7)
    weights = jnp.ones((batch, length)).at[1, 3:].set(0.0).at[2, 0].set(0.5)

    fused = projected_cross_entropy(x, kernel, bias, targets, weights, smoothing)
    plain = _unfused_loss(x, kernel, bias, targets, weights, smoothing)
    for f, p in zip(fused, plain):
        np.testing.assert_allclose(float(f), float(p), rtol=1e-5)

    def combined(fn):   # a cotangent mix that exercises both differentiable outputs
        def objective(x, kernel, bias, weights):
            loss_sum, nll_sum, correct = fn(x, kernel, bias, targets, weights, smoothing)
            return 0.7 * loss_sum - 1.3 * nll_sum + correct
        return jax.grad(objective, argnums=(0, 1, 2, 3) if with_bias else (0, 1, 3))

    args = (x, kernel, bias, weights) if with_bias else (x, kernel, weights)
    wrap = (lambda fn: fn) if with_bias else (lambda fn: lambda x, k, w: fn(x, k, None, w))
    fused_grads = wrap(combined(projected_cross_entropy))(*args)
    plain_grads = wrap(combined(_unfused_loss))(*args)
    for f, p in zip(fused_grads, plain_grads):
        np.testing.assert_allclose(np.asarray(f), np.asarray(p), rtol=1e-4, atol=1e-5)
    # Padded rows get no gradient.
    assert np.all(np.asarray(fused_grads[0][1, 3:]) == 0.0)


def test_projected_cross_entropy_bfloat16_inputs():
    """bf16 activations and kernel: float32 results, gradients in the inputs' dtypes."""
    x = jax.random.normal(jax.random.key(0), (2, 4, 8), jnp.bfloat16)
    kernel = jax.random.normal(jax.random.key(1), (8, 11), jnp.bfloat16)
    targets, weights = jnp.full((2, 4), 5), jnp.ones((2, 4))
    out = projected_cross_entropy(x, kernel, None, targets, weights, 0.1)
    assert all(o.dtype == jnp.float32 for o in out)
    plain = _unfused_loss(x.astype(jnp.float32), kernel.astype(jnp.float32), None, targets, weights, 0.1)
    np.testing.assert_allclose(float(out[0]), float(plain[0]), rtol=2e-2)
    gx, gk = jax.grad(lambda x, k: projected_cross_entropy(x, k, None, targets, weights, 0.1)[0],
                      argnums=(0, 1))(x, kernel)
    assert gx.dtype == jnp.bfloat16 and gk.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(gx, np.float32)))


def _copy_batch(rng, batch, length, vocab, bos, eos, pad):
    body = rng.integers(4, vocab, (batch, length))
    src = body
    tgt_in = np.concatenate([np.full((batch, 1), bos), body], axis=1)
    tgt_out = np.concatenate([body, np.full((batch, 1), eos)], axis=1)
    src = np.concatenate([src, np.full((batch, 1), pad)], axis=1)
    return {k: jnp.asarray(v, jnp.int32) for k, v in
            dict(src=src, tgt_in=tgt_in, tgt_out=tgt_out).items()}


def test_copy_task_learns_in_seconds():
    """Teacher-forced copy task: next-token accuracy climbs to > 90% in 300 steps."""
    vocab, pad, bos, eos = 16, 0, 2, 3
    config = jf.preset("tiny", src_vocab_size=vocab, max_len=16, pad_id=pad, **ONE_LAYER)
    model = jf.Transformer(config)
    tx = make_optimizer(transformer_schedule(config.d_model, 50, scale=0.3))
    state = create_train_state(model, jax.random.key(0), tx)
    step = jit_train_step(model, smoothing=0.0)
    rng = np.random.default_rng(0)
    batches = [_copy_batch(rng, 32, 8, vocab, bos, eos, pad) for _ in range(300)]
    # 300 steps run 2x faster compiled at XLA's default optimization level (2) than at
    # the suite's level 0 (tests/conftest.py), and the compile takes no longer here.
    step = step.lower(state, batches[0], jax.random.key(1)).compile({"xla_backend_optimization_level": 2})
    for batch in batches:
        state, metrics = step(state, batch, jax.random.key(1))
    batch = _copy_batch(np.random.default_rng(1), 32, 8, vocab, bos, eos, pad)   # unseen, same shape
    state, metrics = step(state, batch, jax.random.key(1))
    accuracy = float(metrics["correct"] / metrics["tokens"])
    assert accuracy > 0.9, accuracy
    # Greedy decoding (cached) copies unseen sequences exactly.
    from jaxformer.decode.decoding import decode
    from jaxformer.decode.strategies import Greedy

    seqs, _ = decode(model, state.params, batch["src"][:16], Greedy(), max_decode_len=9, bos_id=bos,
                     eos_id=eos)
    out = seqs[:, 0]
    exact = np.mean(np.all(np.asarray(out) == np.asarray(batch["tgt_out"][:16]), axis=1))
    assert exact >= 0.8, exact


def test_train_step_traces_once_per_shape_and_donates():
    config = jf.preset("tiny", src_vocab_size=16, max_len=16, **ONE_LAYER)
    model = jf.Transformer(config)
    tx = make_optimizer(transformer_schedule(config.d_model, 10), grad_clip=1.0)
    state = create_train_state(model, jax.random.key(0), tx)
    from jaxformer.train import step as training

    traced = chex.assert_max_traces(training.train_step, n=2)
    step = jax.jit(functools.partial(traced, model=model, smoothing=0.1), donate_argnames=("state",))
    rng = np.random.default_rng(0)
    for length in (5, 5, 9, 9, 5):   # two shapes → two traces, never more
        old_params = state.params
        state, metrics = step(state, _copy_batch(rng, 4, length, 16, 2, 3, 0), jax.random.key(0))
    assert int(state.step) == 5
    assert jax.tree_util.tree_leaves(old_params)[0].is_deleted(), "state must be donated"
    assert np.isfinite(float(metrics["loss_sum"]))


def test_dropout_key_folds_in_step():
    """Same root key, different steps → different dropout; same step → same update."""
    config = jf.preset("tiny", src_vocab_size=16, max_len=16, dropout_rate=0.3, **ONE_LAYER)
    model = jf.Transformer(config)
    tx = optax.sgd(0.1)
    batch = _copy_batch(np.random.default_rng(0), 4, 5, 16, 2, 3, 0)
    state = create_train_state(model, jax.random.key(0), tx)
    step = jax.jit(functools.partial(train_step, model=model, smoothing=0.1))
    a, ma = step(state, batch, jax.random.key(7))
    b, mb = step(state, batch, jax.random.key(7))
    assert float(ma["loss_sum"]) == float(mb["loss_sum"])
    c, mc = step(state.replace(step=state.step + 1), batch, jax.random.key(7))
    assert float(ma["loss_sum"]) != float(mc["loss_sum"])


def test_non_finite_update_is_skipped_and_reported():
    """Forced overflow: huge weights make the logits inf, so loss and gradients are NaN.
    The guarded step leaves params and Adam state bit-identical, advances ``step`` and
    reports the skip; the metric sums stay finite."""
    config = jf.preset("tiny", src_vocab_size=16, max_len=16, **ONE_LAYER)
    model = jf.Transformer(config)
    tx = make_optimizer(transformer_schedule(config.d_model, 10))
    state = create_train_state(model, jax.random.key(0), tx)
    step = jit_train_step(model, smoothing=0.1)
    batch = _copy_batch(np.random.default_rng(0), 4, 6, 16, 2, 3, 0)
    state, metrics = step(state, batch, jax.random.key(1))   # one good update first
    assert float(metrics["skipped"]) == 0.0

    healthy = jax.tree_util.tree_map(jnp.copy, state)   # the step donates what it is given
    poisoned = state.replace(params=jax.tree_util.tree_map(lambda p: p * 1e30, state.params))
    params_before = jax.device_get(poisoned.params)
    opt_before = jax.device_get(poisoned.opt_state)
    new_state, metrics = step(poisoned, batch, jax.random.key(1))
    assert float(metrics["skipped"]) == 1.0 and float(metrics["steps"]) == 1.0
    assert int(new_state.step) == 2
    chex.assert_trees_all_equal(jax.device_get(new_state.params), params_before)
    chex.assert_trees_all_equal(jax.device_get(new_state.opt_state), opt_before)
    for name in ("loss_sum", "nll_sum", "tokens", "grad_norm"):
        assert float(metrics[name]) == 0.0, name

    # The same batch from the healthy state updates normally.
    _, metrics = step(healthy, batch, jax.random.key(1))
    assert float(metrics["skipped"]) == 0.0 and np.isfinite(float(metrics["loss_sum"]))


def test_each_run_builds_its_own_programs_from_its_settings():
    """``train()`` takes its model, optimizer and jitted programs from ``run_programs``: new
    objects for every run (nothing kept in the process), built from the settings they
    depend on; the restore target is the init's shapes, dtypes and shardings, and a
    fine-tune's start donates the loaded parameters into a fresh state."""

    from jaxformer.model.sharding import abstract_state, first_devices, make_mesh
    from jaxformer.run.config import TrainConfig
    from jaxformer.train.programs import run_programs

    config = jf.preset("tiny", src_vocab_size=40, max_len=16, **ONE_LAYER)
    cfg = TrainConfig.flat(preset="tiny", vocab_size=40, max_steps=100)
    one = run_programs(cfg, config, make_mesh(None, first_devices(1)))
    assert run_programs(cfg, config, make_mesh(None, first_devices(1))).train_step is not one.train_step
    assert float(one.schedule(0)) == float(transformer_schedule(config.d_model, cfg.train.warmup_steps)(0))
    wsd = run_programs(cfg.replace(lr_schedule="wsd"), config, make_mesh(None, first_devices(1)))
    assert float(wsd.schedule(99)) > 0.0 == float(wsd.schedule(100)), "a WSD decay ends on the step budget"
    two = run_programs(cfg.replace(grad_clip=1.0), config, make_mesh(None, first_devices(2)))
    initial = abstract_state(two.init(jax.random.key(0)))
    assert jax.tree_util.tree_structure(two.abstract_state) == jax.tree_util.tree_structure(initial)
    assert [(x.shape, x.dtype, x.sharding) for x in jax.tree_util.tree_leaves(two.abstract_state)] == \
        [(x.shape, x.dtype, x.sharding) for x in jax.tree_util.tree_leaves(initial)]
    assert two.num_params == sum(x.size for x in jax.tree_util.tree_leaves(initial.params))
    state = two.init(jax.random.key(0))   # a clipped optimizer on 2 devices
    loaded = jax.tree_util.tree_map(lambda x: x + 1.0, state.params)   # another run's weights
    expected = jax.tree_util.tree_map(np.array, state.replace(params=loaded))   # a copy (a view pins)
    started = two.start_from(loaded)
    jax.tree_util.tree_map(np.testing.assert_array_equal, started, expected)
    assert [(x.dtype, x.sharding) for x in jax.tree_util.tree_leaves(started)] == \
        [(x.dtype, x.sharding) for x in jax.tree_util.tree_leaves(state)]
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(loaded)), "the loaded params were copied"
