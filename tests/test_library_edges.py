"""Issue 14: the library edges (host-side id checks of the jitted decoders and of
``decode_step``, colliding special ids, mismatched score lists, float16 fused attention
on CPU, the layer docstrings) and the run-side units (flags and --config, logging and
progress, early stopping, scorers, batch rows, streaming stdin)."""

import io
import json
import logging
import math
import os
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import Decoder, DecoderLayer, Encoder, EncoderLayer, Transformer, preset
from jaxformer.decode.decoding import decode
from jaxformer.decode.evaluation import Evaluator, make_bleu
from jaxformer.decode.strategies import Beam, Greedy, Sample
from jaxformer.model.attention import fused_dot_product_attention, scaled_dot_product_attention
from jaxformer.train.run_state import EarlyStopping

V = 13


def _best(model, params, src, strategy, **settings):
    """``decode``'s best sequences ``[B, M]``."""
    return decode(model, params, src, strategy, **settings)[0][:, 0]


@pytest.fixture(scope="module")
def tiny():
    model = Transformer(preset("tiny", src_vocab_size=V))
    src = np.array([[3, 4, 5, 0]], np.int32)
    params = model.init(jax.random.key(0), src, src)["params"]
    return model, params


@pytest.mark.parametrize("bad", [V, V + 20, -1])
def test_jitted_decoders_check_concrete_ids_before_dispatch(tiny, bad):
    model, params = tiny
    src = np.array([[3, bad, 5, 0]], np.int32)
    common = dict(max_decode_len=4, bos_id=1, eos_id=2)
    calls = {"greedy": lambda s: _best(model, params, s, Greedy(), **common),
             "beam": lambda s: decode(model, params, s, Beam(2), extra_len=50, **common),
             "sample": lambda s: _best(model, params, s, Sample(), rng=jax.random.key(0), **common)}
    for call in calls.values():
        with pytest.raises(ValueError, match=rf"outside \[0, {V}\)"):
            call(src)
        with pytest.raises(ValueError, match=rf"outside \[0, {V}\)"):
            call(jnp.asarray(src))   # a concrete device array is checked too
    good = np.array([[3, 4, 5, 0]], np.int32)
    assert _best(model, params, good, Greedy(), **common).shape == (1, 4)
    for value in (V + 5, -1, np.int64(V + 5)):   # clamped into another token's embedding; NumPy ints too
        with pytest.raises(ValueError, match=rf"bos_id must be at (most {V - 1}|least 0), got {value}"):
            decode(model, params, good, Greedy(), **{**common, "bos_id": value})
    assert _best(model, params, good, Greedy(), **{**common, "bos_id": np.int64(1)}).shape == (1, 4)
    never_stop = _best(model, params, good, Greedy(), **{**common, "eos_id": V + 7})   # the idiom
    sampled = _best(model, params, good, Sample(temperature=jnp.float32(0.7)), rng=jax.random.key(0),
                    **common)
    assert never_stop.shape == sampled.shape == (1, 4)   # a 0-d array is taken as its number
    # The strategies' own settings: tests/test_decoding.py (they check them when made).
    for settings, words in ((dict(max_decode_len=4.5), "max_decode_len must be an integer, got 4.5"),
                            (dict(bos_id=1.0), "bos_id must be an integer"),
                            (dict(len_a=math.inf, extra_len=3), "len_a must be a finite number, got inf"),
                            (dict(eos_id=2**31), "eos_id must be at most 2147483647")):
        with pytest.raises(ValueError, match=words):
            decode(model, params, good, Greedy(), **{**common, **settings})


def test_decode_step_checks_concrete_ids(tiny):
    model, params = tiny
    src = jnp.array([[3, 4, 5, 0]], jnp.int32)
    enc = model.apply({"params": params}, src, method=Transformer.encode)
    cache = model.apply({"params": params}, enc, src, 4, method=Transformer.init_cache)
    logits, _ = model.apply({"params": params}, jnp.array([[1]], jnp.int32), cache,
                            method=Transformer.decode_step)
    assert logits.shape == (1, V)
    for bad in (V, -1):
        with pytest.raises(ValueError, match="ids_B1 holds token ids outside"):
            model.apply({"params": params}, jnp.array([[bad]], jnp.int32), cache,
                        method=Transformer.decode_step)
    # A step past the cache's room: its write would be clamped into the last slot.
    cache = model.apply({"params": params}, enc, src, 2, method=Transformer.init_cache)
    for _ in range(2):
        _, cache = model.apply({"params": params}, jnp.array([[1]], jnp.int32), cache,
                               method=Transformer.decode_step)
    with pytest.raises(ValueError, match="the cache holds 2 positions and all are used"):
        model.apply({"params": params}, jnp.array([[1]], jnp.int32), cache, method=Transformer.decode_step)


