"""A training run's evaluations: the periodic dev evaluation (keeps the best parameters), the
dev NLL between them (watched for overfitting), checkpoint averaging and the final test
(sacrebleu's BLEU and chrF; ``test.src/ref/hyp``)."""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

from jaxformer.decode.strategies import strategy_for
from jaxformer.decode.text import by_sentence
from jaxformer.run.config import save_json
from jaxformer.run.directory import RunDir
from jaxformer.run.logs import is_main_process, log
from jaxformer.run.metrics import read_metrics, write_plots
from jaxformer.train.averaging import average_last_checkpoints
from jaxformer.train.run_state import LoopState, OverfitWatch, Run

DEGENERATE_WARNING = 0.02   # warn when more test hypotheses than this loop on an n-gram
OVERFIT_REPORT = 3   # dev-NLL evaluations in a row that rose: the log reports overfitting


def _translate(run: Run, params: Any, sources: list[str]) -> list[str]:
    """Dev/test decoding with the run's beam, length penalty and repetition rules, a line of
    several sentences sentence by sentence with ``--split-sentences`` (as ``jaxformer-translate``
    and ``jaxformer-serve`` translate it)."""
    cfg = run.cfg
    strategy = strategy_for(cfg.decode.beam_size, cfg.decode.alpha,
                            no_repeat_ngram_size=cfg.decode.no_repeat_ngram_size,
                            repetition_penalty=cfg.decode.repetition_penalty)

    def decode(sentences: list[str]) -> list[str]:
        return [n_best[0][0] for n_best in run.evaluator.decode(params, sentences, strategy)]

    if not cfg.decode.split_sentences:
        return decode(sources)
    tokenizer = run.evaluator.tokenizer
    return by_sentence(sources, run.plan.src_lang or "xx",
                       lambda sentences: [len(ids) for ids in tokenizer.encode_source(sentences)],
                       run.programs.model.config.max_len, decode)


def evaluate(run: Run, loop: LoopState, keep_best: bool = True) -> float:
    """Dev loss, BLEU and chrF of the loop's parameters, with samples; keeps them as the best by
    dev BLEU unless ``keep_best`` is false (skipped updates: they may be ruined). Returns the BLEU."""
    cfg, step, params, t0 = run.cfg, loop.step, loop.state.params, time.perf_counter()
    dev_subset = run.data.splits["dev"][: cfg.decode.dev_bleu_sentences]
    dev_loss = run.evaluator.loss(params, run.data.dev_examples, run.programs.eval_step)
    nll = _nll(dev_loss)
    hyps = _translate(run, params, [p[0] for p in dev_subset])
    scores = run.evaluator.scores(hyps, [p[1] for p in dev_subset])
    bleu = scores["bleu"]
    run.metrics_log.write(step, {"dev/loss": dev_loss["loss"], "dev/nll": nll,
                                 "dev/ppl": dev_loss["ppl"], "dev/accuracy": dev_loss["accuracy"],
                                 "dev/bleu": bleu, "dev/chrf": scores["chrf"]})
    if is_main_process():
        with run.run_dir.samples.open("a") as f:
            f.write(f"== step {step} dev BLEU {bleu:.2f}\n")
            for (src, ref), hyp in list(zip(dev_subset, hyps))[: cfg.decode.num_samples]:
                f.write(f"SRC: {src}\nREF: {ref}\nHYP: {hyp}\n\n")
    if bleu > loop.best_bleu and not keep_best:
        log(f"step {step}: not keeping these parameters as the best, updates were skipped as "
            f"non-finite since the last clean logging window")
    elif bleu > loop.best_bleu:
        loop.best_bleu = bleu
        run.checkpoints.save_best(step, params, bleu)
    log(f"step {step}: dev loss {dev_loss['loss']:.3f} NLL {nll:.3f} ppl {dev_loss['ppl']:.1f} "
        f"BLEU {bleu:.2f} chrF {scores['chrf']:.2f} ({len(dev_subset)} sentences, "
        f"{time.perf_counter() - t0:.0f}s)")
    _watch_nll(run, loop, nll)
    return bleu


def _nll(dev_loss: dict[str, float]) -> float:
    """The per-token NLL of :meth:`~jaxformer.decode.evaluation.Evaluator.loss`'s results (its
    perplexity's log; without label smoothing, unlike its ``loss``)."""
    return math.log(dev_loss["ppl"])


def evaluate_nll(run: Run, loop: LoopState) -> float:
    """The dev NLL of the loop's parameters alone (teacher-forced, no label smoothing, no
    decoding: ``--nll-every``), recorded as ``dev/nll`` and watched for overfitting. One host
    sync. Returns the NLL."""
    t0 = time.perf_counter()
    nll = _nll(run.evaluator.loss(loop.state.params, run.data.dev_examples, run.programs.eval_step))
    run.metrics_log.write(loop.step, {"dev/nll": nll})
    log(f"step {loop.step}: dev NLL {nll:.3f} ({time.perf_counter() - t0:.1f}s)")
    _watch_nll(run, loop, nll)
    return nll


