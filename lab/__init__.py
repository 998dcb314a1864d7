"""Optional features, each switched on by a setting and imported on the line of the core that tests
it, so a run that leaves them off never reads them:

    fsdp.py          train.data_parallel=fsdp: the model sharded over the ranks, checkpoints in
                     pieces
    remote.py        checkpoint.remote_folder: checkpoints mirrored to a bucket, a fresh node
                     resumes
    hf.py            gpt2 weights in (checkpoint.load_path, sample.py) and out (checkpoint.py
                     export-hf)
    stage2.py        stage2.start: a second stage of data and a KL term to a frozen reference
    step_extras.py   around the step: traces, activations, skipped data, NaN skipping, the profiler
    auto_batch.py    data.batch_size=auto: the largest micro-batch that fits the GPU
    dry_run.py       --dry_run: the plan printed, nothing touched
    rewind.py        checkpoint.resume_step: a run rewound in place to an earlier checkpoint
    model_module.py  train.model_module: a GPT from a file of your own
    notifier.py      log.slack_webhook: a webhook told how the run ends
    debug.py         python lab/debug.py: compare traces and checkpoints, every rank's stacks
    ladder_fit.py    python ladder.py fit / compare: the ladder's scaling-law fit
    scaling_law.py   the mathematics of that fit

Each builds on the core (config.py, checkpoint.py, ...) and is never imported by it at module level.
"""
