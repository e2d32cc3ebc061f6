"""The one line of ``--help`` of every training flag (:class:`jaxformer.run.config.TrainConfig`
fields), for ``train.py`` and every tool that takes training flags."""

# One line of help per flag (``--help``); a test checks every field has one.
HELP: dict[str, str] = {
    "workdir": "run directory: checkpoints, logs, results; an existing run is resumed "
               "(default: runs/<pair or corpus file name>)",
    "pair": "shipped corpus to train on when no --train-file/--src-file is given",
    "train_file": "your corpus: source<TAB>target lines (.tsv or .tsv.gz)",
    "src_file": "your corpus as two aligned text files: the source side",
    "tgt_file": "your corpus as two aligned text files: the target side",
    "dev_file": "explicit dev set (TSV) instead of a split of the corpus",
    "test_file": "explicit test set (TSV) instead of a split of the corpus",
    "preset": "model size; the model flags below override single fields",
    "d_model": "model width D (default: the preset's)",
    "num_heads": "attention heads H; must divide --d-model (default: the preset's)",
    "d_ff": "feed-forward hidden width F (default: the preset's)",
    "num_layers": "encoder and decoder layers each (default: the preset's)",
    "dropout_rate": "residual and embedding dropout (default: the preset's)",
    "max_len": "longest sequence in tokens, source or target (default: the preset's)",
    "norm_position": "post = the paper's LayerNorm after the residual, pre = before",
    "dtype": "compute dtype; parameters stay float32 (default: float32)",
    "attention_backend": "reference (can return weights), xla (any device), cudnn (NVIDIA GPUs) or "
                         "pallas (TPU splash attention)",
    "remat": "recompute layer activations in the backward pass: less memory, more compute",
    "scan_layers": "run each stack's layers as one scanned body over stacked parameters: compile "
                   "time and program size stop growing with depth; checkpoints convert either way",
    "vocab_size": "sentencepiece vocabulary size, shared by source and target",
    "max_train_len": "drop (and count) longer training pairs, in tokens (default: --max-len)",
    "batch_tokens": "padded tokens per update (rows x row length)",
    "pack": "pack several pairs into each row; --no-pack uses length buckets instead",
    "max_steps": "stop after this many updates",
    "max_minutes": "stop after this many minutes of wall time (the progress bar follows it)",
    "warmup_steps": "linear learning-rate warm-up steps (both schedules)",
    "lr_schedule": "inverse_sqrt = the paper's warm-up then 1/sqrt(step) (§5.3); wsd = warm-up, "
                   "the paper's peak held, then a linear decay to zero at --max-steps",
    "decay_fraction": "wsd: the last fraction of --max-steps over which the rate decays to zero",
    "lr_scale": "multiplies the paper's learning-rate schedule",
    "label_smoothing": "label smoothing epsilon of the loss, in [0, 1)",
    "grad_clip": "clip the global gradient norm to this value (default: no clipping)",
    "grad_accum_steps": "micro-batches per update; --batch-tokens is per update",
    "mesh": "device mesh over data, fsdp and model, e.g. data=4,model=2 or data=2,fsdp=4 "
            "(default: every device on data)",
    "devices": "single-process runs: use only the first N devices (default: all)",
    "distributed": "call jax.distributed.initialize() with cluster auto-detection",
    "coordinator_address": "host:port of process 0 in a multi-process run",
    "num_processes": "number of processes in a multi-process run",
    "process_id": "this process's index in a multi-process run",
    "seed": "root random seed (initialisation, dropout, data order)",
    "eval_every": "evaluate dev loss and BLEU every this many steps",
    "dev_bleu_sentences": "dev sentences decoded for BLEU at each evaluation",
    "eval_batch_size": "sentences per decoding batch in evaluation",
    "beam_size": "beam width for dev/test BLEU; 1 = greedy",
    "alpha": "GNMT length-penalty exponent of beam search",
    "no_repeat_ngram_size": "dev/test decoding never repeats an n-gram of this size (0 = off; "
                            "fairseq --no-repeat-ngram-size)",
    "repetition_penalty": "dev/test decoding divides the scores of already generated tokens by "
                          "this (1 = off; > 1 discourages repeats; CTRL, HF generate)",
    "log_every": "log loss, tokens/s and learning rate every this many steps",
    "checkpoint_every": "save a checkpoint every this many steps",
    "keep_checkpoints": "training checkpoints kept on disk (the newest ones)",
    "num_samples": "dev translations written to samples.txt at each evaluation",
    "progress": "show a progress bar; --no-progress prints one line per --log-every steps",
    "tgt_lang": "target language code used to pick the BLEU tokenizer (default: the corpus's)",
    "sacrebleu_tokenize": "sacrebleu tokenizer for BLEU (default: zh, ja-mecab, ko-mecab or 13a "
                          "by target language)",
    "patience": "stop after this many evaluations without a better dev BLEU (default: never)",
    "average_last": "at the end, average the last N checkpoints; kept if its dev BLEU is better",
    "init_from": "fine-tune: start from this run's weights, architecture and tokenizer (a run "
                 "directory from jaxformer-train or jaxformer-convert --from-hf); fresh optimizer and step",
    "max_length_ratio": "prepare: drop pairs whose source/target token counts differ by more "
                        "than this factor (Moses clean-corpus-n)",
    "bt_file": "back-translated pairs (synthetic source<TAB>real target, .tsv or .gz) added to "
               "training, sources tagged with the tokenizer's reserved <BT> piece",
    "bt_ratio": "synthetic pairs per real training pair: --bt-file's pairs sampled or repeated to "
                "this (default: each once)",
    "data_workers": "grain worker processes that collate training batches ahead of the step "
                    "(default: 0 on CPU, whose cores the step uses; 2 on GPU/TPU)",
}
