"""Lexically constrained beam search (issue 47) against plain beam search on the run's test split.

    python benchmarks/constrained.py --workdir runs/en-de               # the whole test split
    python benchmarks/constrained.py --workdir RUN --quick              # 16 sentences, 1 repeat: a check
    python benchmarks/constrained.py --workdir runs/en-de --write benchmarks/README.md

Constraints (one or two reference phrases per sentence, deterministic): the words of the
reference, punctuation stripped from their ends, of at least 5 characters; the longest
(the first of a tie) and, for a reference of 10 words or more, the second longest that
differs from it. A sentence whose reference has no such word gets none (and counts as
plain beam search).

Printed: test BLEU (sacrebleu, the run's target tokenizer) of plain beam search
and of constrained beam search at the same ``--beam-size``; the term success rate: the
phrases found verbatim in the translation, over all phrases, and the phrases as the run's
tokenizer writes them (its normalisation turns ``…`` into ``...``; a character it lacks
into ``⁇``), over the lines whose output limit can hold them; the notes; and the decode time
of each (``Translator.decode`` against ``Translator.constrained`` over the whole split, timed
in turns after one untimed call each, median of ``--repeats``) with its ratio, the goal
being ≤ 2×. Run it alone on the machine: the times are worth nothing beside other work.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from _common import alternating_median_seconds, matmul_flops_per_s, publish

MARKERS = ("<!-- constrained: begin -->", "<!-- constrained: end -->")


def reference_phrases(reference: str) -> list[str]:
    """The module docstring's rule: the longest reference word of ≥ 5 characters, and the
    second longest for a reference of ≥ 10 words."""
    words = [w.strip(".,;:!?\"'()[]{}«»„“”‚‘’-–—") for w in reference.split()]
    long = sorted(dict.fromkeys(w for w in words if len(w) >= 5), key=len, reverse=True)   # stable
    return long[: 2 if len(words) >= 10 else 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a trained run (its prepared/test.tsv split)")
    parser.add_argument("--beam-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sentences", type=int, default=None, help="the first N test pairs (default: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="16 sentences, 1 repeat")
    parser.add_argument("--write", help="put the table into this file (benchmarks/README.md) between markers")
    args = parser.parse_args()
    if args.quick:
        args.sentences, args.repeats = args.sentences or 16, 1

    from jaxformer.data.prepared import PreparedCorpus
    from jaxformer.decode.beam_search import Beam
    from jaxformer.decode.engine import Request
    from jaxformer.decode.evaluation import make_bleu
    from jaxformer.decode.translator import Translator
    from jaxformer.run.directory import RunDir

    pairs = PreparedCorpus.open(RunDir(args.workdir).prepared).held_out("test")[: args.sentences]
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
    phrases = [reference_phrases(t) for t in references]
    bleu = make_bleu(RunDir(args.workdir).read_run_record().get("target_language", "xx"))
    translator = Translator(args.workdir, batch_size=args.batch_size)
    beam = Beam(args.beam_size, translator.defaults["alpha"], translator.defaults["length_normalization"])
    request = Request(beam_size=args.beam_size, alpha=beam.alpha, early_stopping=False,
                      length_normalization=beam.length_normalization, no_repeat_ngram_size=0,
                      repetition_penalty=1.0, constraints=tuple(map(tuple, phrases)))   # the same beam
    outputs = {}

    def plain():
        outputs["plain"] = [n_best[0][0] for n_best in translator.decode(sources, beam)]

    def with_constraints():
        results = translator.translate(sources, request)
        outputs["notes"] = [f"line {i + 1}: {note}" for i, t in enumerate(results) for note in t.notes]
        outputs["constrained"] = [t.text for t in results]

    flops = matmul_flops_per_s(2048, 3)
    seconds = alternating_median_seconds([plain, with_constraints], args.repeats)
    noted = {int(note.split(":")[0].split()[1]) - 1 for note in outputs["notes"]
             if note.startswith("line ") and "output limit" in note}   # could not hold its phrases
    found = [[p in text for p in ps] for ps, text in zip(phrases, outputs["constrained"])]
    total, held = sum(map(len, found)), sum(map(sum, found))
    tokenizer = translator.tokenizer
    written = [tokenizer.decode(tokenizer.encode_target(ps)) if ps else [] for ps in phrases]
    fit = [[p in text for p in ps] for i, (ps, text) in enumerate(zip(written, outputs["constrained"]))
           if i not in noted]
    rows = []
    for name, key, time in (("beam", "plain", seconds[0]), ("constrained", "constrained", seconds[1])):
        score = bleu.corpus_score(outputs[key], [references]).score
        rows.append(f"| {name} {args.beam_size} | {score:.2f} | {time:.2f} s |")
    subset = f" --sentences {args.sentences}" if args.sentences else ""
    lines = [f"`python benchmarks/constrained.py --workdir runs/{Path(args.workdir).name} "
             f"--beam-size {args.beam_size}{subset}` "
             f"({datetime.date.today()}, "
             f"float32 2048³ matmul {flops / 1e9:.0f} GFLOP/s):", "",
             "| search | test BLEU | decode time |", "|---|---:|---:|", *rows, "",
             f"- {len(sources)} sentences, {total} phrases ({sum(1 for p in phrases if p)} with any)",
             f"- term success: {held}/{total} = {held / max(total, 1):.1%} of all phrases verbatim; "
             f"{sum(map(sum, fit))}/{sum(map(len, fit))} as the tokenizer writes them (its normalisation: "
             f"… as ..., ² as 2) on the lines whose limit holds them",
             f"- lines whose limit cannot hold their phrases: {len(noted)}; notes in all: "
             f"{len(outputs['notes'])}",
             f"- ratio constrained / plain decode time: {seconds[1] / seconds[0]:.2f}× (goal ≤ 2×)"]
    publish(lines, args.write, MARKERS)


if __name__ == "__main__":
    main()