def test_tokenizer_with_pad_equal_to_eos_is_refused_with_the_fix(tmp_path):
    from sentencepiece import sentencepiece_model_pb2

    from jaxformer.data.tokenizer import Tokenizer

    Tokenizer.train(["the cat sat on the mat", "a dog ran in the park"] * 40, tmp_path, vocab_size=40)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((tmp_path / "spm.model").read_bytes())
    proto.trainer_spec.pad_piece = proto.trainer_spec.eos_piece   # pad = eos, as some exports do
    bad = tmp_path / "pad_is_eos.model"
    bad.write_bytes(proto.SerializeToString())
    with pytest.raises(ValueError, match=r"pad id 3 is also the eos id.*--pad_id=0"):
        Tokenizer(bad)


def test_score_refuses_lists_of_different_lengths(tiny):
    evaluator = Evaluator(tiny[0], None, batch_size=8, target_language="de")
    assert evaluator.score(["a b c d"], ["a b c d"]) == pytest.approx(100.0)
    for hyps, refs in ((["a", "b"], ["a"]), (["a"], ["a", "b"])):
        with pytest.raises(ValueError, match="one reference per hypothesis"):
            evaluator.score(hyps, refs)
        with pytest.raises(ValueError, match="one reference per hypothesis"):
            evaluator.scores(hyps, refs)


def test_bleu_tokenizer_follows_the_target_language():
    def signature(bleu):
        bleu.corpus_score(["x"], [["x"]])
        return str(bleu.get_signature())

    assert "tok:zh" in signature(make_bleu("zh"))
    assert "tok:13a" in signature(make_bleu("de")) and "tok:13a" in signature(make_bleu("xx"))
    assert "tok:char" in signature(make_bleu("ja", "char"))
    with pytest.raises(ValueError, match="Unknown sacrebleu tokenizer"):
        make_bleu("de", "nope")
    try:
        import MeCab  # noqa: F401
    except ImportError:   # the usual install: a clear error instead of a wrong number
        with pytest.raises(ValueError, match=r"sacrebleu\[ja\].*--sacrebleu-tokenize char"):
            make_bleu("ja")


