#!/usr/bin/env bash
# GPU/TPU check for issue #5 (not run in CI): times a bf16 train step of the paper's
# base model, prints tokens/s and MFU against the chip's peak, and checks that cuDNN
# flash attention agrees with the reference attention core.
#
#   bash benchmarks/gpu_check.sh                  # base preset, 25k-token batches (paper §5.1)
#   PRESET=tiny ROWS=64 LEN=32 bash benchmarks/gpu_check.sh   # a quick smoke run (also on CPU)
#   PEAK_TFLOPS=989 bash benchmarks/gpu_check.sh  # chip not in the table below
#
# MFU = (XLA's FLOP count of the compiled step) / (step time × peak bf16 FLOP/s of all
# local devices). The batch is split over every local device on the 'data' axis.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python - "$@" <<'PY'
import os, time
import jax, jax.numpy as jnp, numpy as np
import jaxformer as jf
from jaxformer.model import sharding
from jaxformer.train import step as training
from jaxformer.model.attention import fused_dot_product_attention

PEAK_TFLOPS = {"H100": 989, "H200": 989, "H800": 989, "GH200": 989, "A100": 312, "A10": 125,
               "L4": 121, "L40": 181, "B200": 2250, "TPU v4": 275, "TPU v5 lite": 197,
               "TPU v5e": 197, "TPU v5p": 459, "TPU v6 lite": 918, "TPU v6e": 918}
preset, vocab = os.environ.get("PRESET", "base"), int(os.environ.get("VOCAB", "37000"))
rows, length = int(os.environ.get("ROWS", "384")), int(os.environ.get("LEN", "64"))  # 384×64 ≈ 25k
steps = int(os.environ.get("STEPS", "10"))
device = jax.devices()[0]
on_gpu = device.platform == "gpu"
print(f"devices: {jax.device_count()} × {device.device_kind} ({device.platform}); jax {jax.__version__}")

# 1. cuDNN flash attention vs the reference core (bf16, padding and causal masks).
if on_gpu:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((8, 8, 128, 64)), jnp.bfloat16) for _ in range(3))
    lengths = rng.integers(1, 129, 8)
    pad = jnp.asarray(np.arange(128)[None, :] < lengths[:, None])[:, None, None, :]
    causal = jnp.tril(jnp.ones((128, 128), bool))[None, None] & pad
    for name, mask in (("padding", pad), ("causal+padding", causal)):
        ref, _ = jf.scaled_dot_product_attention(q, k, v, mask)
        out = jax.jit(lambda q, k, v, m: fused_dot_product_attention(q, k, v, m, implementation="cudnn"))(
            q, k, v, mask)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        print(f"cudnn vs reference attention ({name}): max |diff| {err:.4f}", "OK" if err < 2e-2 else "FAIL")
        assert err < 2e-2
else:
    print("cudnn attention check skipped: not a GPU")

# 2. A bf16 train step of the preset, params and Adam state in float32.
backend = "cudnn" if on_gpu else "xla"
config = jf.preset(preset, src_vocab_size=vocab, dtype="bfloat16", attention_backend=backend,
                   max_len=max(length, 64))
model = jf.Transformer(config)
tx = training.make_optimizer(training.transformer_schedule(config.d_model, 4000))
state, layout = training.create_sharded_train_state(model, jax.random.key(0), tx, sharding.make_mesh())
step = training.jit_train_step(model, 0.1, layout=layout)
rng = np.random.default_rng(0)
ids = rng.integers(4, vocab, (rows, length)).astype(np.int32)
batch = sharding.shard_batch({"src": ids, "tgt_in": ids, "tgt_out": ids}, layout.batch)
flops = (jax.jit(lambda s, b: training.train_step(s, b, jax.random.key(0), model=model, smoothing=0.1))
         .lower(state, batch).compile().cost_analysis() or {}).get("flops")
state, metrics = step(state, batch, jax.random.key(1))          # compile
jax.block_until_ready(metrics)
t0 = time.perf_counter()
for _ in range(steps):
    state, metrics = step(state, batch, jax.random.key(1))
jax.block_until_ready(metrics)
seconds = (time.perf_counter() - t0) / steps
tokens = rows * length   # target tokens per step (source tokens as many again)
print(f"{preset} bf16 ({backend} attention): {seconds * 1e3:.1f} ms/step, "
      f"{tokens / seconds:,.0f} target tokens/s, loss {float(metrics['loss_sum'] / metrics['tokens']):.3f}")
peak = os.environ.get("PEAK_TFLOPS") or next((v for k, v in PEAK_TFLOPS.items() if k in device.device_kind), None)
if flops and peak:
    mfu = flops / seconds / (float(peak) * 1e12 * jax.local_device_count())
    print(f"MFU {100 * mfu:.1f}% ({flops / 1e12:.2f} TFLOP/step by XLA's count, peak {peak} TFLOP/s per chip)")
else:
    print(f"MFU: unknown peak for {device.device_kind!r} (set PEAK_TFLOPS); XLA FLOPs/step {flops}")
PY
