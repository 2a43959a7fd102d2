"""One run's plumbing, the same for the toy and for full mode: what train.py needs besides the paper
layer to configure, build, train, guard, checkpoint, evaluate and report a run.

    config.py         the configuration tree (Config), its sections' registry, the checks, renamed keys
    overrides.py      `--set key=value` typed by the tree, `--list-config`, default run directories
    presets.py        the toy and full presets; registers every section
    cli.py            train.py's command line
    build.py          every component of a run, built once from its configuration
    torch_engine.py   the policy engine of one process (the update of policy.py on a torch model)
    fast_logprobs.py  log-probs on the loss tokens only, shared prompts packed (the full preset's)
    checkpoint.py     checkpoints: atomic, verified, kept in rotation
    resume.py         what a resumed run restores, and the checks that it may resume
    runcard.py        the run card saved with a policy: its prompt, scaffold and configuration
    robust.py         guards of the training loop against judge failures and bad updates
    faults.py         fault injection for the toy judge and search tool
    heldout.py        the held-out evaluation during and after training
    data.py           RL rows from JSONL, Parquet or the Hub; the data order
    report.py         what a person reads: progress, metrics.jsonl, summary, verdict, figure
    provenance.py     where a figure came from: the CPU, torch's kernel set, library versions

Who calls it: train.py, evaluate.py and scripts/; backends/distributed/, eval/ and sft/ build on it.
It imports api/ and scale/ (build.py the heavy backends only when a configuration asks for them).

Toy: every toy run uses it.
"""