def _watch_nll(run: Run, loop: LoopState, nll: float) -> None:
    """Counts the dev NLL's rises in a row; the :data:`OVERFIT_REPORT`-th (or the
    ``--stop-on-overfit``-th, if fewer) is reported with what to try."""
    cfg = run.cfg
    rises = loop.overfit.update(loop.step, nll)
    if rises != min(OVERFIT_REPORT, cfg.train.stop_on_overfit or OVERFIT_REPORT):
        return
    base_step, base_nll = loop.overfit.base
    tries = ["more dropout (--dropout-rate, --attention-dropout-rate)", "a smaller model (--preset, "
             "--d-model, --num-layers)", "fewer steps (--max-steps)"]
    if cfg.data.recipe == "fixed":
        tries.append("--recipe auto (the recipe that follows the corpus)")
    stop = ("" if cfg.train.stop_on_overfit else
            " --stop-on-overfit N stops a run after N rises in a row;")
    log(f"step {loop.step}: the dev NLL rose in each of the last {rises} evaluations ({base_nll:.3f} at "
        f"step {base_step} → {nll:.3f}): the model is overfitting its training data. Try "
        f"{', '.join(tries[:-1])} or {tries[-1]};{stop} the best checkpoint by dev BLEU is the one tested.")


def resumed_overfit_watch(run_dir: RunDir, step: int) -> OverfitWatch:
    """A resume's :class:`OverfitWatch` at ``step``: the dev NLL of ``metrics.jsonl`` up to it
    replayed (process 0's, in every process), so the rises in a row count on."""
    watch = OverfitWatch()
    if is_main_process():
        for row in read_metrics(run_dir, "dev/nll"):
            if row["step"] <= step:
                watch.update(row["step"], row["dev/nll"])
    if jax.process_count() > 1:   # as float32: every process compares the same values
        from jax.experimental import multihost_utils

        flat = np.array([watch.last is not None, watch.rises, *(watch.base or (0, 0.0)),
                         *(watch.last or (0, 0.0))], np.float32)
        known, rises, base_step, base_nll, last_step, last_nll = \
            multihost_utils.broadcast_one_to_all(flat).tolist()
        watch = OverfitWatch()
        if known:
            watch = OverfitWatch(int(rises), (int(base_step), base_nll), (int(last_step), last_nll))
    return watch


def average_and_compare(run: Run, loop: LoopState, abstract_params: Any) -> tuple[dict[str, Any] | None, Any]:
    """``--average-last N``: the mean of the newest N checkpoints, saved (``averaged/``) if its dev
    BLEU beats the best. ``(report, params)``; ``(None, None)`` with too few checkpoints."""
    cfg, step = run.cfg, loop.step
    have = len(run.checkpoints.steps())
    if have < cfg.train.average_last:   # a run stopped early: not worth losing the final test over
        log(f"checkpoint averaging skipped: --average-last {cfg.train.average_last} but the run has "
            f"{have} checkpoint(s)")
        return None, None
    params, steps = average_last_checkpoints(run.checkpoints, abstract_params, cfg.train.average_last)
    dev_subset = run.data.splits["dev"][: cfg.decode.dev_bleu_sentences]
    hyps = _translate(run, params, [p[0] for p in dev_subset])
    bleu = run.evaluator.score(hyps, [p[1] for p in dev_subset])
    kept = bleu > loop.best_bleu
    if kept:
        run.checkpoints.save_averaged(step, params, {"bleu": bleu, "steps": steps})
    digits = 2 if round(bleu, 2) != round(loop.best_bleu, 2) else 4   # a win never shown as a tie
    log(f"average of checkpoints {steps}: dev BLEU {bleu:.{digits}f} vs best {loop.best_bleu:.{digits}f}: "
        + ("kept (averaged/), used for the test" if kept else "not kept"))
    return {"steps": steps, "dev_bleu": bleu, "kept": kept}, params


def _last_evaluated_step(run: Run) -> int:
    """The latest step with a dev evaluation, process 0's in every process."""
    step = run.run_dir.last_evaluated_step() if is_main_process() else -1
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        step = int(multihost_utils.broadcast_one_to_all(np.int32(step)))
    return step


def _decoding_name(cfg) -> str:
    """The evaluation's decoding in words, for ``results.json``."""
    name = "greedy" if cfg.decode.beam_size == 1 else f"beam {cfg.decode.beam_size}, alpha {cfg.decode.alpha}"
    if cfg.decode.no_repeat_ngram_size:
        name += f", no repeated {cfg.decode.no_repeat_ngram_size}-grams"
    if cfg.decode.repetition_penalty != 1.0:
        name += f", repetition penalty {cfg.decode.repetition_penalty:g}"
    return name


