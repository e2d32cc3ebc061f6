"""Translate with a trained run: ``python -m jaxformer.translate --workdir RUN "sentence"``.

Reads sentences from the arguments, or one per line from ``--input FILE`` or stdin,
sorts them by length into batches, and prints one detokenized translation per line
in input order. Uses the best checkpoint by dev BLEU (else the latest), the run's
tokenizer and config. Decoding: beam search (``--beam-size``, default 4, GNMT
length penalty ``--alpha``), ``--n-best`` lists with scores, or ``--sample`` with
``--temperature/--top-k/--top-p``. ``--attention-png`` draws the cross-attention of
the first sentence.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxformer.checkpoints import RunCheckpoints
from jaxformer.config import TransformerConfig
from jaxformer.evaluation import Evaluator
from jaxformer.model import Transformer
from jaxformer.tokenizer import load_tokenizer


class Translator:
    """A trained model ready to translate: config, tokenizer and parameters of a run.

    Raises:
      FileNotFoundError: the run directory lacks ``config.json``, the tokenizer or a
        checkpoint.
    """

    def __init__(self, workdir: str | Path, batch_size: int = 32):
        workdir = Path(workdir)
        config_path = workdir / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{config_path} not found: is {str(workdir)!r} a jaxformer run "
                                    f"directory? Train one with `python train.py --workdir ...`.")
        record = json.loads(config_path.read_text())
        self.config = TransformerConfig.from_dict(record["model"])
        self.tokenizer = load_tokenizer(workdir, record)
        self.model = Transformer(self.config)
        ids = jnp.ones((1, 8), jnp.int32)
        # Restore onto one device, whatever mesh the run was trained on.
        one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract_params = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
            jax.eval_shape(lambda: nn.unbox(self.model.init(jax.random.key(0), ids, ids)["params"])))
        checkpoints = RunCheckpoints(workdir, read_only=True)
        try:
            self.params, self.step, self.kind = checkpoints.restore_params(abstract_params)
        finally:
            checkpoints.close()
        self.evaluator = Evaluator(self.model, self.tokenizer, batch_size=batch_size,
                                   target_language=record.get("target_language", "xx"), smoothing=0.0)
        # Decoding defaults: an imported model's generation_config (jaxformer.convert), else §6.1.
        generation = record.get("generation", {})
        self.defaults = {"beam_size": generation.get("beam_size", 4),
                         "alpha": generation.get("length_penalty", 0.6),
                         "length_normalization": generation.get("length_normalization", "gnmt")}

    def _options(self, beam_size, alpha, length_normalization):
        chosen = dict(beam_size=beam_size, alpha=alpha, length_normalization=length_normalization)
        return {k: self.defaults[k] if v is None else v for k, v in chosen.items()}

    def __call__(self, sentences: list[str], *, beam_size: int | None = None, alpha: float | None = None,
                 length_normalization: str | None = None) -> list[str]:
        """Best translations of ``sentences``, in order (``beam_size=1`` = greedy); options
        left ``None`` take the run's defaults (:attr:`defaults`)."""
        return self.evaluator.translate(self.params, sentences,
                                        **self._options(beam_size, alpha, length_normalization))

    def n_best(self, sentences: list[str], *, beam_size: int | None = None, alpha: float | None = None,
               length_normalization: str | None = None):
        """``beam_size`` (translation, score) pairs per sentence, best first."""
        return self.evaluator.translate_n_best(self.params, sentences,
                                               **self._options(beam_size, alpha, length_normalization))

    def sample(self, sentences: list[str], *, seed: int = 0, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None) -> list[str]:
        return self.evaluator.sample(self.params, sentences, jax.random.key(seed),
                                     temperature=temperature, top_k=top_k, top_p=top_p)

    def cross_attention(self, source: str, translation: str, layer: int | None = None,
                        head: int | None = None):
        """Cross-attention weights of one sentence pair, teacher-forced.

        Args:
          layer: decoder layer index, or ``None`` = average over layers.
          head: head index, or ``None`` = average over heads.

        Returns:
          ``(weights [T, S] float32, source pieces [S], target pieces [T])``.
        """
        tok = self.tokenizer
        src_ids = tok.encode_source([source])[0][: self.config.max_len]
        tgt_ids = tok.encode_target([translation])[0][: self.config.max_len - 1]
        src = jnp.asarray([src_ids], jnp.int32)
        tgt_in = jnp.asarray([[tok.bos_id, *tgt_ids]], jnp.int32)
        _, state = self.model.apply({"params": self.params}, src, tgt_in, mutable=["intermediates"])
        layers = state["intermediates"]["decoder"]
        stack = np.stack([np.asarray(layers[f"layer_{i}"]["cross_attention"]["attention_weights"][0][0])
                          for i in range(self.config.num_decoder_layers)])      # [N, H, T, S]
        stack = stack.mean(axis=0) if layer is None else stack[layer]
        weights = stack.mean(axis=0) if head is None else stack[head]
        src_pieces = tok.source_pieces(src_ids)
        tgt_pieces = tok.target_pieces([*tgt_ids, tok.eos_id])
        return weights, src_pieces, tgt_pieces