def test_a_bleu_tokenizer_that_cannot_start_stops_training_before_the_run_directory_is_made(tmp_path):
    """An unknown --sacrebleu-tokenize (or, without MeCab, a Japanese target) is refused by
    train() before it makes the run directory or prepares any data."""
    from jaxformer.run.config import TrainConfig
    from jaxformer.train.trainer import train

    corpus_file = tmp_path / "pairs.tsv"
    corpus_file.write_text("Hello.\tHallo.\n" * 50)
    with pytest.raises(ValueError, match="--sacrebleu-tokenize must be one of"):   # at once
        TrainConfig.flat(train_file=str(corpus_file), sacrebleu_tokenize="nope")
    try:
        import MeCab  # noqa: F401
        pytest.skip("MeCab is installed: BLEU's Japanese tokenizer starts")
    except ImportError:
        pass
    cfg = TrainConfig.flat(workdir=str(tmp_path / "run"), train_file=str(corpus_file), preset="tiny",
                      vocab_size=100, max_steps=1, progress=False, tgt_lang="ja")
    with pytest.raises(ValueError, match=r"sacrebleu\[ja\]"):
        train(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("field, value, words", [
    ("mesh", "foo", "Bad --mesh 'foo'"), ("mesh", "data=2,tensor=2", "unknown axis 'tensor'"),
    ("dtype", "int8", "--dtype must be one of float32, bfloat16"),
    ("attention_backend", "flash", "--attention-backend must be one of reference"),
    ("norm_position", "middle", "--norm-position must be one of post, pre"),
    ("sacrebleu_tokenize", "nope", "--sacrebleu-tokenize must be one of"),
])
def test_a_train_config_names_a_bad_choice_when_it_is_built(field, value, words):
    """Library users meet a wrong mesh or dtype where they write it, not inside train()."""
    from jaxformer.run.config import TrainConfig

    with pytest.raises(ValueError, match=re.escape(words)):
        TrainConfig.flat(**{field: value})
    TrainConfig.flat(mesh="data=2,model=2", dtype="bfloat16")   # a valid one is kept


def test_greedy_and_sampling_stop_each_sentence_at_its_own_length_limit(tiny):
    """len_a × L + extra_len per sentence, as beam search has (fairseq's --max-len-a/b), not
    the bucket's padded length: sources of 1 and 3 tokens with a = 1, b = 1 stop after 2
    and 4 tokens; forced eos puts eos at each sentence's own last position."""
    model, params = tiny
    src = np.array([[3, 0, 0, 0], [3, 4, 5, 0]], np.int32)
    common = dict(max_decode_len=12, bos_id=1, eos_id=2, len_a=1.0, extra_len=1)

    def lengths(out):
        out = np.asarray(out)
        ends = [list(row).index(2) + 1 if 2 in row else int((row != 0).sum()) for row in out]
        assert all((row[end:] == 0).all() for row, end in zip(out, ends))   # pad after the end
        return ends

    for out in (_best(model, params, src, Greedy(), **common),
                _best(model, params, src, Sample(temperature=2.0), rng=jax.random.key(3), **common)):
        assert all(n <= limit for n, limit in zip(lengths(out), (2, 4)))
    forced = np.asarray(_best(model, params, src, Greedy(forced_eos=True), **common))
    assert [list(row).index(2) <= limit - 1 for row, limit in zip(forced, (2, 4))] == [True, True]
    unlimited = np.asarray(_best(model, params, src, Greedy(), max_decode_len=12, bos_id=1, eos_id=2))
    assert max(lengths(unlimited)) > 4   # the random model runs on without a limit


def test_evaluator_pads_batches_to_a_power_of_two_not_the_batch_size(tiny):
    evaluator = Evaluator(tiny[0], None, batch_size=32, target_language="de",
                          scoring=False, max_len_a=0.5, max_len_b=3)
    assert [evaluator._rows(n) for n in (1, 2, 3, 5, 17, 32)] == [1, 2, 4, 8, 32, 32]
    assert evaluator.max_decode_len(10) == 8 and evaluator.max_decode_len(1000) == 64   # capped by max_len


def test_float16_fused_xla_attention_runs_on_cpu_under_jit_and_grad():
    q_BHTK = jax.random.normal(jax.random.key(0), (2, 4, 3, 8)).astype(jnp.float16)
    mask = jnp.array([True, True, False])[None, None, None, :]
    attend = jax.jit(lambda q: fused_dot_product_attention(q, q, q, mask, implementation="xla"))
    grad = jax.jit(jax.grad(lambda q: attend(q).astype(jnp.float32).sum()))
    out = attend(q_BHTK)
    q32 = q_BHTK.astype(jnp.float32)
    reference, _ = scaled_dot_product_attention(q32, q32, q32, mask)
    assert out.dtype == jnp.float16 and grad(q_BHTK).dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(out, np.float32), reference, atol=2e-3)


def test_layer_calls_state_shapes_and_mask_polarity():
    for cls in (EncoderLayer, DecoderLayer, Encoder, Decoder):
        doc = cls.__call__.__doc__ or ""
        assert "True = may attend" in doc and "[B, " in doc, cls.__name__


def test_early_stopping_counts_evaluations_without_a_better_score():
    stop = EarlyStopping(patience=2)
    assert [stop.update(s) for s in (1.0, 2.0, 2.0, 1.5)] == [False, False, False, True]
    assert stop.best == 2.0
    never = EarlyStopping(patience=None)
    assert not any(never.update(0.0) for _ in range(10))
    from jaxformer.run.config import TrainConfig

    with pytest.raises(ValueError, match="--patience must be at least 1, got 0"):   # checked where it enters
        TrainConfig.flat(patience=0)


