"""The translate tool's bulk mode (``--input FILE --output FILE``), on one process or
several: :func:`jaxformer.decode.bulk.translate_file` with each chunk decoded by the
tool's line translator, and the flags that start ``jax.distributed``.

With ``--coordinator-address``/``--num-processes``/``--process-id`` (or
``--distributed`` for cluster auto-detection, as in training) every process runs the
same command: each decodes its own share of the chunks on its own devices (``--mesh``
is a mesh of this process's devices), writes them to ``OUTPUT.parts/`` on a filesystem
all of them see, and process 0 joins the file in input order once all are done.
JAX writes its persistent compilation cache (``RUN/jax_cache/``) from process 0 only,
and a program's cache key names its devices, so the other processes compile their
decoders on every run (measured in benchmarks/README.md, "Bulk translation").
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from pathlib import Path

from jaxformer.cli import fail
from jaxformer.decode import bulk

PROG = "jaxformer-translate"

# Everything a chunk's bytes depend on, recorded in the manifest: a resume with other
# values is refused (the process count is not among them: it does not change a byte).
SETTINGS = ("beam_size", "alpha", "length_normalization", "early_stopping", "max_len_a", "max_len_b",
            "no_repeat_ngram_size", "repetition_penalty", "n_best", "sample", "temperature", "top_k",
            "top_p", "seed", "batch_size", "long_lines", "mesh", "matmul_dtype")


def bulk_mode(args) -> bool:
    """Whether the flags ask for bulk mode: ``--input`` and ``--output``, no sentences as
    arguments. Its beam search runs in stages (:mod:`jaxformer.decode.staged`) on one device."""
    return bool(args.input and args.output and not args.sentences)


def initialize(args) -> None:
    """Starts ``jax.distributed`` when the flags ask for it (before any other JAX use;
    the flags are checked by :meth:`jaxformer.cli.translate_flags.TranslateArgs.problems`)."""
    if args.multi_process:
        from jaxformer.model.sharding import initialize_distributed

        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id, auto=True)


def job_record(args, translator) -> dict:
    """What a bulk job's bytes depend on (its ``.parts/manifest.json``): the model and the
    decoding settings. A resume whose record differs is refused.

    The sampling settings (``--seed``, ``--temperature``, ``--top-k``, ``--top-p``) are
    recorded only with ``--sample``: beam search and greedy ignore them, so a resume with
    another ``--seed`` gives the same bytes and is not refused.
    """
    record = {"workdir": str(Path(args.workdir).resolve()),
              "checkpoint": f"{translator.kind} step {translator.step}",
              "params_sha256": translator.params_digest(),   # a run retrained to the same step differs
              **{name: getattr(args, name) for name in SETTINGS}}
    # The decoding options the run supplies, as decoded: a job resumed after the run's
    # defaults changed (another jaxformer) is refused, not finished with other settings.
    record.update({name: value if record[name] is None else record[name]
                   for name, value in translator.defaults.items()})
    if not args.sample:
        record.update(dict.fromkeys(("seed", "temperature", "top_k", "top_p")))
    return record


def translate(args, translator, translate_lines: Callable) -> int:
    """Translates ``--input`` into ``--output`` (this process's share when there are several);
    process 0 prints the report on stderr. Input and resume errors exit with status 2.

    Args:
      translator: the run's :class:`jaxformer.decode.translator.Translator`.
      translate_lines: ``(translator, args, lines, first_index, out, stream=) -> (best, counts)``,
        the tool's translation of a batch of lines into ``out``.

    Returns:
      this process's index.
    """
    import jax

    from jaxformer.model.sharding import process_barrier

    def translate_chunk(lines, first_index, index):
        buffer = io.StringIO()
        _, counts = translate_lines(translator, args, lines, first_index, buffer, stream=index)
        return buffer.getvalue(), counts

    record = job_record(args, translator)
    process, processes = jax.process_index(), jax.process_count()
    try:
        info = bulk.scan_input(args.input)
        if info.bad_lines and args.input_errors == "replace" and process == 0:
            print(f"warning: {len(info.bad_lines)} line(s) of {args.input} were not valid UTF-8 (line "
                  f"{bulk.line_numbers(info.bad_lines)}); their bad bytes were replaced with U+FFFD",
                  file=sys.stderr)
        report = bulk.translate_file(translate_chunk, args.input, args.output, record=record, info=info,
                                     chunk_lines=args.chunk_lines, errors=args.input_errors,
                                     process_index=process, process_count=processes,
                                     barrier=process_barrier if processes > 1 else None)
    except (bulk.BulkInputError, bulk.BulkResumeError) as e:
        fail(PROG, str(e))
    except OSError as e:   # a full disk, a folder gone: the chunks written so far stay
        fail(PROG, f"{e}; the finished chunks in {args.output}.parts/ are kept, and the same command "
                   f"resumes from them")
    if process == 0:
        print(report.summary(), file=sys.stderr)
    return process
