"""A training run's start, decided once before anything is written (:func:`plan_run`); later
phases read the :class:`RunPlan` and never decide again."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Literal

import jax

from jaxformer.data.multilingual import scoring_language
from jaxformer.data.prepare import FirstPass
from jaxformer.data.run_data import corpus_shape
from jaxformer.decode.evaluation import make_bleu
from jaxformer.interop import pretrained
from jaxformer.model import sharding as sharding_lib
from jaxformer.model.config import TransformerConfig, preset
from jaxformer.run import recipe as recipe_lib
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir
from jaxformer.run.logs import log

# The evaluation flags that, given, replace a fine-tune's inherited generation keys (--alpha is
# the imported length_penalty: jaxformer.decode.defaults reads it so).
GENERATION_FLAGS = {"beam_size": "beam_size", "alpha": "length_penalty",
                    "no_repeat_ngram_size": "no_repeat_ngram_size",
                    "repetition_penalty": "repetition_penalty"}


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run's start decided (:func:`plan_run`)."""

    # with the --init-from the run began with (a resumed fine-tune keeps it), and the recipe:
    # a fresh run's rule (--recipe auto), a resume's own record's
    cfg: TrainConfig
    chosen: frozenset[str]   # the settings the user gave (flags, --config keys), by flat name
    # resume: checkpoints/ holds a step; fine-tune: none yet, cfg.run.init_from's weights;
    # fresh: none yet, initialised from cfg.run.seed
    start: Literal["fresh", "resume", "fine-tune"]
    run_dir: RunDir
    saved: dict[str, Any] | None   # a resume's config.json record (what it is checked against)
    # a fine-tune's --init-from record, read once: a resumed fine-tune's own (its source may be
    # gone since), else the loaded run's; None: no fine-tune
    source: dict[str, Any] | None
    # a fine-tune's: the loaded run's, tunable fields overridden; else the preset with the model
    # flags, sized to --vocab-size until model_config() sizes it to the trained tokenizer
    architecture: TransformerConfig
    src_lang: str | None   # the data's languages as codes (en, eng_Latn); None: not known
    tgt_lang: str | None
    bleu: Any   # sacrebleu's BLEU for the target language or --sacrebleu-tokenize
    # a fine-tune's generation rules (its source's, the decoding flags given over them); None: none
    generation: dict[str, Any] | None
    mesh: jax.sharding.Mesh   # --mesh over --devices
    data_workers: int   # --data-workers, or 0 on the CPU (the step needs its cores), else 2
    row_multiple: int   # batch rows divide by it: data axis x --grad-accum-steps, and processes
    t_start: float   # time.perf_counter() at the start (--max-minutes)
    # the corpus's first read, made for the recipe rule: its prepare reads the corpus once more,
    # not twice (None: not read; setup drops it once the data is prepared)
    first_pass: FirstPass | None = None

    @property
    def resuming(self) -> bool:
        return self.start == "resume"

    def model_config(self, tokenizer: Any) -> TransformerConfig:
        """The architecture to train: a fresh run's sized to its ``tokenizer`` (known once trained)."""
        if self.source is not None:
            return self.architecture
        return self.architecture.replace(src_vocab_size=tokenizer.src_vocab_size,
                                         tgt_vocab_size=tokenizer.tgt_vocab_size, pad_id=tokenizer.pad_id)

    def languages(self) -> dict[str, str]:
        """``config.json``'s ``target_language`` and ``source_language`` (:func:`recorded_languages`)."""
        return recorded_languages(self.src_lang, self.tgt_lang)


