"""The interop wing: models from and to other toolkits.

``marian`` (OPUS-MT/Marian Hugging Face folders in and out: configs and files),
``m2m100`` (M2M100 and NLLB-200 folders in and out), ``hf`` (which of the two a folder or
run needs), ``marian_weights`` (the weight mapping of both), ``ct2`` (a run as a CTranslate2 model directory),
``argos`` and ``argos_readme`` (a run as an Argos Translate package), ``pretrained`` (fine-tuning
from another run: ``--init-from``). Imports ``model``, ``run``, ``data`` and ``decode``.
:class:`ConversionError` is what every converter raises (here, so that naming it loads no JAX).
"""


class ConversionError(ValueError):
    """The model cannot be converted; the message says why and what to do."""


def refuse(problems: list[str]) -> None:
    """Raises ``ConversionError`` listing every one of ``problems`` (each with its fix), if any."""
    if problems:
        raise ConversionError("; ".join(p.rstrip(".") for p in problems) + ".")
