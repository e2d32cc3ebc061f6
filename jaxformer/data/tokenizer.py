"""Tokenizers behind one interface (:class:`TextTokenizer`), used by translate and the trainer.

:class:`Tokenizer`: the sentencepiece model a run trains, one joint vocabulary for
source and target, in ``<workdir>/tokenizer/spm.model``. :class:`MarianTokenizer`:
OPUS-MT's (two sentencepiece models and a piece→id map), from ``jaxformer-convert``.
:func:`load_tokenizer` builds the one a run's ``config.json`` names. Special ids
(pad, unk, bos, eos) come from the tokenizer files, never from literals.
"""

from __future__ import annotations

import io
import json
import operator
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from jaxformer.model.validation import check_special_ids

# The tag of back-translated sources (Caswell et al. 2019, "Tagged Back-Translation"): a
# reserved piece of a run's tokenizer when the run has --bt-file data.
BT_TAG = "<BT>"


def _until(seq: Sequence[int], eos_id: int) -> list[int]:
    """The ids of ``seq`` as ints, up to (without) the first ``eos_id``."""
    seq = [int(t) for t in seq]
    return seq[: seq.index(eos_id)] if eos_id in seq else seq


class Tokenizer:
    """A joint sentencepiece vocabulary for source and target.

    Special ids are read from the model (pad, unk, bos, eos); the rest of the code
    takes them from here, never as literals.
    """

    def __init__(self, model_file: str | os.PathLike):
        """Raises ``ValueError`` for a missing or unreadable model, or one without pad, bos
        and eos ids or whose pad id is another special id (the message names the fix)."""
        import sentencepiece as spm

        self.model_file = path = Path(model_file)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
            problem = None if min(self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id()) >= 0 else \
                "it has no pad, bos or eos id"
        except (RuntimeError, OSError) as e:
            problem = str(e)
        if problem:
            raise ValueError(f"Tokenizer model {str(path)!r} is unreadable or incomplete ({problem}). It must be "
                             f"the sentencepiece model the run was trained with: restore it, or start "
                             f"a new run (--fresh or another --workdir).")
        self.pad_id, self.unk_id = self.sp.pad_id(), self.sp.unk_id()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        check_special_ids(pad_id=self.pad_id, bos_id=self.bos_id, eos_id=self.eos_id, unk_id=self.unk_id,
                          source=str(path))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    # The TextTokenizer interface (below): one joint vocabulary for both sides.
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
        save_joint_as_marian(self.model_file, Path(out_dir))

    def decode(self, ids: Iterable[Sequence[int]]) -> list[str]:
        """Detokenized text; stops at the first eos and drops pad/bos."""
        return [self.sp.decode([t for t in _until(seq, self.eos_id) if t not in (self.pad_id, self.bos_id)])
                for seq in ids]

    @staticmethod
    def train(sentences: Iterable[str], model_dir: str | os.PathLike, vocab_size: int = 8000,
              seed_sentences: int = 200_000, reserved: Sequence[str] = ()) -> Tokenizer:
        """Trains a unigram sentencepiece model on ``sentences`` into ``model_dir/spm.model``.

        Ids: pad 0, unk 1, bos 2, eos 3, then the ``reserved`` pieces (control symbols,
        e.g. :data:`BT_TAG`), then the learned pieces. ``sentences`` hold text (the caller
        checks: :func:`jaxformer.data.corpus.check_splits_nonempty`).

        Raises:
          ValueError: a ``vocab_size`` sentencepiece cannot reach (fewer pieces than the
            corpus's characters); its own errors are internal ones.
        """
        import sentencepiece as spm

        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=buffer, vocab_size=vocab_size,
                model_type="unigram", character_coverage=0.9995, pad_id=0, unk_id=1, bos_id=2,
                eos_id=3, input_sentence_size=seed_sentences, shuffle_input_sentence=True,
                num_threads=os.cpu_count() or 1, minloglevel=2, hard_vocab_limit=False,
                control_symbols=list(reserved))
        except RuntimeError as e:   # e.g. "Vocabulary size is smaller than required_chars. 5 vs 81"
            reason = str(e).strip().split("] ")[-1].split(" Increase vocab_size")[0]
            raise ValueError(f"sentencepiece cannot train a vocabulary of {vocab_size} pieces on this "
                             f"corpus ({reason}); use a larger --vocab-size (at least the corpus's "
                             f"distinct characters plus {4 + len(reserved)} special pieces).") from e
        path = model_dir / "spm.model"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(buffer.getvalue())
        tmp.replace(path)
        return Tokenizer(path)


