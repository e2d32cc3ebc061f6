"""Sequence-level knowledge distillation (Kim & Rush 2016): a student trained on its
teacher's beam-search translations of the teacher's own training sources.

The recipe (README, "Distillation"), every step a normal command::

    jaxformer-prepare --workdir runs/en-de --write-train-sources train.en
    jaxformer-translate --workdir runs/en-de --input train.en --output train.distilled.de --beam-size 4
    paste train.en train.distilled.de > distilled.tsv
    python train.py --workdir runs/en-de-student --train-file distilled.tsv \\
        --dev-file runs/en-de/prepared/dev.tsv --test-file runs/en-de/prepared/test.tsv \\
        --d-model 64 --d-ff 256

:func:`write_training_sources` gives the first step: the sources of exactly the pairs
the teacher trained on. The teacher's dev and test pairs are split off its corpus by
the hash of their source (:class:`jaxformer.data.corpus.Splitter`); translating the
whole corpus would put the teacher's output for its dev and test sources into the
student's training data, and the student's own split of ``distilled.tsv`` would score
it against teacher output instead of references. So the student takes the teacher's
dev and test files (real references) and trains on the training split alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxformer.data.corpus import DataReport, Splitter
from jaxformer.data.prepared import read_manifest
from jaxformer.data.run_data import fingerprint_differences, same_data
from jaxformer.data.spec import DataSpec
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir
from jaxformer.run.train_flags import load_config_file


def _check_not_an_input(output: Path, spec: DataSpec, run_dir: RunDir) -> None:
    """Refuses an output that is one of the run's corpus files (the recipe's own input, which
    writing would cut to its training sources) or a file of the run directory.

    Raises:
      ValueError: naming the file.
    """
    inputs = [Path(p) for p in (*spec.corpus_files, spec.dev_file, spec.test_file, spec.bt_file) if p]
    same = [p for p in inputs if p.absolute().resolve() == output.absolute().resolve()
            or (p.exists() and output.exists() and os.path.samefile(p, output))]
    if same:
        raise ValueError(f"--write-train-sources {str(output)!r} is the run's corpus file {str(same[0])!r}, "
                         f"which writing would replace with its training sources; name a new file.")
    in_run = output.absolute().resolve().parent == run_dir.root.absolute().resolve()
    if in_run and output.name in RunDir.NAMES:
        raise ValueError(f"--write-train-sources {str(output)!r} is the run's own {output.name}; name a "
                         f"file outside the run's records.")


def write_training_sources(workdir: str | os.PathLike, output: str | os.PathLike) -> int:
    """Writes the source side of a run's training split, one sentence per line, in corpus
    order (back-translated pairs of ``--bt-file`` are not part of it), streaming.

    The corpus is read again from the run's flags (``config.json``) and split as
    preparing split it; the corpus files must be the ones the run was prepared from.

    Returns:
      the number of lines written (the training split before the length filters).

    Raises:
      FileNotFoundError: no run (``config.json``) or no prepared data at ``workdir``.
      ValueError: the corpus files changed since the run was prepared (named), or
        ``output`` is a folder, in a folder that does not exist, one of the run's corpus
        files or one of its records.
    """
    run_dir = RunDir(Path(workdir))
    if not run_dir.config.exists() or read_manifest(run_dir.prepared) is None:
        only_data = read_manifest(run_dir.prepared) is not None
        raise FileNotFoundError(
            f"{workdir} holds prepared data but no run record (config.json, written when training "
            f"starts); train the teacher there first." if only_data else
            f"{workdir} has no run with prepared data (config.json and prepared/); give the teacher's "
            f"--workdir.")
    cfg = TrainConfig.flat(**{**load_config_file(run_dir.config), "workdir": str(run_dir.root)})
    spec = DataSpec.from_config(cfg)
    saved = read_manifest(run_dir.prepared)["fingerprint"]
    now = spec.fingerprint()
    saved, now = ({k: v for k, v in f.items() if k != "back_translation"} for f in (saved, now))
    if not same_data(saved, now):
        raise ValueError(f"The corpus of {workdir} changed since it was prepared "
                         f"({'; '.join(fingerprint_differences(saved, now))}); its training split "
                         f"cannot be reproduced. Restore the files it was trained on.")
    output = Path(output)
    if output.is_dir() or not output.absolute().parent.is_dir():
        raise ValueError(f"--write-train-sources {str(output)!r} is a folder, or its folder does not "
                         f"exist; name a file in an existing folder.")
    _check_not_an_input(output, spec, run_dir)
    n = sum(1 for _ in spec.read(DataReport()))
    explicit = tuple(name for name, path in (("dev", spec.dev_file), ("test", spec.test_file)) if path)
    splitter = Splitter.for_size(n, merged_into_train=explicit)
    tmp = output.with_name(f"{output.name}.{os.getpid()}.tmp")
    written = 0
    try:
        try:
            out = open(tmp, "w", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--write-train-sources {str(output)!r} cannot be written ({e.strerror}); "
                             f"name a file in a folder you can write to.") from e
        with out:
            for source, _ in spec.read(DataReport()):
                if splitter(source) == "train":
                    out.write(source + "\n")
                    written += 1
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return written
