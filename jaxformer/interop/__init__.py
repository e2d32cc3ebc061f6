"""The interop wing: models from and to other toolkits.

``marian`` (OPUS-MT/Marian Hugging Face folders in and out: configs and files),
``marian_weights`` (the weight mapping), ``ct2`` (a run as a CTranslate2 model directory),
``pretrained`` (fine-tuning from another run:
``--init-from``). Imports ``model``, ``run``, ``data`` and ``decode``.
"""