# ---------------------------------------------------------------------- flags and --config
def test_every_flag_has_help_and_help_has_no_rest_markup(capsys):
    from jaxformer.run.config import DEFAULT_CPU_RUN, SECTION_OF, TrainConfig
    from jaxformer.run.train_flags import parse_train_args

    with pytest.raises(SystemExit):
        parse_train_args(["--help"], prog="jaxformer-train")
    text = capsys.readouterr().out
    assert [name for name in SECTION_OF if not re.search(rf"--{name.replace('_', '-')}\b(?!-)", text)] == []
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert "(default: the preset's)" in text and "(default: None)" in text   # a None said in words
    assert "model width D (default: the preset's)" in text
    with pytest.raises(SystemExit):   # train.py's own defaults replace the words
        parse_train_args(["--help"], DEFAULT_CPU_RUN, prog="train.py")
    text = capsys.readouterr().out
    assert "(default: 64)" in text and "(default: --max-len)" not in text
    assert "{tiny,small,base,big}" in text and "{None,post,pre}" in text and "ja-mecab" in text
    with pytest.raises(SystemExit):
        parse_train_args(["--preset", "huge"])
    assert "invalid choice 'huge'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--average-last must be in"):
        TrainConfig.flat(average_last=5, keep_checkpoints=3)
    for field, message in ((dict(seed=-1), "--seed must be at least 0 and < 4294967296"),
                           (dict(seed=2**63), "--seed must be at least 0"),
                           (dict(alpha=float("nan")), "--alpha must be finite"),
                           (dict(workdir=""), "--workdir must name a folder")):
        with pytest.raises(ValueError, match=message):
            TrainConfig.flat(**field)

    from jaxformer.cli import translate  # noqa: F401  (its docstring is the description)
    from jaxformer.cli.translate_flags import parse_translate_args

    with pytest.raises(SystemExit):
        parse_translate_args(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":class:" not in text and "--max-len-a" in text and "--checkpoint" in text


def test_config_file_fills_settings_and_flags_override(tmp_path, capsys):
    from jaxformer.run.config import DEFAULT_CPU_RUN, TrainConfig
    from jaxformer.run.train_flags import parse_train_args

    (tmp_path / "run.yaml").write_text("preset: tiny\nbatch-tokens: 512\nmax_minutes: 2\npack: false\n")
    record = {"model": {"src_vocab_size": 8000}, "train": {"preset": "base", "seed": 7}}   # a run's
    (tmp_path / "run.json").write_text(json.dumps(record))
    args = parse_train_args(["--config", str(tmp_path / "run.yaml"), "--batch-tokens", "1024"],
                            DEFAULT_CPU_RUN)
    cfg = args.cfg
    assert (cfg.model.preset, cfg.train.batch_tokens, cfg.train.max_minutes, cfg.train.pack) == \
        ("tiny", 1024, 2.0, False)
    assert cfg.train.warmup_steps == DEFAULT_CPU_RUN["warmup_steps"]   # untouched settings keep defaults
    # What the user chose: the file's keys and the typed flags, not what the defaults filled in.
    assert {"preset", "batch_tokens", "max_minutes", "pack", "config"} <= args.chosen
    assert not args.chosen & {"warmup_steps", "vocab_size", "max_steps"}
    args = parse_train_args(["--config", str(tmp_path / "run.json")])   # a run's (flat) config.json
    assert (args.cfg.model.preset, args.cfg.run.seed) == ("base", 7)
    # A replayed run record holds every setting of that run, chosen then, not now.
    assert args.chosen == {"config"}
    args = parse_train_args(["--config", str(tmp_path / "run.json"), "--seed", "3", "--no-pack"])
    assert args.chosen == {"config", "seed", "pack"} and args.cfg.run.seed == 3
    (tmp_path / "yaml11.yaml").write_text("lr_scale: 5e-1\nwarmup_steps: '40'\n")   # strings to YAML 1.1
    cfg = parse_train_args(["--config", str(tmp_path / "yaml11.yaml")]).cfg
    assert (cfg.train.lr_scale, cfg.train.warmup_steps) == (0.5, 40)
    for text, message in (("batch_size: 3\n", "unknown setting(s) 'batch_size'"),
                          ("max_steps: ten\n", "--max-steps must be an integer, got 'ten'"),
                          ("- a\n", "mapping"),
                          ("seed: null\n", "--seed must be an integer, got None"),
                          ("preset: huge\n", "--preset must be one of tiny, small, base, big"),
                          ("pair: en-xx\n", "--pair must be one of en-de"),
                          ("max_steps: 10\nmax-steps: 20\n", "['max_steps'] given twice (as _ and -)"),
                          ("max_steps: 10\nmax_steps: 20\n", "'max_steps' given twice; keep one"),
                          ("tgt_lang: no\n", "--tgt-lang must be a string, got False"),   # YAML 1.1's no
                          ("lr_scale: -5e-1\n", "--lr-scale must be a positive finite number, got -0.5"),
                          ("seed = 3\n", "mapping of setting: value, got str")):
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(SystemExit) as exit_info:
            parse_train_args(["--config", str(tmp_path / "bad.yaml")])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, message
    (tmp_path / "run.toml").write_text("seed = 3\n")
    (tmp_path / "twice.json").write_text('{"seed": 1, "seed": 2}')
    for name, message in (("run.toml", "only JSON (.json) and YAML (.yaml, .yml) files are read"),
                          ("twice.json", "'seed' given twice; keep one")):
        with pytest.raises(SystemExit):
            parse_train_args(["--config", str(tmp_path / name)])
        assert message in capsys.readouterr().err
    # A file in TrainConfig's own sections reads as the flat names; two --config files are refused.
    (tmp_path / "parts.yaml").write_text("model:\n  preset: tiny\n  d_model: 64\ntrain:\n  max_steps: 7\n"
                                         "decode:\n  beam_size: 1\n")
    args = parse_train_args(["--config", str(tmp_path / "parts.yaml")])
    assert (args.cfg.model.preset, args.cfg.model.d_model, args.cfg.train.max_steps,
            args.cfg.decode.beam_size) == ("tiny", 64, 7, 1) and "preset" in args.chosen
    for argv, message in ((["--config", str(tmp_path / "parts.yaml")] * 2, "--config is given twice"),):
        with pytest.raises(SystemExit):
            parse_train_args(argv)
        assert message in capsys.readouterr().err
    (tmp_path / "misplaced.yaml").write_text("train:\n  preset: tiny\n")
    with pytest.raises(SystemExit):
        parse_train_args(["--config", str(tmp_path / "misplaced.yaml")])
    assert "unknown setting(s) 'train.preset'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="model must be a ModelOverrides, got dict"):
        TrainConfig(model={"preset": "tiny"})
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"seed": 5}).encode())   # a BOM
    assert parse_train_args(["--config", str(tmp_path / "bom.json")]).cfg.run.seed == 5
    with pytest.raises(ValueError, match="--preset must be one of"):
        TrainConfig.flat(preset="huge")   # the library's own check, before any data is read
    with pytest.raises(SystemExit):   # no abbreviations: --dropout is not silently --dropout-rate
        parse_train_args(["--dropout", "0.3"])