# ---------------------------------------------------------------------- the interface, and Marian's
class TextTokenizer(Protocol):
    """What translate and the trainer ask of a tokenizer.

    Special ids come from here, never as literals: ``pad_id``, ``eos_id``, and
    ``bos_id``, the *decoder start* id fed at target position 0 (the paper's bos;
    Marian's pad). ``encode_source`` returns the encoder input as the model was
    trained on it (Marian appends eos); ``encode_target`` returns target ids without
    start or eos (teacher forcing adds them, :func:`jaxformer.data.batching.collate`).
    """

    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int

    @property
    def src_vocab_size(self) -> int: ...

    @property
    def tgt_vocab_size(self) -> int: ...

    @property
    def decoder_start_id(self) -> int: ...

    def encode_source(self, texts: Sequence[str]) -> list[list[int]]: ...

    def encode_target(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[Sequence[int]]) -> list[str]: ...

    def source_pieces(self, ids: Sequence[int]) -> list[str]: ...

    def target_pieces(self, ids: Sequence[int]) -> list[str]: ...

    def save_marian(self, out_dir: Path) -> None: ...


def _read_marian_file(path: Path):
    """A Marian tokenizer file: ``*.json`` a vocabulary (piece → integer id, with ``<unk>``,
    ``</s>`` and ``<pad>``), else a sentencepiece model.

    Raises:
      FileNotFoundError: a missing vocabulary; ValueError: a damaged file (named).
    """
    import sentencepiece as spm

    is_vocab = path.suffix == ".json"
    try:
        if not is_vocab:
            return spm.SentencePieceProcessor(model_file=str(path))
        vocab = {piece: operator.index(i) for piece, i in json.loads(path.read_text(encoding="utf-8")).items()}
        _ = vocab["<unk>"], vocab["</s>"], vocab["<pad>"]
        return vocab
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) + (() if is_vocab else (OSError,)) as e:
        what = ("readable JSON of a Marian vocabulary (piece → id, with <unk>, </s> and <pad>)" if is_vocab
                else "a readable sentencepiece model")
        raise ValueError(f"{path} is not {what} ({type(e).__name__}: {e}): a damaged Marian tokenizer "
                         f"file; copy it again from the model it came with.") from e


