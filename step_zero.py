"""Step 0: the evaluations and the checkpoint of the untrained (or just loaded) model, before the first step, when
eval.fixed_steps or checkpoint.fixed_steps hold 0 (the ladder's runs, a fine-tune's baseline). A module of its own so
that `import train` does not load it: train.py imports it only for such a run.
"""


def at_step_zero(run, due, evaluate):
    """What `due` (plan.due(0)) names: the evaluations (train.py's `evaluate`, passed in, as this module must not
    import train.py back), their row and console line, then the checkpoint."""
    if due.evals:
        run.recorder.record_all(evaluate(run, due, run.stages.loaders[0][0]))
        for line in run.recorder.finish_step(0, collect=True, wait=True):
            print(line, flush=True)
    if due.checkpoint:
        run.save(due.checkpoint)
