"""Decoding throughput: jaxformer greedy and beam 4 against Hugging Face ``generate``.

    python benchmarks/decode.py                # the issue's sizes, batch 32, ~3 minutes
    python benchmarks/decode.py --quick        # 1 repeat, no uncached runs
    python benchmarks/decode.py --no-hf        # jaxformer only
    python benchmarks/decode.py --no-hf --no-uncached --matmul-dtype bfloat16
                                               # float32 against bfloat16 weight matmuls

Model (both sides, random initialisation): D 256, 4 heads, F 1024, 3+3 layers, a
shared vocabulary of 8000 with tied output projection, post-norm, ReLU, sinusoidal
positions. Hugging Face side: ``MarianMTModel(MarianConfig(...))`` in eval mode under
``torch.inference_mode``, ``generate(max_new_tokens=L, min_new_tokens=L, num_beams=k,
do_sample=False)`` with its KV cache, ``torch.set_num_threads`` = the usable cores.

Output tokens/s = batch × out-len / seconds, encoder included (beam search counts the B
best outputs, not the B·k hypotheses). EOS never ends a sequence early, so every run
produces exactly out-len tokens: jaxformer gets an EOS id that is never produced;
``generate`` gets ``min_new_tokens`` = out-len. "Uncached" re-runs the teacher-forced
decoder over the whole prefix at every step (what implementations without a KV cache
do); "cached" is ``Transformer.decode_step`` with the explicit cache, cross-attention
K/V computed once. Timings are the median of --repeats runs after one warm-up run
(which compiles); the sides are timed in turns (jaxformer, HF, jaxformer, ...), so a
drift of the machine's speed hits both sides of a ratio alike.

Model FLOPs (analytic, as in ``train_step.py``; both sides do the same work), with
``k`` beams, output length M and a cache of M positions::

    encoder   = 2·B·S·(N_enc·(4D² + 2DF) + N_dec·2D²) + B·N_enc·4S²D
    per step  = 2·B·k·(N_dec·(6D² + 2DF) + D·V) + B·k·N_dec·(4MD + 4SD)
    total     = encoder + M · per step

The printed GFLOP/s and fraction of a float32 ``N×N`` matmul (``--matmul-size``)
show how far each decoder is from the machine's limit.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from _common import add_model_arguments, alternating_median_seconds, matmul_flops_per_s, usable_cores

import jaxformer as jf
from jaxformer.decode import decoding
from jaxformer.decode.strategies import Beam, Greedy
from jaxformer.model.matmul import cast_matmul_weights


@functools.partial(jax.jit, static_argnames=("model", "out_len", "beam_size", "cached"))
def run(model, params, src, *, out_len, beam_size, cached):
    make = decoding._model_callback if cached else decoding.uncached_model_callback
    tokens_to_logits, cache = make(model, params, src, out_len, beam_size)
    no_eos = model.config.tgt_vocab_size + 7       # an id never produced: EOS disabled
    common = dict(batch_size=src.shape[0], bos_id=2, eos_id=no_eos, pad_id=model.config.pad_id,
                  max_decode_len=out_len)
    strategy = Greedy() if beam_size == 1 else Beam(beam_size)
    return strategy.search(tokens_to_logits, cache, **common)[0]


def decode_flops(*, batch, beam, src_len, out_len, d_model, d_ff, vocab, layers) -> float:
    """Model FLOPs of one decode (the formula of the module docstring)."""
    d, f = d_model, d_ff
    encoder = (2 * batch * src_len * (layers * (4 * d * d + 2 * d * f) + layers * 2 * d * d)
               + batch * layers * 4 * src_len ** 2 * d)
    per_step = (2 * batch * beam * (layers * (6 * d * d + 2 * d * f) + d * vocab)
                + batch * beam * layers * (4 * out_len * d + 4 * src_len * d))
    return encoder + out_len * per_step


def hf_generate(args, src_np, beam_size: int):
    """``MarianMTModel.generate`` at the same sizes (random init), as a no-argument callable."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    config = MarianConfig(
        vocab_size=args.vocab, d_model=args.d_model, encoder_layers=args.layers,
        decoder_layers=args.layers, encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads, encoder_ffn_dim=args.d_ff, decoder_ffn_dim=args.d_ff,
        activation_function="relu", max_position_embeddings=max(args.src_len, args.out_len) + 2,
        scale_embedding=True, pad_token_id=0, eos_token_id=3, decoder_start_token_id=2,
        forced_eos_token_id=None, dropout=0.0)
    model = MarianMTModel(config).eval()
    src = torch.from_numpy(src_np).long()
    mask = torch.ones_like(src)

    def generate():
        with torch.inference_mode():
            out = model.generate(input_ids=src, attention_mask=mask, max_new_tokens=args.out_len,
                                 min_new_tokens=args.out_len, num_beams=beam_size, do_sample=False,
                                 num_return_sequences=1)
        # +1: generate returns the decoder start token too.
        assert out.shape == (args.batch, args.out_len + 1), out.shape
        return out

    return generate


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, batch=32)
    parser.add_argument("--out-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=usable_cores(), help="torch threads")
    parser.add_argument("--matmul-size", type=int, default=2048)
    parser.add_argument("--no-hf", action="store_true", help="skip Hugging Face transformers")
    parser.add_argument("--no-uncached", action="store_true", help="skip the uncached jaxformer runs")
    parser.add_argument("--quick", action="store_true", help="1 repeat and no uncached runs")
    parser.add_argument("--matmul-dtype", choices=("bfloat16", "float16"), default=None,
                        help="also time the cached decoder with its weight matmuls in this dtype "
                             "(jaxformer.model.matmul), in turns with the float32 one")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.no_uncached = 1, True
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    config = jf.TransformerConfig(
        src_vocab_size=args.vocab, tgt_vocab_size=args.vocab, d_model=args.d_model,
        num_heads=args.heads, d_ff=args.d_ff, num_encoder_layers=args.layers,
        num_decoder_layers=args.layers, dropout_rate=0.0, share_embeddings=True,
        norm_position="post", max_len=max(args.src_len, args.out_len))
    model = jf.Transformer(config)
    src_np = np.random.default_rng(0).integers(4, args.vocab, (args.batch, args.src_len)).astype(np.int32)
    src = jnp.asarray(src_np)
    params = jax.jit(model.init)(jax.random.key(0), src, src)["params"]
    print(f"config: {jax.devices()[0].platform}, D {config.d_model}, H {config.num_heads}, F {config.d_ff}, "
          f"{config.num_encoder_layers}+{config.num_decoder_layers} layers, shared vocab {args.vocab}, "
          f"batch {args.batch}, source {args.src_len}, {args.out_len} forced output tokens, "
          f"median of {args.repeats} after a warm-up, {usable_cores()} usable cores", flush=True)
    matmul = matmul_flops_per_s(args.matmul_size, max(args.repeats, 3))
    print(f"matmul f32 {args.matmul_size}^3 (jax): {matmul / 1e9:.1f} GFLOP/s", flush=True)
    results = {}

    def rate(beam, tokens_per_s):
        flops = decode_flops(batch=args.batch, beam=beam, src_len=args.src_len, out_len=args.out_len,
                             d_model=args.d_model, d_ff=args.d_ff, vocab=args.vocab, layers=args.layers)
        per_s = flops * tokens_per_s / (args.batch * args.out_len)
        return f"{flops / 1e9:5.1f} GFLOP, {per_s / 1e9:5.1f} GFLOP/s = {per_s / matmul:4.0%} of matmul"

    for beam in (1, 4):
        name = "greedy" if beam == 1 else f"beam {beam}"
        sides = {cached: functools.partial(run, model, params, src, out_len=args.out_len, beam_size=beam,
                                           cached=cached)
                 for cached in ((True, False) if not args.no_uncached else (True,))}
        if args.matmul_dtype:
            narrow = config.replace(matmul_dtype=args.matmul_dtype)
            sides[args.matmul_dtype] = functools.partial(
                run, jf.Transformer(narrow), cast_matmul_weights(params, narrow), src, out_len=args.out_len,
                beam_size=beam, cached=True)
        sides = {key: (lambda fn=fn: jax.block_until_ready(fn())) for key, fn in sides.items()}
        if not args.no_hf:
            try:
                sides["hf"] = hf_generate(args, src_np, beam)
            except ImportError as e:
                print(f"transformers: not installed ({e}); pip install '.[bench]'")
                args.no_hf = True
        # Timed in turns (jaxformer, HF, jaxformer, ...): the ratio survives a drifting machine.
        for key, seconds in zip(sides, alternating_median_seconds(list(sides.values()), args.repeats)):
            results[beam, key] = args.batch * args.out_len / seconds
            kind = {True: "cached", False: "uncached", args.matmul_dtype: args.matmul_dtype}.get(key)
            label = (f"jaxformer {name:7s} {kind:8s}" if key != "hf" else f"hf generate {name:7s}         ")
            print(f"{label} {seconds * 1000:8.1f} ms  {results[beam, key]:9.0f} output tokens/s"
                  + (f"  ({rate(beam, results[beam, key])})" if key is not False else ""), flush=True)
    for beam, target in ((1, 3.0), (4, 2.0)):
        name = "greedy" if beam == 1 else f"beam {beam}"
        if (beam, args.matmul_dtype) in results:
            print(f"{name}: jaxformer {args.matmul_dtype} / float32 weight matmuls = "
                  f"{results[beam, args.matmul_dtype] / results[beam, True]:.2f}x")
        if (beam, False) in results:
            print(f"{name}: jaxformer cached / uncached = {results[beam, True] / results[beam, False]:.1f}x")
        if (beam, "hf") in results:
            print(f"ratio {name}: jaxformer / transformers generate = "
                  f"{results[beam, True] / results[beam, 'hf']:.2f}x [target >= {target:.0f}x]")


if __name__ == "__main__":
    main()
