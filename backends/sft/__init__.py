"""The SFT stage at scale (the paper starts RL from an SFT checkpoint of Qwen3-8B): teacher
trajectories and supervised fine-tuning on them under ZeRO-3.

    teacher.py  teacher trajectories from an LLM behind HTTP with live search
                (`python -m backends.sft.teacher`)
    zero3.py    the SFT run on ZeRO-3 ranks (`torchrun -m backends.sft.zero3`); writes the run card
    pack.py     length bucketing and the per-rank deal of the SFT batches

Who calls it: a person, from the command line (docs/full_mode.md); nothing imports it. It builds on
distributed/ (ZeRO-3), run/ (data, presets, run card) and api/ (the teacher's HTTP client).

Toy: never; the toy's warm start is toy/sft.py.
"""
