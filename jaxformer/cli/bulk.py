"""The translate tool's bulk mode (``--input FILE --output FILE``):
:func:`jaxformer.decode.bulk.translate_file`, each chunk decoded by the tool's line
translator. With several processes (``--coordinator-address``/``--num-processes``/
``--process-id``, or ``--distributed``) each decodes its share of the chunks on its own
devices into ``OUTPUT.parts/`` on a shared filesystem, and process 0 joins the file;
only process 0 writes JAX's compilation cache, so the others compile on every run.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from pathlib import Path

from jaxformer.cli import constraint_files, fail, warn_replaced
from jaxformer.cli.translate_flags import PROG
from jaxformer.decode import bulk
from jaxformer.decode.engine import Engine

# Everything a chunk's bytes depend on, recorded in the manifest: a resume with other
# values is refused (the process count is not among them: it does not change a byte).
SETTINGS = ("beam_size", "alpha", "length_normalization", "early_stopping", "max_len_a", "max_len_b",
            "no_repeat_ngram_size", "repetition_penalty", "n_best", "sample", "temperature", "top_k",
            "top_p", "seed", "batch_size", "long_lines", "mesh", "matmul_dtype")


def bulk_mode(args) -> bool:
    """Whether the flags ask for bulk mode: ``--input`` and ``--output``, no sentences."""
    return bool(args.input and args.output and not args.sentences)


def job_record(args, engine: Engine) -> dict:
    """What a bulk job's bytes depend on (its ``.parts/manifest.json``; a resume whose record
    differs is refused): the model and the engine (:meth:`Engine.digest`: its name, the
    parameters' digest, a run retrained to the same step differing, and the engine's own
    settings), the decoding settings, the sampling ones only with ``--sample`` (a beam job
    resumed with another ``--seed`` gives the same bytes)."""
    record = {"workdir": str(Path(args.workdir).resolve()),
              "checkpoint": f"{engine.checkpoint.kind} step {engine.checkpoint.step}",
              **engine.digest(), **{name: getattr(args, name) for name in SETTINGS}}
    # The decoding options the run supplies, as decoded: a job resumed after the run's
    # defaults changed (another jaxformer) is refused, not finished with other settings.
    record.update({name: value if record.get(name) is None else record[name]
                   for name, value in engine.run.defaults.items()})
    record.update(constraint_files.digests(args))   # only the files given: older manifests still resume
    languages = [getattr(engine.run.tokenizer, name, None) for name in ("src_lang", "tgt_lang")]
    if any(languages):   # a multilingual model's (M2M100/NLLB); other jobs' records stay as they were
        record["languages"] = languages
        if args.constrained_by:   # its phrases became pieces without the language token (issue 51)
            record["phrases"] = "target pieces"
    if "generation" in engine.run.record:   # an imported model's rules (or a fine-tune's, inherited)
        run = engine.run                    # as decoded: a job begun under older rules is refused
        record["generation_rules"] = {"forced_eos": run.forced_eos, "max_len": [run.max_len_a, run.max_len_b]}
    if args.by_sentence:   # a job begun line by line (an older jaxformer) is not finished by sentence
        record["split_sentences"] = True
    if not args.sample:
        record.update(dict.fromkeys(("seed", "temperature", "top_k", "top_p")))
    else:   # a job sampled with one key per chunk (an older jaxformer) is not finished with these
        record["sampling_keys"] = "line index"
    return record


def translate(args, engine: Engine, translate_lines: Callable) -> int:
    """Translates ``--input`` into ``--output`` (this process's share of it) with
    ``translate_lines(engine, args, lines, first_index, out) -> (best, counts)``; process 0
    prints the report. Input and resume errors exit with status 2. Returns the process index."""
    def translate_chunk(lines, first_index, index):
        buffer = io.StringIO()
        _, counts = translate_lines(engine, args, lines, first_index, buffer)
        return buffer.getvalue(), counts

    record = job_record(args, engine)
    process, processes, barrier = 0, 1, None
    if args.multi_process:   # the JAX engine's (the CTranslate2 engine imports no JAX)
        import jax

        from jaxformer.model.sharding import process_barrier

        process, processes, barrier = jax.process_index(), jax.process_count(), process_barrier
    try:
        info = bulk.scan_input(args.input)
        problem = constraint_files.count_problem(args, info.lines)
        if problem:
            fail(PROG, problem)
        if args.input_errors == "replace" and process == 0:
            warn_replaced(args.input, info.bad_lines)
        report = bulk.translate_file(translate_chunk, args.input, args.output, record=record, info=info,
                                     chunk_lines=args.chunk_lines, errors=args.input_errors,
                                     process_index=process, process_count=processes,
                                     barrier=barrier if processes > 1 else None)
    except (bulk.BulkInputError, bulk.BulkResumeError) as e:
        fail(PROG, str(e))
    except OSError as e:   # a full disk, a folder gone: the chunks written so far stay
        fail(PROG, f"{e}; the finished chunks in {args.output}.parts/ are kept, and the same command "
                   f"resumes from them")
    if process == 0:
        print(report.summary(), file=sys.stderr)
    return process