def save_attention_png(path: str | Path, weights, src_pieces, tgt_pieces, title: str = "") -> None:
    """Heat map of cross-attention ``weights [T, S]``: source pieces × target pieces."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height, width = weights.shape
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * width + 2), max(3, 0.4 * height + 1.5)))
    image = ax.imshow(weights, cmap="viridis", aspect="auto", vmin=0.0)
    ax.set_xticks(range(width), src_pieces, rotation=90)
    ax.set_yticks(range(height), tgt_pieces[:height])
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    ax.set_title(title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="run directory written by train.py")
    parser.add_argument("--input", help="file with one sentence per line (default: stdin)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--beam-size", type=int, default=None,
                        help="1 = greedy (default: the run's, else 4)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="length penalty exponent (default: the run's, else 0.6)")
    parser.add_argument("--length-normalization", choices=("gnmt", "hf"), default=None,
                        help="gnmt: ((5+|Y|)/6)^alpha (paper); hf: |Y|^alpha with Hugging Face "
                             "generate's stopping rule (default: the run's, else gnmt)")
    parser.add_argument("--n-best", type=int, default=1,
                        help="print this many hypotheses per sentence with scores (<= beam size)")
    parser.add_argument("--sample", action="store_true", help="sample instead of beam search")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0, help="rng seed for --sample")
    parser.add_argument("--attention-png", help="write the first sentence's cross-attention heat map")
    parser.add_argument("--layer", type=int, default=None, help="decoder layer for the heat map "
                        "(default: mean over layers)")
    parser.add_argument("--head", type=int, default=None, help="head for the heat map (default: mean)")
    parser.add_argument("sentences", nargs="*", help="sentences to translate")
    args = parser.parse_args(argv)
    if (args.beam_size is not None and args.beam_size < 1) or args.n_best < 1 \
            or (args.beam_size is not None and args.n_best > args.beam_size):
        parser.error("need --beam-size >= 1 and 1 <= --n-best <= --beam-size")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    if args.sample and (args.temperature <= 0 or (args.top_k is not None and args.top_k < 1)
                        or (args.top_p is not None and not 0 < args.top_p <= 1)):
        parser.error("sampling needs --temperature > 0, --top-k >= 1 and 0 < --top-p <= 1")
    if args.input and not Path(args.input).is_file():
        parser.exit(2, f"{parser.prog}: error: --input file {args.input!r} does not exist\n")
    if args.attention_png and not Path(args.attention_png).absolute().parent.is_dir():
        parser.exit(2, f"{parser.prog}: error: the folder of --attention-png {args.attention_png!r} "
                       f"does not exist\n")
    try:
        translator = Translator(args.workdir, batch_size=args.batch_size)
    except (ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    for flag, value, count in (("--layer", args.layer, translator.config.num_decoder_layers),
                               ("--head", args.head, translator.config.num_heads)):
        if value is not None and not 0 <= value < count:
            parser.exit(2, f"{parser.prog}: error: {flag} {value} is out of range; this model has "
                           f"{count} (0..{count - 1})\n")
    print(f"[{translator.kind} checkpoint, step {translator.step}]", file=sys.stderr)
    if args.sentences:
        lines = args.sentences
    else:
        stream = open(args.input, encoding="utf-8") if args.input else sys.stdin
        with stream:
            lines = [line.rstrip("\n") for line in stream]
    # Empty lines stay empty (and keep the output aligned with the input).
    todo = [i for i, line in enumerate(lines) if line.strip()]
    sources = [lines[i] for i in todo]
    too_long = sum(len(ids) > translator.config.max_len
                   for ids in translator.tokenizer.encode_source(sources))
    if too_long:
        print(f"warning: {too_long} sentence(s) longer than max_len={translator.config.max_len} tokens "
              f"were truncated to it", file=sys.stderr)

    def aligned(values, empty):
        out = [empty] * len(lines)
        for i, value in zip(todo, values):
            out[i] = value
        return out

    if args.sample:
        outputs = aligned(translator.sample(sources, seed=args.seed, temperature=args.temperature,
                                            top_k=args.top_k, top_p=args.top_p), "")
        print("\n".join(outputs))
    elif args.n_best > 1:
        results = aligned(translator.n_best(sources, beam_size=args.beam_size, alpha=args.alpha,
                                            length_normalization=args.length_normalization), [])
        for i, n_best in enumerate(results):
            for translation, score in n_best[: args.n_best]:
                print(f"{i}\t{score:.4f}\t{translation}")
        outputs = [n_best[0][0] if n_best else "" for n_best in results]
    else:
        outputs = aligned(translator(sources, beam_size=args.beam_size, alpha=args.alpha,
                                     length_normalization=args.length_normalization), "")
        print("\n".join(outputs))
    if args.attention_png and sources:
        weights, src_pieces, tgt_pieces = translator.cross_attention(sources[0], outputs[todo[0]],
                                                                     args.layer, args.head)
        which = (f"layer {args.layer}" if args.layer is not None else "mean of layers") + ", " + \
                (f"head {args.head}" if args.head is not None else "mean of heads")
        save_attention_png(args.attention_png, weights, src_pieces, tgt_pieces,
                           title=f"cross-attention ({which})")
        print(f"wrote {args.attention_png}", file=sys.stderr)


if __name__ == "__main__":
    main()
