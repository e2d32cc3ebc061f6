"""M2M100 and NLLB-200 import, translation and export, checked against transformers itself.

Random-initialised ``M2M100ForConditionalGeneration``s at small, distinct sizes (no
download), one with M2M100's tokenizer (sentencepiece + ``vocab.json``, ``__en__``) and one
with NLLB's (``tokenizer.json``, ``eng_Latn``), both built here from a sentencepiece model
trained on the shipped corpus. Each is saved as transformers saves it, converted with
``jaxformer-convert`` and compared with transformers' forward pass, ``generate`` and tokenizer.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity tests need torch (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")

from jaxformer.model.layers import sinusoidal_positional_encoding  # noqa: E402


@pytest.mark.parametrize("d_model,pad_id", [(8, 1), (14, 0), (24, 3)])
def test_fairseq_positions_equal_transformers_embedding(d_model, pad_id):
    """Our "fairseq" table is transformers' ``M2M100SinusoidalPositionalEmbedding`` at the
    positions it gives a right-padded batch's real tokens (pad rows are masked keys)."""
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding

    max_len = 30
    embedding = M2M100SinusoidalPositionalEmbedding(max_len, d_model, pad_id)
    ids = torch.full((2, max_len), pad_id + 7)
    ids[1, 20:] = pad_id                                   # a padded row
    with torch.no_grad():
        theirs = embedding(ids).numpy()
    ours = sinusoidal_positional_encoding(max_len, d_model, "fairseq", pad_id)[0]
    np.testing.assert_allclose(ours, theirs[0], atol=1e-5)   # float32 sin/cos of two libraries
    np.testing.assert_allclose(ours[:20], theirs[1, :20], atol=1e-5)   # float32 sin/cos of two libraries