def _report_degenerate(degenerate: dict[str, Any], hyps: list[str], cfg) -> None:
    """Logs how many test hypotheses loop on an n-gram; above 2% warns, naming the unused rules."""
    share = degenerate["fraction"]
    text = (f"{degenerate['count']} of {len(hyps)} test translations ({share:.1%}) repeat an n-gram "
            f"three or more times in a row")
    if share <= DEGENERATE_WARNING:
        log(text)
        return
    example = hyps[degenerate["examples"][0]]
    rules = [rule for rule, unused in (
        ("--repetition-penalty 1.4", cfg.decode.repetition_penalty == 1.0),
        ("--no-repeat-ngram-size 4", cfg.decode.no_repeat_ngram_size == 0)) if unused]
    fix = "train longer" + (f", or decode with {' or '.join(rules)}" if rules else "")
    log(f"WARNING: {text}, e.g. {example[:120]!r}. The model is undertrained or decoding loops: {fix}.")


def final_test(run: Run, loop: LoopState) -> dict[str, Any]:
    """A last dev evaluation (unless the step had one), averaging if asked, then test BLEU and
    chrF of the best parameters; writes ``results.json``, ``test.*`` and the plots, closes the run."""
    cfg, step = run.cfg, loop.step
    if _last_evaluated_step(run) != step:   # a finished run started again is not evaluated twice
        evaluate(run, loop, keep_best=loop.skips_pending() == 0)
    run.checkpoints.wait()
    log(f"training stopped at step {step} ({loop.stopped_by}); best dev BLEU {loop.best_bleu:.2f}")
    abstract_params = run.programs.abstract_state.params
    if run.checkpoints.saved_best_step == step == run.checkpoints.best_step():   # saved now: not read back
        params, best_step, kind = loop.state.params, step, "best"
    else:
        params, checkpoint = run.checkpoints.restore_params(abstract_params, report=log)
        best_step, kind = checkpoint.step, checkpoint.kind
    averaged = None
    if cfg.train.average_last:
        averaged, averaged_params = average_and_compare(run, loop, abstract_params)
        if averaged is not None and averaged["kept"]:
            params, best_step, kind = averaged_params, step, "averaged"
    t0 = time.perf_counter()
    test = run.data.splits["test"]
    hyps = _translate(run, params, [p[0] for p in test])
    refs = [p[1] for p in test]
    scores = run.evaluator.scores(hyps, refs)
    decoding = _decoding_name(cfg)
    results = {"test_bleu": scores["bleu"], "sacrebleu_signature": scores["bleu_signature"],
               "test_chrf": scores["chrf"], "chrf_signature": scores["chrf_signature"],
               "best_step": best_step, "checkpoint": kind, "decoding": decoding,
               "best_dev_bleu": loop.best_bleu, "final_step": step, "stopped_by": loop.stopped_by,
               "test_sentences": len(refs), "num_params": run.programs.num_params,
               "degenerate": run.evaluator.degenerate(hyps),
               "steps": {"done": step, "max_steps": cfg.train.max_steps,
                         "fraction_done": step / cfg.train.max_steps,
                         "cut_by_max_minutes": loop.stopped_by == "max_minutes"},
               "wall_minutes": (time.perf_counter() - run.plan.t_start) / 60}
    if averaged is not None:
        results["averaged"] = averaged
    if is_main_process():
        save_json(run.run_dir.results, results)
        for path, lines in ((run.run_dir.test_src, [p[0] for p in test]), (run.run_dir.test_ref, refs),
                            (run.run_dir.test_hyp, hyps)):
            path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    log(f"test BLEU {scores['bleu']:.2f} chrF {scores['chrf']:.2f} on {len(refs)} sentences "
        f"({decoding}, {kind} checkpoint, step {best_step}, {time.perf_counter() - t0:.0f}s)")
    log(f"  BLEU {scores['bleu_signature']}\n  chrF {scores['chrf_signature']}")
    _report_degenerate(results["degenerate"], hyps, cfg)
    if loop.stopped_by == "max_minutes":
        log(f"note: --max-minutes {cfg.train.max_minutes:g} stopped training at step {step} of --max-steps "
            f"{cfg.train.max_steps} ({results['steps']['fraction_done']:.0%} of the step budget)"
            + ("; the learning rate had not decayed to zero (--lr-schedule wsd), so this is not "
               "the run's result" if cfg.train.lr_schedule == "wsd" else "")
            + ". Run the same command again (without the limit, or a longer one) to train the rest.")
    run.close()
    if is_main_process():
        write_plots(run.run_dir)
    for (source, reference), hypothesis in list(zip(test, hyps))[:3]:
        log(f"  {source}\n  → {hypothesis}\n  (reference: {reference})")
    log(f"total wall time {results['wall_minutes']:.1f} min; run directory {run.run_dir.root}")
    root, plan = run.run_dir.root, run.plan
    pair = "" if plan.src_lang and plan.tgt_lang else ":SRC-TGT"   # a user's corpus names no languages
    log(f"serve it: jaxformer-translate --workdir {root} --input FILE --output FILE, or over HTTP: "
        f"jaxformer-serve --workdir {root}{pair} (LibreTranslate's API and a web page; CTranslate2 on a CPU: "
        f"pip install -e '.[serve]'; docs/translation.md, docs/serving.md)")
    return results
