"""What NLLB-200 distilled 600M costs on this CPU: sentences/s and peak memory of both
engines on the model's exact shape, with random weights (no download needed).

    python benchmarks/nllb_cpu.py                     # 32 sentences, greedy and beam 4
    python benchmarks/nllb_cpu.py --sentences 8       # a check

The model is ``interop.m2m100.config_from_hf`` of NLLB-200 600M's config (d_model 1024,
16 heads, d_ff 4096, 12+12 layers, a shared 256,206-piece table, fairseq positions),
float32. Random weights never choose when to stop, so every sentence is made to produce
exactly ``--tokens`` tokens (eos banned until then: JAX ``banned_ids`` with eos, CT2
``min_decoding_length``), from sources of ``--source-tokens`` random ids, in one batch of
``--sentences``. The cost per sentence is then what a translation of that length costs
(a real model's sentences stop at their own lengths). Each engine runs in its own
process: JAX (``decode()``, jitted, timed after one untimed call) and CTranslate2 (the
spec built by ``interop.ct2.transformer_spec`` in a process before, float32 and int8,
``inter_threads`` 1 × all cores, after a warm-up call). Peak RSS per process (``wait4``;
JAX's includes making the random parameters). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HF_CONFIG = {"vocab_size": 256_206, "d_model": 1024, "encoder_attention_heads": 16,
             "decoder_attention_heads": 16, "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096,
             "encoder_layers": 12, "decoder_layers": 12,
             "max_position_embeddings": 1024, "pad_token_id": 1, "activation_function": "relu",
             "dropout": 0.1, "attention_dropout": 0.1, "scale_embedding": True}
EOS, START = 2, 2   # NLLB: the decoder starts with </s>


def _model():
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    from jaxformer.interop.m2m100 import config_from_hf
    from jaxformer.model.transformer import Transformer

    config = config_from_hf(HF_CONFIG).replace(dropout_rate=0.0, attention_dropout_rate=0.0)
    model = Transformer(config)
    ids = jnp.ones((1, 4), jnp.int32)
    params = jax.jit(lambda: nn.unbox(model.init(jax.random.key(0), ids, ids)["params"]))()
    return config, model, params


def run_jax(spec: dict) -> dict:
    import jax
    import numpy as np

    from jaxformer.decode.decoding import decode
    from jaxformer.decode.strategies import Beam, Greedy

    config, model, params = _model()
    shape = (spec["sentences"], spec["source_tokens"])
    src = jax.numpy.asarray(np.random.default_rng(0).integers(4, 256_000, shape), jax.numpy.int32)
    out = {"parameters": sum(x.size for x in jax.tree_util.tree_leaves(params))}
    for beam in (1, 4):
        strategy = Greedy() if beam == 1 else Beam(beam, 1.0, "hf", True)
        def once(strategy=strategy):
            # eos banned (with pad and the start, which is eos here): exactly max_decode_len tokens
            return decode(model, params, src, strategy, bos_id=START, eos_id=EOS, banned_ids=(1, EOS),
                          max_decode_len=spec["tokens"])[0].block_until_ready()
        once()
        start = time.perf_counter()
        once()
        out[f"beam{beam}"] = spec["sentences"] / (time.perf_counter() - start)
    return out


def convert(spec: dict) -> dict:
    """The model as CTranslate2 float32 and int8 folders (``interop.ct2.transformer_spec``)."""
    import jax

    from jaxformer.interop.ct2 import _flatten, transformer_spec
    from jaxformer.model.scan import unstack_layers

    config, _, params = _model()
    flat = _flatten(unstack_layers(jax.device_get(params)))
    del params
    vocab = ["<s>", "<pad>", "</s>", "<unk>"] + [f"p{i}" for i in range(4, config.tgt_vocab_size)]
    for quantization in ("float32", "int8"):
        model_spec = transformer_spec(dict(flat), config)
        model_spec.register_source_vocabulary(vocab)
        model_spec.register_target_vocabulary(vocab)
        model_spec.config.bos_token = model_spec.config.eos_token = "</s>"
        model_spec.config.decoder_start_token, model_spec.config.unk_token = "</s>", "<unk>"
        model_spec.validate()
        model_spec.optimize(quantization=quantization)
        folder = Path(spec["out"]) / quantization
        folder.mkdir(parents=True, exist_ok=True)
        model_spec.save(str(folder))
    return {}


def run_ct2(spec: dict) -> dict:
    """The saved folder of ``spec["quantization"]`` through ``ctranslate2.Translator`` (no JAX)."""
    import ctranslate2
    import numpy as np

    folder = Path(spec["out"]) / spec["quantization"]
    translator = ctranslate2.Translator(str(folder), device="cpu", inter_threads=1,
                                        intra_threads=len(os.sched_getaffinity(0)))
    rng = np.random.default_rng(0)
    sources = [[f"p{i}" for i in rng.integers(4, 256_000, spec["source_tokens"])]
               for _ in range(spec["sentences"])]
    out = {}
    for beam in (1, 4):
        options = dict(beam_size=beam, min_decoding_length=spec["tokens"], max_decoding_length=spec["tokens"],
                       max_batch_size=spec["sentences"])
        translator.translate_batch(sources[:2], **options)   # warm
        start = time.perf_counter()
        translator.translate_batch(sources, **options)
        out[f"beam{beam}"] = spec["sentences"] / (time.perf_counter() - start)
    return out


def measured(spec: dict) -> dict:
    """``spec`` run in a child process: its result and peak RSS in GiB."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[1]),
                                                                  os.environ.get("PYTHONPATH"))))}
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                            env=env, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"failed: {spec}\n{output[-2000:]}")
    return {**json.loads(output.strip().splitlines()[-1]), "rss_gib": usage.ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=32)
    parser.add_argument("--source-tokens", type=int, default=25)
    parser.add_argument("--tokens", type=int, default=25, help="output tokens per sentence")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "jaxformer-nllb-cpu"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps({"jax": run_jax, "convert": convert, "ct2": run_ct2}[spec["engine"]](spec)))
        return
    common = dict(sentences=args.sentences, source_tokens=args.source_tokens, tokens=args.tokens,
                  out=args.out)
    from _common import matmul_flops_per_s

    gflops = matmul_flops_per_s(2048, 5) / 1e9
    rows = [("JAX float32", measured({**common, "engine": "jax"}))]
    measured({**common, "engine": "convert"})
    rows += [(f"CTranslate2 {q}", measured({**common, "engine": "ct2", "quantization": q}))
             for q in ("float32", "int8")]
    print(f"\n`python benchmarks/nllb_cpu.py --sentences {args.sentences} --source-tokens "
          f"{args.source_tokens} --tokens {args.tokens}` ({datetime.date.today()}, {os.cpu_count()} cores, "
          f"float32 2048³ matmul {gflops:.0f} GFLOP/s; NLLB-200 600M shape, "
          f"{rows[0][1]['parameters'] / 1e6:.0f}M parameters, random weights, {args.tokens} output tokens "
          f"per sentence, one batch of {args.sentences}):\n")
    print("| engine | greedy sentences/s | beam 4 sentences/s | peak RSS GiB |\n|---|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['beam1']:.2f} | {r['beam4']:.2f} | {r['rss_gib']:.1f} |")


if __name__ == "__main__":
    main()
