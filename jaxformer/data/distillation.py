"""Sequence-level knowledge distillation (Kim & Rush 2016): a student trained on its
teacher's beam-search translations of the teacher's own training sources::

    jaxformer-prepare --workdir runs/en-de --write-train-sources train.en
    jaxformer-translate --workdir runs/en-de --input train.en --output train.distilled.de --beam-size 4
    paste train.en train.distilled.de > distilled.tsv
    python train.py --workdir runs/en-de-student --train-file distilled.tsv \\
        --dev-file runs/en-de/prepared/dev.tsv --test-file runs/en-de/prepared/test.tsv

Only the training split's sources: the student is scored on the teacher's references.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxformer.data.corpus import Splitter
from jaxformer.data.prepare import DataSpec
from jaxformer.data.prepared import read_manifest
from jaxformer.data.run_data import fingerprint_differences, same_data
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir
from jaxformer.run.train_flags import load_config_file


def _output_problem(output: Path, tmp: Path, spec: DataSpec, run_dir: RunDir) -> str | None:
    """What is wrong with ``output`` as the file to write, or ``None``: a folder or in none, one
    of the run's corpus files or records, or not writable (``tmp`` is created to find out)."""
    inputs = [Path(p) for p in (*spec.corpus_files, spec.dev_file, spec.test_file, spec.bt_file) if p]
    same = [p for p in inputs if p.absolute().resolve() == output.absolute().resolve()
            or (p.exists() and output.exists() and os.path.samefile(p, output))]
    in_run = output.absolute().resolve().parent == run_dir.root.absolute().resolve()
    if output.is_dir() or not output.absolute().parent.is_dir():
        return "is a folder, or its folder does not exist; name a file in an existing folder"
    if same:
        return f"is the run's corpus file {str(same[0])!r}, which writing would replace; name a new file"
    if in_run and output.name in RunDir.NAMES:
        return f"is the run's own {output.name}; name a file outside the run's records"
    try:
        tmp.touch()
    except OSError as e:
        return f"cannot be written ({e.strerror}); name a file in a folder you can write to"
    return None


def write_training_sources(workdir: str | os.PathLike, output: str | os.PathLike) -> int:
    """Writes the sources of a run's training split (before the length filters; no ``--bt-file``
    pairs), one a line, in corpus order, streamed from the corpus its ``config.json`` names,
    split as preparing split it. Returns the number of lines. Raises FileNotFoundError: no run
    (``config.json``) or no prepared data at ``workdir``. ValueError: the corpus changed since
    it was prepared, or ``output`` cannot be written."""
    run_dir = RunDir(Path(workdir))
    manifest = read_manifest(run_dir.prepared)
    if not run_dir.config.exists() or manifest is None:
        raise FileNotFoundError(
            f"{workdir} holds prepared data but no run record (config.json, written when training "
            f"starts); train the teacher there first." if manifest is not None else
            f"{workdir} has no run with prepared data (config.json and prepared/); give the teacher's "
            f"--workdir.")
    cfg = TrainConfig.flat(**{**load_config_file(run_dir.config), "workdir": str(run_dir.root)})
    spec = DataSpec.from_config(cfg)
    saved, now = ({k: v for k, v in f.items() if k != "back_translation"}
                  for f in (manifest["fingerprint"], spec.fingerprint()))
    output = Path(output)
    tmp = output.with_name(f"{output.name}.{os.getpid()}.tmp")
    try:
        changed = not same_data(saved, now)
        problem = None if changed else _output_problem(output, tmp, spec, run_dir)
        if changed or problem:
            raise ValueError(f"The corpus of {workdir} changed since it was prepared "
                             f"({'; '.join(fingerprint_differences(saved, now))}); its training split "
                             f"cannot be reproduced. Restore the files it was trained on." if changed else
                             f"--write-train-sources {str(output)!r} {problem}.")
        n = sum(1 for _ in spec.source().records())
        splitter = Splitter.for_size(n, merged_into_train=tuple(spec.explicit_splits()))
        written = 0
        with open(tmp, "w", encoding="utf-8") as out:
            for source, _ in spec.source().records():
                if splitter(source) == "train":
                    out.write(source + "\n")
                    written += 1
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    return written