class MarianTokenizer:
    """OPUS-MT's tokenizer: ``source.spm`` / ``target.spm`` segment, ``vocab.json`` maps
    pieces to ids (``target_vocab.json`` too when the vocabularies are separate).

    Mirrors transformers' ``models/marian/tokenization_marian.py``: a leading
    ``>>xx<<`` target-language code is split off before segmentation and passed
    through as one token; pieces missing from the map become ``<unk>``; every source
    gets ``</s>`` appended. Decoding drops the special tokens (pad, eos, unk) and
    joins the pieces with sentencepiece (the source model for a joint vocabulary,
    as transformers does). Not done: Moses punctuation normalisation, which
    transformers applies only when ``sacremoses`` is installed.

    The decoder start id is the pad id (Marian), so ``bos_id == pad_id``.

    Raises:
      FileNotFoundError: ``vocab.json`` is missing.
      ValueError: a file that is missing or not what its name says (a damaged download, an
        edit), or a ``vocab.json`` without ``<unk>``, ``</s>`` or ``<pad>``; the message names it.
    """

    def __init__(self, directory: str | os.PathLike, *, separate_vocabs: bool = False,
                 decoder_start_id: int | None = None):
        self.directory = directory = Path(directory)
        self.separate_vocabs = separate_vocabs
        self.source_vocab = _read_marian_file(directory / "vocab.json")
        self.target_vocab = (_read_marian_file(directory / "target_vocab.json")
                             if separate_vocabs else self.source_vocab)
        self.pieces_of = {i: p for p, i in self.target_vocab.items()}
        self.source_spm, self.target_spm = (_read_marian_file(directory / name)
                                            for name in ("source.spm", "target.spm"))
        self.pad_id, self.eos_id = self.source_vocab["<pad>"], self.source_vocab["</s>"]
        self.unk_id = self.source_vocab["<unk>"]
        self.bos_id = self.pad_id if decoder_start_id is None else decoder_start_id
        self._special = {self.pad_id, self.eos_id, self.unk_id}

    @property
    def decoder_start_id(self) -> int:
        return self.bos_id

    @property
    def src_vocab_size(self) -> int:
        return max(self.source_vocab.values()) + 1

    @property
    def tgt_vocab_size(self) -> int:
        return max(self.target_vocab.values()) + 1

    @property
    def vocab_size(self) -> int:
        return self.src_vocab_size

    @staticmethod
    def _split_language_code(text: str) -> tuple[list[str], str]:
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            return [text[: end + 2]], text[end + 2:]
        return [], text

    def _encode(self, text: str, processor, vocab: dict[str, int]) -> list[int]:
        code, text = self._split_language_code(text)
        pieces = code + processor.encode(text, out_type=str)
        return [vocab.get(p, self.unk_id) for p in pieces]

    def encode_source(self, texts: Sequence[str]) -> list[list[int]]:
        """Encoder input ids, ``</s>`` appended (``MarianTokenizer(texts)["input_ids"]``)."""
        return [self._encode(t, self.source_spm, self.source_vocab) + [self.eos_id] for t in texts]

    def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
        """Target ids without start or eos (``text_target=`` labels less their ``</s>``)."""
        return [self._encode(t, self.target_spm, self.target_vocab) for t in texts]

    def decode(self, ids: Iterable[Sequence[int]]) -> list[str]:
        """Text of each id sequence: stops at the first eos, drops special tokens
        (``batch_decode(..., skip_special_tokens=True)``)."""
        processor = self.target_spm if self.separate_vocabs else self.source_spm
        return [processor.decode_pieces([self.pieces_of.get(t, "<unk>") for t in _until(seq, self.eos_id)
                                         if t not in self._special]).replace("\u2581", " ").strip()
                for seq in ids]

    def source_pieces(self, ids: Sequence[int]) -> list[str]:
        source_of = {i: p for p, i in self.source_vocab.items()}
        return [source_of.get(int(i), "<unk>") for i in ids]

    def target_pieces(self, ids: Sequence[int]) -> list[str]:
        return [self.pieces_of.get(int(i), "<unk>") for i in ids]

    def save_marian(self, out_dir: Path) -> None:
        """Copies the tokenizer files (what ``transformers.MarianTokenizer`` reads)."""
        for name in ("source.spm", "target.spm", "vocab.json", "target_vocab.json", "tokenizer_config.json"):
            if (self.directory / name).is_file():
                shutil.copyfile(self.directory / name, Path(out_dir) / name)


def save_joint_as_marian(model_file: Path, out_dir: Path, *, target_language: str | None = None) -> None:
    """Writes a joint sentencepiece model as Marian tokenizer files: ``source.spm`` =
    ``target.spm`` = the model, ``vocab.json`` its pieces in id order."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    out_dir = Path(out_dir)
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(model_file, out_dir / name)
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1), encoding="utf-8")
    config: dict[str, Any] = {"tokenizer_class": "MarianTokenizer", "separate_vocabs": False,
                              "unk_token": sp.id_to_piece(sp.unk_id()),
                              "eos_token": sp.id_to_piece(sp.eos_id()),
                              "pad_token": sp.id_to_piece(sp.pad_id())}
    if target_language:
        config["target_lang"] = target_language
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(workdir: str | os.PathLike, record: dict[str, Any]):
    """The tokenizer a run's ``config.json`` names (``record["tokenizer"]``).

    ``{"file": "tokenizer/spm.model"}`` (what the trainer writes) is the joint
    sentencepiece :class:`Tokenizer`; ``{"kind": "marian", "dir": ...}``
    (what ``jaxformer-convert --from-hf`` writes) is a :class:`MarianTokenizer`.

    Raises:
      ValueError: an unknown tokenizer kind.
      FileNotFoundError: its files are missing.
    """
    workdir, info = Path(workdir), record.get("tokenizer", {})
    kind = info.get("kind", "sentencepiece")
    if kind == "sentencepiece":
        return Tokenizer(workdir / info.get("file", "tokenizer/spm.model"))
    if kind == "marian":
        return MarianTokenizer(workdir / info.get("dir", "tokenizer"),
                               separate_vocabs=bool(info.get("separate_vocabs", False)),
                               decoder_start_id=info.get("decoder_start_id"))
    raise ValueError(f"{workdir / 'config.json'} names tokenizer kind {kind!r}; "
                     f"known: 'sentencepiece', 'marian'.")
