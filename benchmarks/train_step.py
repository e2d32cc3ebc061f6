"""Train-step throughput: jaxformer vs PyTorch ``nn.Transformer``, against the matmul limit.

    python benchmarks/train_step.py                 # the issue's config, ~3 minutes on 2 cores
    python benchmarks/train_step.py --quick         # one short round, to check that it runs
    python benchmarks/train_step.py --skip-torch    # JAX only (no torch installed)

One command on one machine, in ``--rounds`` alternating rounds (3 by default) of the
three measurements below; each ratio is taken within a round and the median over
rounds is reported, so a drift of the machine's speed hits both sides alike:

1. the machine's limit: float32 ``jnp.dot`` of two ``N×N`` matrices (``--matmul-size``,
   2048 by default), ``2·N³`` FLOPs, median of ``--matmul-repeats`` runs;
2. jaxformer's jitted, donated ``train_step`` (Adam, label smoothing 0.1, dropout 0.1):
   lower+compile time of the first step, then the median of ``--steps`` steps after
   ``--warmup`` steps, each timed to ``block_until_ready``;
3. the same model in PyTorch: ``nn.Transformer`` (post-norm, ``norm_first=False``,
   ReLU, ``batch_first``) with separate source and target ``nn.Embedding`` × √D,
   sinusoidal positions, a ``Linear`` output projection,
   ``CrossEntropyLoss(label_smoothing=0.1, ignore_index=pad)``, Adam, the same batch,
   ``torch.set_num_threads`` = the cores this process may use. It runs in a
   subprocess (one per round), so each side's peak RSS is its own.

Both sides get the same sizes (default: D 256, 4 heads, F 1024, 3+3 layers, V 8000,
B 64, S = T = 32, no padding) and the same kind of dropout: residual and embedding
dropout and dropout on the attention weights (torch's default). ``nn.Transformer``
also has a final LayerNorm per stack and dropout inside the FFN; jaxformer has
neither (a negligible share of the FLOPs, not counted).

Model FLOPs, counted analytically (the same count for both sides; embedding lookups,
softmax, LayerNorm, dropout and the optimizer update are not counted)::

    forward = 2·B·S·P_src + 2·B·T·P_tgt + B·A
      P_src = N_enc·(4D² + 2DF) + N_dec·2D²       # encoder layers; cross-attention K,V
                                                  # projections of every decoder layer
      P_tgt = N_dec·(4D² + 2D² + 2DF) + D·V       # self-attn QKVO, cross-attn Q and O,
                                                  # FFN, output projection
      A     = N_enc·4S²D + N_dec·(4T²D + 4TSD)    # QKᵀ and weights·V; the full T×T
                                                  # matrix, as computed (causal masking
                                                  # does not skip work)
    train step = 3 × forward                      # backward = 2 × forward

Target tokens/s = B·T / step time (every target position is a real token here).
"fraction of matmul" = model FLOP/s / the measured matmul FLOP/s. On an accelerator
``--peak-tflops`` (or a known chip name) adds MFU against the chip's bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

from _common import add_model_arguments, matmul_flops_per_s, usable_cores

# Known bf16 dense peaks (TFLOP/s), for MFU on accelerators.
KNOWN_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "TPU v4": 275.0,
                     "TPU v5e": 197.0, "TPU v5p": 459.0}


def model_flops(*, batch, src_len, tgt_len, d_model, d_ff, vocab, enc_layers, dec_layers):
    """(forward FLOPs, train-step FLOPs) per batch; the formula of the module docstring."""
    d, f = d_model, d_ff
    p_src = enc_layers * (4 * d * d + 2 * d * f) + dec_layers * 2 * d * d
    p_tgt = dec_layers * (6 * d * d + 2 * d * f) + d * vocab
    attention = (enc_layers * 4 * src_len ** 2 * d
                 + dec_layers * (4 * tgt_len ** 2 * d + 4 * tgt_len * src_len * d))
    forward = 2 * batch * src_len * p_src + 2 * batch * tgt_len * p_tgt + batch * attention
    return forward, 3 * forward


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB.

    Linux's ``VmHWM`` first: ``getrusage``'s ``ru_maxrss`` survives ``exec``, so a
    subprocess would report its parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def make_batch(args, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    # Ids >= 4 avoid pad/unk/bos/eos: every position is a real token.
    src = rng.integers(4, args.vocab, (args.batch, args.src_len)).astype(np.int32)
    tgt = rng.integers(4, args.vocab, (args.batch, args.tgt_len + 1)).astype(np.int32)
    return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


# ---------------------------------------------------------------------- JAX


def run_jax(args) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxformer as jf
    from jaxformer.train.optimizer import make_optimizer, transformer_schedule
    from jaxformer.train.step import create_train_state, jit_train_step

    config = jf.TransformerConfig(
        src_vocab_size=args.vocab, tgt_vocab_size=args.vocab, d_model=args.d_model,
        num_heads=args.heads, d_ff=args.d_ff, num_encoder_layers=args.layers,
        num_decoder_layers=args.layers, dropout_rate=args.dropout,
        attention_dropout_rate=args.attention_dropout, max_len=max(args.src_len, args.tgt_len),
        share_embeddings=False, norm_position="post", dtype=args.dtype)
    model = jf.Transformer(config)
    tx = make_optimizer(transformer_schedule(config.d_model, 4000))
    state = create_train_state(model, jax.random.key(0), tx, example_shape=(1, 8))
    params = sum(x.size for x in jax.tree_util.tree_leaves(state.params))
    batch = {k: jnp.asarray(v) for k, v in make_batch(args).items()}
    rng = jax.random.key(1)
    step = jit_train_step(model, 0.1)

    start = time.perf_counter()
    compiled = step.lower(state, batch, rng).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    state, metrics = compiled(state, batch, rng)
    jax.block_until_ready(metrics)
    first_run_s = time.perf_counter() - start
    for _ in range(args.warmup):
        state, metrics = compiled(state, batch, rng)
    jax.block_until_ready(metrics)
    carry = {"state": state}

    def timed_round() -> dict:
        """Median of --steps synced steps, then the same steps without a sync after each
        (the training loop's real pattern)."""
        state, times = carry["state"], []
        for _ in range(args.steps):
            start = time.perf_counter()
            state, metrics = compiled(state, batch, rng)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(args.steps):
            state, metrics = compiled(state, batch, rng)
        jax.block_until_ready((state, metrics))
        carry["state"] = state
        return {"step_s": statistics.median(times),
                "pipelined_step_s": (time.perf_counter() - start) / args.steps,
                "loss": float(metrics["loss_sum"]) / float(metrics["tokens"])}

    return {"compile_s": compile_s, "first_run_s": first_run_s, "params": int(params),
            "device": f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind})"}, timed_round


