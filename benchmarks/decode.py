"""Decoding throughput: cached vs uncached, greedy and beam 4, in one run.

    python benchmarks/decode.py [--batch 32 --src-len 32 --out-len 32 --preset small]

Output tokens/s = batch × out-len / seconds (beam search counts the B best outputs,
not the B·k hypotheses). EOS is disabled so every run produces exactly out-len
tokens. "Uncached" re-runs the teacher-forced decoder over the whole prefix at every
step (what implementations without a KV cache do); "cached" is
``Transformer.decode_step`` with the explicit cache, cross-attention K/V computed once.
Timings are the median of --repeats runs after one compile run.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxformer as jf
from jaxformer import decoding


def uncached_callback(model, params, src_BS, max_decode_len, beam_size=1):
    """A ``tokens_to_logits`` whose "cache" is the token prefix: full decoder each step."""
    variables = {"params": params}
    encoder_output = model.apply(variables, src_BS, method=jf.Transformer.encode)
    state = {"tokens": jnp.full((src_BS.shape[0], max_decode_len), model.config.pad_id, jnp.int32),
             "encoder_output": encoder_output, "src": src_BS, "index": jnp.zeros((), jnp.int32)}
    if beam_size > 1:
        state = decoding.tile_beams(state, beam_size)

    def tokens_to_logits(ids_B1, state):
        tokens = jax.lax.dynamic_update_slice_in_dim(state["tokens"], ids_B1, state["index"], axis=1)
        # Causal masking makes the not-yet-written positions irrelevant to position index.
        logits = model.apply(variables, state["encoder_output"], state["src"], tokens,
                             method=jf.Transformer.decode)
        step_logits = jax.lax.dynamic_index_in_dim(logits, state["index"], axis=1, keepdims=False)
        return step_logits, dict(state, tokens=tokens, index=state["index"] + 1)

    return tokens_to_logits, state


@functools.partial(jax.jit, static_argnames=("model", "out_len", "beam_size", "cached"))
def run(model, params, src, *, out_len, beam_size, cached):
    make = decoding._model_callback if cached else uncached_callback
    tokens_to_logits, cache = make(model, params, src, out_len, beam_size)
    no_eos = model.config.tgt_vocab_size + 7       # an id never produced: EOS disabled
    common = dict(batch_size=src.shape[0], bos_id=2, eos_id=no_eos, pad_id=model.config.pad_id,
                  max_decode_len=out_len)
    if beam_size == 1:
        return decoding.greedy_search(tokens_to_logits, cache, **common)
    return decoding.beam_search(tokens_to_logits, cache, beam_size=beam_size, **common)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--out-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = jf.preset(args.preset, src_vocab_size=args.vocab, max_len=max(args.src_len, args.out_len))
    model = jf.Transformer(config)
    src = jnp.asarray(np.random.default_rng(0).integers(4, args.vocab, (args.batch, args.src_len)), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), src, src)["params"]
    print(f"{jax.devices()[0].platform}: preset {args.preset} (d_model {config.d_model}, "
          f"{config.num_encoder_layers}+{config.num_decoder_layers} layers), vocab {args.vocab}, "
          f"batch {args.batch}, source {args.src_len}, {args.out_len} forced output tokens")
    results = {}
    for beam in (1, 4):
        for cached in (True, False):
            fn = functools.partial(run, model, params, src, out_len=args.out_len, beam_size=beam,
                                   cached=cached)
            jax.block_until_ready(fn())
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(fn())
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            results[beam, cached] = args.batch * args.out_len / seconds
            name = "greedy" if beam == 1 else f"beam {beam}"
            print(f"{name:7s} {'cached' if cached else 'uncached':8s} {seconds * 1000:8.1f} ms  "
                  f"{results[beam, cached]:9.0f} output tokens/s", flush=True)
    for beam in (1, 4):
        print(f"{'greedy' if beam == 1 else f'beam {beam}'}: cached / uncached = "
              f"{results[beam, True] / results[beam, False]:.1f}x")


if __name__ == "__main__":
    main()
