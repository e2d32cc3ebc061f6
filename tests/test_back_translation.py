"""Tagged back-translation in training (issue #23): ``--bt-file`` pairs are prepared
beside the real ones with the tokenizer's reserved tag on their sources, at the mixing
ratio asked, fingerprinted like any other input."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from jaxformer.data import back_translation, corpus, streaming
from jaxformer.data import run_data as rundata
from jaxformer.data.prepare import DataSpec
from jaxformer.data.tokenizer import BT_TAG, Tokenizer
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir

MAX_LEN = 32


@pytest.fixture(scope="module")
def bt_file(tmp_path_factory, short_corpus):
    """150 pairs the real corpus does not hold, their sources 'machine-made' (words reversed)."""
    real_targets = {line.split("\t")[1] for line in short_corpus["train"].read_text().splitlines()}
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    synthetic = [(" ".join(reversed(s.split())), t) for s, t in pairs[3000:]
                 if len(s) < 60 and len(t) < 60 and t not in real_targets][:150]
    path = tmp_path_factory.mktemp("bt") / "bt.tsv"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in synthetic))
    return path


def _cfg(short_corpus, workdir, **overrides) -> TrainConfig:
    return TrainConfig.flat(workdir=str(workdir), train_file=str(short_corpus["train"]),
                       dev_file=str(short_corpus["dev"]), test_file=str(short_corpus["test"]), vocab_size=300,
                       **overrides)


def test_tagged_pairs_reach_the_batches_with_the_tag_at_the_ratio(tmp_path, short_corpus, bt_file):
    run = RunDir(tmp_path / "run")
    run.create()
    prepared = rundata.prepare_run_data(_cfg(short_corpus, run.root, bt_file=str(bt_file), bt_ratio=0.25),
                                        run, has_checkpoints=False)
    counts = prepared.manifest["counts"]
    real = counts["train"] - counts["back_translation"]["kept"]
    # 150 synthetic pairs, 0.25 per real one: 1999 real (one dropped by the ratio filter) ->
    # 500 chosen (3 whole copies of each + 50 more)
    assert real == 2000 - sum(counts["train_dropped"].values()) == 1999
    assert counts["back_translation"]["read"] == 150 and counts["back_translation"]["chosen"] == 500
    tokenizer = Tokenizer(run.tokenizer_dir / "spm.model")
    tag = back_translation.tag_id(tokenizer)
    assert tag == counts["back_translation"]["tag_id"]
    assert tag not in tokenizer.encode([f"{BT_TAG} Click OK."])[0]   # no text encodes to the tag
    synthetic_targets = {tuple(ids) for ids in tokenizer.encode([t for _, t in corpus.read_tsv(bt_file)[0]])}

    batches = streaming.stream_dataset(prepared, pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id,
                                       eos_id=tokenizer.eos_id, max_len=MAX_LEN, batch_tokens=8 * MAX_LEN,
                                       boundaries=(MAX_LEN,), seed=0, block_pairs=512)
    tagged = untagged = 0
    for batch in batches:   # one epoch: every kept pair once
        if batch[streaming.POSITION_KEY][0] > 0:
            break
        for row in range(batch["src"].shape[0]):
            for segment in np.unique(batch["src_segments"][row][batch["src_segments"][row] > 0]):
                src = batch["src"][row][batch["src_segments"][row] == segment]
                tgt = batch["tgt_out"][row][batch["tgt_segments"][row] == segment]
                is_synthetic = tuple(tgt[:-1]) in synthetic_targets   # tgt_out ends in eos
                assert (src[0] == tag) == is_synthetic and tag not in src[1:]
                tagged, untagged = tagged + is_synthetic, untagged + (not is_synthetic)
    records, _ = streaming.kept_records(prepared, MAX_LEN)   # pairs of at most MAX_LEN tokens
    assert (tagged, untagged) == ((records >= real).sum(), (records < real).sum())   # synthetic ones last


def test_the_synthetic_data_is_in_the_fingerprint_and_a_tagless_tokenizer_is_refused(
        tmp_path, short_corpus, bt_file):
    plain = DataSpec.from_config(_cfg(short_corpus, tmp_path / "a")).fingerprint()
    assert "back_translation" not in plain   # runs without synthetic data keep their fingerprint
    spec = DataSpec.from_config(_cfg(short_corpus, tmp_path / "a", bt_file=str(bt_file), bt_ratio=1.0))
    other = DataSpec.from_config(_cfg(short_corpus, tmp_path / "a", bt_file=str(bt_file), bt_ratio=2.0))
    assert spec.fingerprint()["back_translation"]["ratio"] == 1.0
    assert rundata.fingerprint_differences(spec.fingerprint(), other.fingerprint()) == [
        "back_translation.ratio: 1.0 before, 2.0 now"]   # the field that changed, not both records
    assert rundata.fingerprint_differences(plain, spec.fingerprint())[0].startswith(
        "back_translation: None before, {")
    with pytest.raises(ValueError, match="--bt-ratio needs --bt-file"):
        _cfg(short_corpus, tmp_path / "a", bt_ratio=1.0)
    for ratio in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="a positive finite value"):
            _cfg(short_corpus, tmp_path / "a", bt_file=str(bt_file), bt_ratio=ratio)
    tagless = Tokenizer.train(["Click OK.", "Klicken Sie auf OK."] * 50, tmp_path / "tok", vocab_size=40)
    with pytest.raises(ValueError, match="no reserved '<BT>' piece"):
        back_translation.tag_id(tagless)


def test_multiplicities_repeat_whole_copies_then_sample_the_rest():
    counts = back_translation.multiplicities(150, 500, seed=0)
    assert counts.sum() == 500 and set(np.unique(counts)) == {3, 4} and (counts == 4).sum() == 50
    fewer = back_translation.multiplicities(150, 40, seed=0)
    assert fewer.sum() == 40 and set(np.unique(fewer)) == {0, 1}
    assert np.array_equal(fewer, back_translation.multiplicities(150, 40, seed=0))


def test_a_gzip_bt_file_of_any_name_is_read_and_a_ratio_that_chooses_nothing_is_refused(
        tmp_path, short_corpus, bt_file):
    gzipped = tmp_path / "bt-no-suffix"   # gzip by its magic number, not its name
    gzipped.write_bytes(gzip.compress(bt_file.read_bytes()))
    assert len(corpus.read_tsv(gzipped)[0]) == 150
    run = RunDir(tmp_path / "run")
    run.create()
    with pytest.raises(ValueError, match="chooses no synthetic pair"):
        rundata.prepare_run_data(_cfg(short_corpus, run.root, bt_file=str(gzipped), bt_ratio=1e-6), run,
                                 has_checkpoints=False)
    # 1e9 synthetic pairs per real one would fill the disk with copies of 150: refused before
    # any synthetic pair is written
    with pytest.raises(ValueError, match=r"--bt-ratio 1e\+09 asks for .* each repeated .* \(at most 100\)"):
        rundata.prepare_run_data(_cfg(short_corpus, run.root, bt_file=str(gzipped), bt_ratio=1e9), run,
                                 has_checkpoints=False)