# ---------------------------------------------------------------------- logging and progress
def test_progress_follows_the_time_budget_and_prints_lines_without_a_bar(caplog):
    from jaxformer.run.logs import Progress

    start = time.perf_counter()
    sink = io.StringIO()
    with Progress(enabled=True, step=0, max_steps=100_000, t_start=start, deadline=start + 420,
                  file=sink) as bar:
        assert bar.bar.total == 420 and bar.bar.unit == "s"   # 7 minutes, not 100000 steps
        bar.step(1)
        assert 0 <= bar.bar.n < 60 and 360 < bar.time_left() <= 420
    with Progress(enabled=True, step=5, max_steps=50, t_start=start, deadline=None, file=sink) as bar:
        assert (bar.bar.total, bar.bar.n) == (50, 5)
    # caplog listens on the root logger, which "jaxformer" stops propagating to once a
    # run in this process configured console logging: listen on "jaxformer" itself.
    jaxformer_logger = logging.getLogger("jaxformer")
    jaxformer_logger.addHandler(caplog.handler)
    propagate, jaxformer_logger.propagate = jaxformer_logger.propagate, False   # each record once
    try:
        with caplog.at_level(logging.INFO, logger="jaxformer"), \
                Progress(enabled=False, step=0, max_steps=10, t_start=start, deadline=start + 120) as quiet:
            quiet.window(50, 3.25, 1234.0, 1e-3)
    finally:
        jaxformer_logger.removeHandler(caplog.handler)
        jaxformer_logger.propagate = propagate
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 50")]
    assert len(line) == 1 and all(part in line[0] for part in
                                  ("loss 3.250", "1,234 tok/s", "lr 1.00e-03", "min left"))