def plan_run(cfg: TrainConfig, fresh: bool = False, chosen: frozenset[str] | None = None) -> RunPlan:
    """Decides the start from ``cfg``, ``fresh``, the settings the user ``chosen`` (``None``: those
    off :class:`TrainConfig`'s defaults) and the run directory, and checks what needs no data
    (BLEU's tokenizer, the mesh against devices and widths, the fine-tune's source).
    Raises ``ValueError`` / ``FileNotFoundError`` / ``OSError`` naming the flag and the fix."""
    t_start = time.perf_counter()
    defaults = TrainConfig().settings()
    chosen = frozenset(k for k, v in cfg.settings().items() if v != defaults[k]) if chosen is None else chosen
    sharding_lib.initialize_distributed(cfg.run.coordinator_address, cfg.run.num_processes,
                                        cfg.run.process_id, auto=cfg.run.distributed)
    mesh = sharding_lib.make_mesh(cfg.run.mesh, sharding_lib.first_devices(cfg.run.devices))
    run_dir = RunDir(cfg.workdir)
    own = None if fresh else run_dir.read_config()   # a damaged record is refused, never overwritten
    if own and not cfg.run.init_from and own.get("train", {}).get("init_from"):   # resumed without the flag
        cfg = cfg.replace(init_from=own["train"]["init_from"])
    resuming = not fresh and run_dir.has_checkpoint()
    saved = own if resuming else None
    start = "resume" if resuming else "fine-tune" if cfg.run.init_from else "fresh"
    shape, first = None, None
    if start == "resume":
        cfg = cfg.replace(**recipe_lib.resumed((saved or {}).get("train", {}), chosen))
    elif start == "fresh" and cfg.data.recipe == "auto":
        shape, first = corpus_shape(cfg, run_dir.prepared)
        recipe = recipe_lib.recipe_for(shape)
        cfg = cfg.replace(**recipe_lib.choose(recipe, chosen, cfg.settings()))
    source = None
    if cfg.run.init_from:
        own_source = saved is not None and "model" in saved and "tokenizer" in saved
        source = saved if own_source else pretrained.read_run(cfg.run.init_from)
        pretrained.check_fine_tune(cfg, source, chosen, run_dir, fresh=fresh, starting=start == "fine-tune")
        architecture = pretrained.model_config(source, cfg.model.overrides())
    else:
        architecture = preset(cfg.model.preset, src_vocab_size=cfg.data.vocab_size, **cfg.model.overrides())
    if shape is not None:
        log(recipe_lib.describe(shape, recipe, _recipe_values(cfg, architecture), chosen))
    resumed_model = TransformerConfig.from_dict(saved["model"]) if saved and "model" in saved else None
    sharding_lib.check_mesh_divides(mesh, resumed_model or architecture, loaded_from=cfg.run.init_from)
    src_lang, tgt_lang = _languages(cfg, source, resumed=source is not None and source is saved)
    bleu = make_bleu(recorded_languages(src_lang, tgt_lang)["target_language"], cfg.decode.sacrebleu_tokenize)
    if cfg.run.devices is not None:
        log(f"using {cfg.run.devices} of {len(jax.devices())} devices (--devices)")
    if cfg.train.warmup_steps >= cfg.train.max_steps:   # legal (short test runs), but rarely what is meant
        log(f"note: --warmup-steps {cfg.train.warmup_steps} >= --max-steps {cfg.train.max_steps}: "
            f"the learning rate rises for the whole run and never reaches its peak or decays; "
            f"lower --warmup-steps "
            f"(e.g. {max(1, cfg.train.max_steps // 10)}) for a full schedule")
    workers = cfg.train.data_workers   # default: none on the CPU, whose cores the step needs
    return RunPlan(cfg=cfg, chosen=chosen, start=start, run_dir=run_dir, saved=saved, source=source,
                   architecture=architecture, src_lang=src_lang, tgt_lang=tgt_lang, bleu=bleu,
                   generation=_generation(cfg, source, chosen), mesh=mesh, t_start=t_start,
                   data_workers=workers if workers is not None else (
                       0 if jax.default_backend() == "cpu" else 2),
                   row_multiple=math.lcm(sharding_lib.batch_shards(mesh) * cfg.train.grad_accum_steps,
                                         jax.process_count()), first_pass=first)


def _recipe_values(cfg: TrainConfig, architecture: TransformerConfig) -> dict[str, Any]:
    """The values of the recipe's settings a run trains with, for the log."""
    return {"vocab_size": cfg.data.vocab_size, "label_smoothing": cfg.train.label_smoothing,
            "num_layers": architecture.num_encoder_layers,
            **{k: getattr(architecture, k) for k in ("dropout_rate", "attention_dropout_rate", "d_model",
                                                     "num_heads", "d_ff")}}


def _languages(cfg: TrainConfig, source: dict[str, Any] | None,
               resumed: bool) -> tuple[str | None, str | None]:
    """The data's ``(source, target)`` language codes: ``--src-lang``/``--tgt-lang``, else a
    multilingual model's (its tokenizer's codes), the shipped pair's, or the loaded run's record;
    ``None`` where none says. Raises ``ValueError`` for other languages on a multilingual
    fine-tune's resume (its prepared data holds the first ones' language tokens)."""
    source = source or {}
    tokenizer = source.get("tokenizer", {})
    multilingual = tokenizer.get("kind") in ("m2m100", "nllb")
    if multilingual:
        known = tokenizer.get("src_lang"), tokenizer.get("tgt_lang")
    elif not (cfg.data.train_file or cfg.data.src_file):   # the shipped corpus of --pair
        known = tuple(cfg.data.pair.split("-"))
    else:   # a run of one pair: its recorded languages ("xx": not known)
        target = source.get("target_language")
        known = source.get("source_language"), None if target == "xx" else target
    asked = cfg.decode.src_lang or known[0], cfg.decode.tgt_lang or known[1]
    if multilingual and resumed and asked != known:
        raise ValueError(f"this run fine-tunes {known[0]} → {known[1]}, not {asked[0]} → {asked[1]}: "
                         f"resume it without --src-lang/--tgt-lang, or fine-tune into another --workdir.")
    return asked


def recorded_languages(src_lang: str | None, tgt_lang: str | None) -> dict[str, str]:
    """``target_language`` (``"xx"``: not known) and ``source_language`` (left out when not known)
    as ``config.json`` records them: the language part of the codes, as BLEU reads it
    (``eng_Latn`` → ``eng``, ``zho_Hans`` → ``zh``)."""
    target = {"target_language": scoring_language(tgt_lang) if tgt_lang else "xx"}
    return target | ({"source_language": scoring_language(src_lang)} if src_lang else {})


def _generation(cfg: TrainConfig, source: dict[str, Any] | None,
                chosen: frozenset[str]) -> dict[str, Any] | None:
    """A fine-tune's generation rules: its source's ``generation`` record (an imported model's
    ``generate`` settings), each key of :data:`GENERATION_FLAGS` whose flag was given replaced."""
    generation = (source or {}).get("generation")
    if generation is None:
        return None
    return {**generation, **{key: getattr(cfg.decode, flag) for flag, key in GENERATION_FLAGS.items()
                             if flag in chosen}}
