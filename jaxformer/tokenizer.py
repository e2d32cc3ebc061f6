"""The sentencepiece tokenizer: one joint vocabulary for source and target.

Special ids (pad, unk, bos, eos) come from the model file, never from literals; the
run's model lives in ``<workdir>/tokenizer/spm.model``.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax

from jaxformer.corpus import Pair
from jaxformer.logs import log


class Tokenizer:
    """A joint sentencepiece vocabulary for source and target.

    Special ids are read from the model (pad, unk, bos, eos); the rest of the code
    takes them from here, never as literals.
    """

    def __init__(self, model_file: str | os.PathLike):
        import sentencepiece as spm

        path = Path(model_file)
        if not path.exists():
            raise FileNotFoundError(f"Tokenizer model {str(path)!r} does not exist.")
        self.model_file = path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"Tokenizer model {str(path)!r} is unreadable ({e}). It must be the "
                             f"sentencepiece model the run was trained with: restore it, or start "
                             f"a new run (--fresh or another --workdir).") from e
        self.pad_id, self.unk_id = self.sp.pad_id(), self.sp.unk_id()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        if min(self.pad_id, self.bos_id, self.eos_id) < 0:
            raise ValueError(f"{path}: the sentencepiece model needs pad, bos and eos ids.")

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    # The jaxformer.marian_tokenizer.TextTokenizer interface: one joint vocabulary for both sides.
    src_vocab_size = tgt_vocab_size = vocab_size

    @property
    def decoder_start_id(self) -> int:
        return self.bos_id

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids (no bos/eos) for each text."""
        return self.sp.encode(list(texts))

    encode_source = encode_target = encode

    def source_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.sp.id_to_piece(int(i)) for i in ids]

    target_pieces = source_pieces

    def save_marian(self, out_dir) -> None:
        """Writes this model as Marian tokenizer files (for a Hugging Face export)."""
        from jaxformer.marian_tokenizer import save_joint_as_marian

        save_joint_as_marian(self.model_file, Path(out_dir))

    def decode(self, ids: Iterable[Sequence[int]]) -> list[str]:
        """Detokenized text; stops at the first eos and drops pad/bos."""
        out = []
        for seq in ids:
            seq = [int(t) for t in seq]
            if self.eos_id in seq:
                seq = seq[: seq.index(self.eos_id)]
            out.append(self.sp.decode([t for t in seq if t not in (self.pad_id, self.bos_id)]))
        return out

    @staticmethod
    def train(sentences: Iterable[str], model_dir: str | os.PathLike, vocab_size: int = 8000,
              seed_sentences: int = 200_000) -> Tokenizer:
        """Trains a unigram sentencepiece model on ``sentences`` into ``model_dir/spm.model``.

        Ids: pad 0, unk 1, bos 2, eos 3.
        """
        import sentencepiece as spm

        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(list(sentences)), model_writer=buffer, vocab_size=vocab_size,
            model_type="unigram", character_coverage=0.9995, pad_id=0, unk_id=1, bos_id=2,
            eos_id=3, input_sentence_size=seed_sentences, shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1, minloglevel=2, hard_vocab_limit=False)
        path = model_dir / "spm.model"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(buffer.getvalue())
        tmp.replace(path)
        return Tokenizer(path)


def load_or_train_tokenizer(workdir: Path, train_pairs: Sequence[Pair],
                            vocab_size: int) -> Tokenizer:
    """The run's tokenizer: loaded from ``workdir/tokenizer/spm.model`` or trained on the
    train split. In a multi-process run process 0 trains it and the others wait for the file.

    Raises:
      ValueError: the saved model is unreadable.
    """
    model_file = workdir / "tokenizer" / "spm.model"
    if jax.process_count() > 1:   # process 0 trains it; the others wait and load the same file
        from jax.experimental import multihost_utils

        if jax.process_index() == 0 and not model_file.exists():
            _train_tokenizer(model_file, train_pairs, vocab_size)
        multihost_utils.sync_global_devices("tokenizer")
    if model_file.exists():
        return Tokenizer(model_file)
    return _train_tokenizer(model_file, train_pairs, vocab_size)


def _train_tokenizer(model_file: Path, train_pairs: Sequence[Pair],
                     vocab_size: int) -> Tokenizer:
    start = time.perf_counter()
    sentences = [s for pair in train_pairs for s in pair]
    tokenizer = Tokenizer.train(sentences, model_file.parent, vocab_size=vocab_size)
    log(f"trained sentencepiece ({tokenizer.vocab_size} pieces) in {time.perf_counter() - start:.1f}s")
    return tokenizer
