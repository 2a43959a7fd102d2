"""`python -m torch.distributed.run ... tests/sft_kill_check.py K ARGS...`: backends.sft.zero3 with
ARGS, whose rank 0 SIGKILLs itself right after checkpoint K is written (tests/test_sft_resume.py).
The launcher then ends the other ranks, as after a crash or a preemption."""
import os
import signal
import sys

from backends.sft import zero3

kill_at = int(sys.argv[1])
_save = zero3.save_sft_checkpoint


def save_then_die(policy, out, step, *args, **kwargs):
    path = _save(policy, out, step, *args, **kwargs)
    if step == kill_at and path is not None:  # rank 0 returns the path
        os.kill(os.getpid(), signal.SIGKILL)
    return path


zero3.save_sft_checkpoint = save_then_die
sys.exit(zero3.main(sys.argv[2:]))
