"""python -m backends.distributed {dry-run, selftest}: full mode's dry run of the full preset
(dry_run.py) and the ZeRO-3 self-test on a synthetic batch (selftest.py).

Launch
    python -m backends.distributed dry-run                                   # print the plan, check the machine
    torchrun --nproc_per_node 2 -m backends.distributed selftest --model DIR --out DIR  # ZeRO-3 check, any device
"""
from __future__ import annotations

import argparse
import logging
import warnings
from typing import Sequence

from backends.distributed.dist import _shutdown, exit_process, rank0_print
from backends.distributed.dry_run import main_dry_run
from backends.distributed.selftest import selftest
from backends.run.presets import full_preset
from backends.scale.settings import FullConfig


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backends.distributed",
                                 description="RubricEM full mode: dry run and ZeRO-3 self-test")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dry-run", help="print the full preset's launch plan and check this machine")
    st = sub.add_parser("selftest", help="ZeRO-3 update steps on a synthetic batch (run under torchrun)")
    st.add_argument("--model", required=True, help="local HF causal-LM directory")
    st.add_argument("--out", required=True)
    st.add_argument("--updates", type=int, default=1)
    st.add_argument("--n-seq", type=int, default=16)
    st.add_argument("--group", type=int, default=8)
    st.add_argument("--minibatches", type=int, default=2)
    st.add_argument("--micro", type=int, default=2)
    st.add_argument("--lr", type=float, default=1e-3)
    st.add_argument("--min-len", type=int, default=24)
    st.add_argument("--max-len", type=int, default=48)
    st.add_argument("--eta", type=float, default=None, help="PPO clip range (default: the preset's)")
    st.add_argument("--optimizer", default="torch", choices=["torch", "deepspeed", "auto"])
    st.add_argument("--no-grad-ckpt", action="store_true")
    st.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # torch deprecation notices raised inside DeepSpeed's collectives, once per call: not ours to fix.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    if a.cmd == "dry-run":
        return main_dry_run(full_preset())
    full = FullConfig(optimizer=a.optimizer, gradient_checkpointing=not a.no_grad_ckpt)
    res = selftest(a.model, a.out, updates=a.updates, n_seq=a.n_seq, group=a.group,
                   minibatches=a.minibatches, micro=a.micro, lr=a.lr, min_len=a.min_len,
                   max_len=a.max_len, eta=a.eta, full=full)
    _shutdown()
    for i, s in enumerate(res["per_step"]):
        rank0_print(f"step {i}: loss {s['loss/total']:.6f} kl {s['kl']:.3e} "
                    f"clip_frac {s['clip_frac']:.3f} grad_norm {s['grad_norm']:.4f}")
    rank0_print(f"world {res['world_size']} on {res['device']}: load {res['load_s']:.1f} s, "
                f"update {sum(res['update_s']):.2f} s for {len(res['update_s'])} update(s), "
                f"{res['update_tokens_per_s']:.0f} tokens/s, save {res['save_s']:.1f} s")
    return 0


if __name__ == "__main__":
    exit_process(main())