# ---------------------------------------------------------------------- PyTorch
def run_torch(args) -> dict:
    import numpy as np
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    d, pad = args.d_model, 0

    class TorchTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.src_embedding = nn.Embedding(args.vocab, d)
            self.tgt_embedding = nn.Embedding(args.vocab, d)
            length = max(args.src_len, args.tgt_len)
            position = np.arange(length)[:, None] / np.power(10000.0, np.arange(0, d, 2) / d)
            table = np.zeros((length, d), np.float32)
            table[:, 0::2], table[:, 1::2] = np.sin(position), np.cos(position)
            self.register_buffer("positions", torch.from_numpy(table)[None])
            self.dropout = nn.Dropout(args.dropout)
            self.transformer = nn.Transformer(
                d_model=d, nhead=args.heads, num_encoder_layers=args.layers,
                num_decoder_layers=args.layers, dim_feedforward=args.d_ff, dropout=args.dropout,
                batch_first=True, norm_first=False)
            self.output_projection = nn.Linear(d, args.vocab)

        def embed(self, table, ids):
            x = table(ids) * math.sqrt(d) + self.positions[:, : ids.shape[1]]
            return self.dropout(x)

        def forward(self, src, tgt):
            causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
            out = self.transformer(
                self.embed(self.src_embedding, src), self.embed(self.tgt_embedding, tgt),
                tgt_mask=causal, src_key_padding_mask=src == pad, tgt_key_padding_mask=tgt == pad,
                memory_key_padding_mask=src == pad, tgt_is_causal=True)
            return self.output_projection(out)

    model = TorchTransformer().train()
    params = sum(p.numel() for p in model.parameters())
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1, ignore_index=pad)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    batch = {k: torch.from_numpy(v).long() for k, v in make_batch(args).items()}

    def step():
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch["src"], batch["tgt_in"])
        loss = loss_fn(logits.reshape(-1, args.vocab), batch["tgt_out"].reshape(-1))
        loss.backward()
        optimizer.step()
        return loss

    start = time.perf_counter()
    step()
    first_run_s = time.perf_counter() - start
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "first_run_s": first_run_s, "params": int(params),
            "loss": float(loss), "peak_rss_mib": peak_rss_mib(), "threads": torch.get_num_threads(),
            "version": torch.__version__}


