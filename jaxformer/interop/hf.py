"""Which Hugging Face importer or exporter a folder or run needs: Marian (OPUS-MT) or
M2M100/NLLB-200, by the folder's ``model_type`` or the run's tokenizer kind."""

from __future__ import annotations

import json
from pathlib import Path

from jaxformer.decode.served_run import ServedRun
from jaxformer.interop.m2m100 import export_m2m100, import_m2m100
from jaxformer.interop.marian import export_marian, import_marian
from jaxformer.model.config import TransformerConfig


def import_hf(hf_dir: str | Path, workdir: str | Path) -> TransformerConfig:
    """:func:`~jaxformer.interop.m2m100.import_m2m100` for ``model_type`` ``m2m_100`` (M2M100, NLLB-200),
    else :func:`~jaxformer.interop.marian.import_marian` (which names any other type it refuses)."""
    path = Path(hf_dir) / "config.json"
    try:
        model_type = json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None   # the Marian importer names the problem with the folder
    return (import_m2m100 if model_type == "m2m_100" else import_marian)(hf_dir, workdir)


def export_hf(run: ServedRun | str | Path, out_dir: str | Path) -> None:
    """An M2M100/NLLB run (a :class:`~jaxformer.decode.served_run.ServedRun` or its folder) as that
    model, any other as a ``MarianMTModel``."""
    run = run if isinstance(run, ServedRun) else ServedRun.load(run)
    (export_m2m100 if run.multilingual else export_marian)(run, out_dir)
