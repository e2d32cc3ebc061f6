"""Translate with a trained run: ``python -m jaxformer.translate --workdir RUN "sentence"``.

Reads sentences from the arguments, or one per line from ``--input FILE`` or stdin,
and prints one translation per line in input order. Uses the best checkpoint by dev
BLEU (else the latest), the run's tokenizer and config.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from jaxformer.checkpoints import RunCheckpoints
from jaxformer.config import TransformerConfig
from jaxformer.data import Tokenizer
from jaxformer.model import Transformer
from jaxformer.training import create_train_state, make_optimizer, transformer_schedule


class Translator:
    """A trained model ready to translate: config, tokenizer and parameters of a run.

    Raises:
      FileNotFoundError: the run directory lacks ``config.json``, the tokenizer or a
        checkpoint.
    """

    def __init__(self, workdir: str | Path, batch_size: int = 32):
        from jaxformer.trainer import Evaluator

        workdir = Path(workdir)
        config_path = workdir / "config.json"
        if not config_path.exists():
            raise FileNotFoundError(f"{config_path} not found: is {str(workdir)!r} a jaxformer run "
                                    f"directory? Train one with `python train.py --workdir ...`.")
        record = json.loads(config_path.read_text())
        self.config = TransformerConfig.from_dict(record["model"])
        self.tokenizer = Tokenizer(workdir / record["tokenizer"]["file"])
        model = Transformer(self.config)
        tx = make_optimizer(transformer_schedule(self.config.d_model, 1))
        abstract_state = jax.eval_shape(lambda: create_train_state(model, jax.random.key(0), tx))
        checkpoints = RunCheckpoints(workdir)
        try:
            self.params, self.step, self.kind = checkpoints.restore_params(abstract_state)
        finally:
            checkpoints.close()
        self.evaluator = Evaluator(model, self.tokenizer, batch_size=batch_size,
                                   target_language=record.get("target_language", "xx"), smoothing=0.0)

    def __call__(self, sentences: list[str]) -> list[str]:
        """Translations of ``sentences``, in order (greedy decoding)."""
        return self.evaluator.translate(self.params, sentences)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="run directory written by train.py")
    parser.add_argument("--input", help="file with one sentence per line (default: stdin)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("sentences", nargs="*", help="sentences to translate")
    args = parser.parse_args(argv)
    translator = Translator(args.workdir, batch_size=args.batch_size)
    print(f"[{translator.kind} checkpoint, step {translator.step}]", file=sys.stderr)
    if args.sentences:
        lines = args.sentences
    else:
        stream = open(args.input, encoding="utf-8") if args.input else sys.stdin
        with stream:
            lines = [line.rstrip("\n") for line in stream]
    for translation in translator([line if line.strip() else "" for line in lines]):
        print(translation)


if __name__ == "__main__":
    main()
