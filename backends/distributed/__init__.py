"""Full mode across the launcher's ranks, DeepSpeed ZeRO-3 for the update (appendix: "ZeRO-3 with CPU
offload, gradient checkpointing"), rank 0 running Algorithm 1 and the other ranks following it.

    dist.py          where this process sits (from the launcher's environment), the collectives,
                     a clean end of a multi-rank process
    zero3.py         pi_theta (ZeRO3Policy) and pi_ref (FrozenReference) under ZeRO-3
    engine.py        ZeRO3Engine: train.py's policy engine on ZeRO-3; rank 0's commands (update,
                     sample, sync, save, load) and the other ranks' serve loop
    overlap.py       the overlapped step: step t's reflection branch beside step t+1's rollouts
    dry_run.py       resolve the configuration, check the machine, print the plan
    plan.py          the memory and step-time plan of the dry run (and of the SFT stage)
    launch_check.py  launch checks: keys on every rank that needs them, DeepSpeedCPUAdam, /dev/shm
    versions.py      the one tested set of full-mode versions (`python -m backends.distributed.versions`)
    selftest.py      a synthetic update batch and the ZeRO-3 self-test
    __main__.py      `python -m backends.distributed {dry-run, selftest}`

Who calls it: train.py (engine "zero3", --full, --dry-run; the overlapped step every run) and
backends/sft/zero3.py. It builds on run/, scale/ and api/.

Toy: train.py imports overlap.py, whose overlapped_step answers None for a toy run (its step is
train.rl_step); nothing else, so a toy run never loads DeepSpeed.
"""
