"""Which engine decodes a ``jaxformer-translate`` command (:func:`choose_engine`), opened over
the loaded run (:func:`open_engine`), and the command's :class:`~jaxformer.decode.engine.Request`.

``--engine auto`` picks CTranslate2 (:mod:`jaxformer.serve`) on a CPU where it imports and the
flags ask nothing only JAX honours (:attr:`TranslateArgs.jax_flags`); JAX otherwise: on a GPU
or TPU, for such a request, or where ctranslate2 is missing or cannot be imported (a missing
shared library, a build for other CPUs), each said in the command's engine line.
"""

from __future__ import annotations

from jaxformer.cli.translate_flags import TranslateArgs
from jaxformer.decode.engine import Engine, Request
from jaxformer.decode.served_run import ServedRun
from jaxformer.run.platform import accelerator_present
from jaxformer.serve.ct2_engine import INSTALL, import_ctranslate2


def ct2_problem() -> str | None:
    """Why ctranslate2 cannot serve here (:func:`import_ctranslate2`'s message), or ``None``.
    A build that crashes the process on this CPU's instructions cannot be caught here."""
    try:
        import_ctranslate2()
    except ImportError as e:
        return str(e)
    return None


def choose_engine(args: TranslateArgs) -> tuple[str, str]:
    """``("ct2" | "jax", why)`` for these (checked) flags; ``why`` is a few words."""
    if args.engine != "auto":
        return args.engine, "--engine"
    if args.jax_flags:
        return "jax", f"{' and '.join(args.jax_flags)} need{'s' * (len(args.jax_flags) == 1)} it"
    if args.ct2_flags:
        return "ct2", f"{' and '.join(args.ct2_flags)} ask{'s' * (len(args.ct2_flags) == 1)} for it"
    if accelerator_present():
        return "jax", "a GPU or TPU is here"
    problem = ct2_problem()
    if problem and "not installed" in problem:
        return "jax", f"ctranslate2 is not installed; for CPU serving: {INSTALL}"
    if problem:
        return "jax", problem.replace(" or use --engine jax", "")
    return "ct2", "a CPU, ctranslate2 installed"


def request_of(args: TranslateArgs) -> Request:
    """The decoding options of the flags (``None``: the run's); constraints come per batch."""
    names = ("beam_size", "alpha", "length_normalization", "early_stopping", "no_repeat_ngram_size",
             "repetition_penalty", "n_best", "sample", "temperature", "top_k", "top_p", "seed")
    return Request(**{name: getattr(args, name) for name in names})


def open_engine(args: TranslateArgs, run: ServedRun, engine: str, *, throughput: bool,
                exported: bool, fixed_rows: bool = False) -> Engine:
    """The ``engine`` of ``run`` as the flags set it up: CTranslate2's translators side by side
    for ``throughput`` (a file), JAX's decoders ``exported`` to the run's cache and, with
    ``fixed_rows``, every batch padded to ``--batch-size`` rows (the service's warm-up compiles
    them all). Raises as the engines' constructors."""
    if engine == "ct2":
        from jaxformer.serve.ct2_engine import CT2Engine

        return CT2Engine(run, quantization=args.quantization or "float32", batch_size=args.batch_size,
                         throughput=throughput, inter_threads=args.inter_threads,
                         intra_threads=args.intra_threads)
    import jax

    from jaxformer.decode.translator import Translator
    from jaxformer.model.sharding import make_mesh

    mesh = make_mesh(args.mesh, jax.local_devices()) if args.mesh else None
    return Translator(run, batch_size=args.batch_size, mesh=mesh, exported=exported,
                      staged=bool(args.input and args.output and not args.sentences),
                      matmul_dtype=args.matmul_dtype, fixed_rows=fixed_rows)
