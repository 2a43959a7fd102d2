"""The scale backends a run is built from, below the run's plumbing: full mode's settings and the
samplers, rollout schedules and retriever that a configuration swaps in for the toy's.

    settings.py        FullConfig (the run config's `full` section), the paper's batch arithmetic and
                       the DeepSpeed JSON it implies: pure, no torch
    rollout_engine.py  full mode's rollouts without a turn barrier: concurrent tool calls, one seed
                       per request, groups judged as they finish, the reflection branch in a thread
    continuous.py      continuous batching's interface: one request per segment (submit -> Future)
    vllm_sampler.py    VLLMSampler: scaffold.Sampler over a vLLM engine inside this process (every
                       world size: docs/full_mode.md "One engine path"), weight sync, sleep / wake
    engine_loop.py     the sampler's engine loop: every caller's requests share the engine's batches
    vllm_sync_ext.py   the worker half of the weight sync inside vLLM's engine
    cuda_threads.py    start_thread: every thread that may touch CUDA starts on the rank's GPU and
                       the engine's stream (CUDA's current device and stream are per thread)
    memory_phases.py   GPU free / reserved memory at each phase of a step (build, sleep, update, wakes)
    retrieval.py       DenseRetriever: the bank's Qwen3-Embedding retrieval
    zero3_scope.py     where transformers' global ZeRO-3 switch is on (loads) and off (everything else)

Who calls it: backends/run/build.py (rollout_engine at import, the sampler and the retriever only
when the configuration asks for them) and backends/run/presets.py (settings); backends/distributed/
drives them across ranks. Imports nothing of run/, distributed/, sft/ or eval/.

Toy: a toy run imports settings.py, rollout_engine.py and the interface it uses, continuous.py
(build's names), and runs none of them; it never loads vLLM or an embedding model.
"""