def test_the_library_leaves_logging_to_the_application(tmp_path):
    """``train()`` configures no handler and turns no propagation off: an application's
    root handler receives jaxformer's records (here from a run that fails at setup).
    The command line's ``console_logging`` prints each record once: not also through
    the root handler that grain and orbax install."""
    code = f"""
import logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
logging.basicConfig(level=logging.INFO, handlers=[Keep()])
from jaxformer.run.config import TrainConfig
from jaxformer.train.trainer import train
try:
    train(TrainConfig.flat(train_file={str(tmp_path / "missing.tsv")!r}, workdir={str(tmp_path / "run")!r}))
except FileNotFoundError:
    pass
jaxformer = logging.getLogger("jaxformer")
assert jaxformer.propagate and not jaxformer.handlers, (jaxformer.propagate, jaxformer.handlers)
from jaxformer.run.logs import console_logging, log
log("a library record")
assert records[-1] == "a library record", records   # the application receives it
import grain, orbax.checkpoint   # both install a root stderr handler (through absl)
console_logging()   # what a command does: print once, on stdout
log("after console_logging")
assert "after console_logging" not in records, records
print("ok", len(records))
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith("ok"), out.stderr[-2000:]


def test_run_records_leave_the_applications_matplotlib_and_torch_alone(tmp_path):
    """A run's metrics, TensorBoard events, plots and an attention heat map, written in a
    fresh interpreter that chose its own matplotlib backend: the backend stays, pyplot is
    never imported, and tensorboardX loads without importing torch (installed with the
    test extras), leaving ``import torch`` unblocked for the application."""
    code = f"""
