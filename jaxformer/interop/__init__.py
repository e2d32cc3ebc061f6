"""The interop wing: models from and to other toolkits.

``marian`` (OPUS-MT/Marian Hugging Face folders in and out: configs and files),
``m2m100`` (M2M100 and NLLB-200 folders in and out), ``hf`` (which of the two a folder or
run needs), ``marian_weights`` (the weight mapping of both), ``ct2`` (a run as a CTranslate2 model directory),
``pretrained`` (fine-tuning from another run:
``--init-from``). Imports ``model``, ``run``, ``data`` and ``decode``.
"""