# ---------------------------------------------------------------------- report
def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=64)
    parser.add_argument("--tgt-len", type=int, default=32)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1,
                        help="jaxformer's dropout on attention weights (torch always applies --dropout)")
    parser.add_argument("--dtype", default="float32", help="jaxformer compute dtype")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--matmul-repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=usable_cores(), help="torch threads")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="accelerator bf16 peak for MFU (default: looked up from the device kind)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating matmul / jaxformer / torch rounds (ratios: their median)")
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 steps, 1 warm-up, 3 matmuls")
    parser.add_argument("--only", choices=("torch",), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.matmul_repeats, args.rounds = 3, 1, 3, 1
    for name in ("steps", "rounds", "matmul_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    if args.only == "torch":               # the subprocess half: one JSON line
        print(json.dumps(run_torch(args)))
        return

    _, train_flops = model_flops(batch=args.batch, src_len=args.src_len, tgt_len=args.tgt_len,
                                 d_model=args.d_model, d_ff=args.d_ff, vocab=args.vocab,
                                 enc_layers=args.layers, dec_layers=args.layers)
    tokens = args.batch * args.tgt_len
    print(f"config: D {args.d_model}, H {args.heads}, F {args.d_ff}, {args.layers}+{args.layers} layers, "
          f"V {args.vocab}, B {args.batch}, S {args.src_len}, T {args.tgt_len}, dropout {args.dropout} "
          f"(attention {args.attention_dropout}), label smoothing 0.1, Adam, post-norm, "
          f"dtype {args.dtype}; {args.rounds} rounds, each the median of {args.steps} steps "
          f"(after {args.warmup} warm-up); "
          f"{usable_cores()} usable cores", flush=True)
    print(f"model FLOPs per train step (analytic, 3 x forward): {train_flops / 1e9:.2f} GFLOP", flush=True)

    import jax

    info, jax_round = run_jax(args)
    print(f"jaxformer  [{info['device']}, jax {jax.__version__}, {info['params'] / 1e6:.2f}M params]: "
          f"compile {info['compile_s']:.1f}s, first step {info['first_run_s']:.2f}s", flush=True)
    peak = args.peak_tflops or next((v for k, v in KNOWN_PEAK_TFLOPS.items()
                                     if k.lower() in info["device"].lower()), None)
    command = [sys.executable, os.path.abspath(__file__), "--only", "torch"] + sys.argv[1:]
    ratios, fractions, torch_failed = [], [], args.skip_torch
    # Rounds alternate the three measurements, so a drift of this machine's speed
    # (often 10-20% within minutes on shared VMs) hits both sides of each ratio alike.
    for round_index in range(1, args.rounds + 1):
        matmul = matmul_flops_per_s(args.matmul_size, args.matmul_repeats)
        j = jax_round()
        jax_flops = train_flops / j["step_s"]
        fractions.append(jax_flops / matmul)
        print(f"round {round_index}: matmul f32 {args.matmul_size}^3 (jax) {matmul / 1e9:.1f} GFLOP/s | "
              f"jaxformer step {j['step_s'] * 1000:.0f} ms ({j['pipelined_step_s'] * 1000:.0f} ms without "
              f"per-step sync), {tokens / j['step_s']:.0f} target tokens/s, {jax_flops / 1e9:.1f} GFLOP/s "
              f"= {jax_flops / matmul:.0%} of matmul, loss {j['loss']:.2f}", flush=True)
        if peak and jax.devices()[0].platform != "cpu":
            print(f"         jaxformer MFU vs bf16 peak {peak:.0f} TFLOP/s: {jax_flops / (peak * 1e12):.1%}")
        if torch_failed:
            continue
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
            print(f"torch: failed ({last}); install the bench extra: pip install '.[bench]'")
            torch_failed = True
            continue
        t = json.loads(done.stdout.strip().splitlines()[-1])
        torch_flops = train_flops / t["step_s"]
        ratios.append(t["step_s"] / j["step_s"])
        print(f"         torch [{t['version']}, {t['threads']} threads, {t['params'] / 1e6:.2f}M params] "
              f"step {t['step_s'] * 1000:.0f} ms, {tokens / t['step_s']:.0f} target tokens/s, "
              f"{torch_flops / 1e9:.1f} GFLOP/s = {torch_flops / matmul:.0%} of matmul, "
              f"loss {t['loss']:.2f}, "
              f"first step {t['first_run_s']:.2f}s, peak RSS {t['peak_rss_mib']:.0f} MiB (its own process) "
              f"| ratio {ratios[-1]:.2f}x", flush=True)
    print(f"jaxformer peak RSS {peak_rss_mib():.0f} MiB")
    listed = lambda xs, fmt: ", ".join(format(x, fmt) for x in xs)  # noqa: E731
    if ratios:
        print(f"ratio jax/torch (target tokens/s), median of {len(ratios)} rounds: "
              f"{statistics.median(ratios):.2f}x ({listed(ratios, '.2f')}) [target >= 1.3x]")
    print(f"jax fraction of matmul, median of {len(fractions)} rounds: {statistics.median(fractions):.0%} "
          f"({listed(fractions, '.0%')}) [target >= 55%]")


if __name__ == "__main__":
    main()