import sys
import matplotlib
import numpy as np
matplotlib.use("svg")   # the application's choice
from pathlib import Path
from jaxformer.decode.translator import save_attention_png
from jaxformer.run.directory import RunDir
from jaxformer.run.metrics import MetricsLog, write_plots
run_dir = RunDir(Path({str(tmp_path / "run")!r}))
run_dir.root.mkdir()
metrics = MetricsLog(run_dir)
metrics.write(1, {{"train/loss": 3.0, "train/lr": 1e-3}})
metrics.write(2, {{"train/loss": 2.0, "train/lr": 2e-3, "dev/loss": 2.5, "dev/bleu": 1.5}})
metrics.close()
write_plots(run_dir)
save_attention_png(run_dir.root / "attention.png", np.full((2, 3), 1 / 3), ["a", "b", "c"], ["x", "y"])
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
assert "matplotlib.pyplot" not in sys.modules
assert sys.modules.get("torch", "absent") == "absent", sys.modules.get("torch")   # not loaded
import importlib.util
assert importlib.util.find_spec("torch") is not None   # and findable again: not blocked
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok", out.stderr[-2000:]
    run = tmp_path / "run"
    for png in ("plots/loss.png", "plots/lr.png", "plots/bleu.png", "attention.png"):
        assert (run / png).read_bytes().startswith(b"\x89PNG"), png
    events = b"".join(path.read_bytes() for path in (run / "tensorboard").iterdir())
    assert b"train/loss" in events and b"dev/bleu" in events
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_an_import_block_holds_in_its_own_thread_only(tmp_path, monkeypatch):
    """What keeps torch out of tensorboardX's import: ``import NAME`` fails in the thread
    inside ``blocked()``, while another thread imports the real module meanwhile, which
    then stays (a ``None`` put in ``sys.modules`` would fail that thread, and removing it
    again would drop the module the other thread had imported)."""
    from jaxformer.run.metrics import ImportBlock

    (tmp_path / "jaxformer_probe_module.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    block, seen = ImportBlock("jaxformer_probe_module"), {}

    def other_thread():
        import jaxformer_probe_module
        seen["value"] = jaxformer_probe_module.VALUE

    try:
        with block.blocked():
            with pytest.raises(ModuleNotFoundError):
                import jaxformer_probe_module  # noqa: F401
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
            assert seen == {"value": 7}
            assert sys.modules["jaxformer_probe_module"].VALUE == 7   # imported once, kept
        import jaxformer_probe_module
        assert jaxformer_probe_module.VALUE == 7
    finally:
        sys.meta_path.remove(block)
        sys.modules.pop("jaxformer_probe_module", None)


def test_run_log_keeps_everything_logged_before_and_after_it_opens(tmp_path):
    from jaxformer.run.logs import RunLog, log

    path = tmp_path / "train.log"
    with pytest.raises(RuntimeError):
        with RunLog(path) as run_log:
            log("before the run directory exists")
            run_log.open()
            log("a detail", logging.DEBUG)
            raise RuntimeError("boom")
    text = path.read_text()
    assert "before the run directory" in text and "a detail" in text and "RuntimeError: boom" in text
    log("after the run")   # the file handler is gone
    assert "after the run" not in path.read_text()


# ---------------------------------------------------------------------- streaming stdin
def test_arriving_lines_answers_a_line_before_the_next_is_written():
    from jaxformer.cli.translate import arriving_lines

    read_fd, write_fd = os.pipe()
    answered = threading.Event()

    def writer():
        os.write(write_fd, b"first\nsecond\n")
        answered.wait(30)                       # a reader that waits for EOF never gets here
        os.write(write_fd, b"third\r\nlast without newline")
        os.close(write_fd)

    thread = threading.Thread(target=writer)
    thread.start()
    with os.fdopen(read_fd) as stream:
        batches = arriving_lines(stream, max_lines=8)
        first = next(batches)
        answered.set()
        rest = list(batches)
    thread.join()
    assert first == ["first", "second"]
    assert [line for batch in rest for line in batch] == ["third", "last without newline"]


def test_arriving_lines_name_a_line_that_is_not_utf8_or_replace_its_bytes():
    """Streamed stdin follows the file rules: a leading byte-order mark dropped, bad bytes
    stop with the line number (strict) or become U+FFFD with the number counted."""
    from jaxformer.cli.translate import arriving_lines
    from jaxformer.data.lines import NotUtf8

    def lines(errors, bad=None):
        read_fd, write_fd = os.pipe()
        os.write(write_fd, b"\xef\xbb\xbfHello\nClick \xff OK.\r\nok\n")
        os.close(write_fd)
        with os.fdopen(read_fd) as stream:
            return [line for batch in arriving_lines(stream, 8, errors, bad) for line in batch]

    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"\xef\xbb\xbfHello\nClick \xff OK.\r\nok\n")
    os.close(write_fd)
    with os.fdopen(read_fd) as stream:
        batches = arriving_lines(stream, 8)
        assert next(batches) == ["Hello"]   # the lines before it are answered
        with pytest.raises(NotUtf8, match=r"of stdin are not valid UTF-8 \(line 2\)"):
            next(batches)
    bad = []
    assert lines("replace", bad) == ["Hello", "Click \ufffd OK.", "ok"] and bad == [2]


def test_the_looping_warning_suggests_only_the_decoding_rules_not_already_used(monkeypatch):
    from jaxformer.run.config import TrainConfig
    from jaxformer.train import run_eval

    logged: list[str] = []
    monkeypatch.setattr(run_eval, "log", logged.append)
    degenerate = {"count": 9, "fraction": 0.09, "examples": [0]}
    for penalty, ngram in ((1.0, 0), (1.4, 0), (1.4, 3)):
        logged.clear()
        run_eval._report_degenerate(degenerate, ["a a a a"],
                                    TrainConfig.flat(repetition_penalty=penalty, no_repeat_ngram_size=ngram))
        text = logged[0]
        assert text.startswith("WARNING: 9 of 1 test translations") and "train longer" in text
        assert ("--repetition-penalty 1.4" in text) == (penalty == 1.0)
        assert ("--no-repeat-ngram-size 4" in text) == (ngram == 0)
