"""Tensor-parallel ranks: one engine, one model split over ``--tensor-parallel-size`` processes.

Rank 0 is the engine (it schedules, samples and serves); ranks 1..N-1 are worker processes it
spawns (``torch.multiprocessing``), each holding its share of the weights (``model/shards.py``)
and a pool of its KV heads (one ``PageFormat`` per rank). Once per step rank 0 sends every
worker the step (``messages.py``: the scheduler's KV orders and the step's host tensors) through
a pipe; then all ranks run the same step (``ModelRunner.run_step``), meeting in the collectives
of the model (two all-reduces a layer, the vocab-parallel ends) and of the KV bytes that leave
or reach the store (``kv_ranks.py``).

* ``group.py``: the process group (gloo on CPUs, NCCL + gloo on GPUs), each rank's threads;
* ``messages.py``: what rank 0 sends and the workers answer;
* ``workers.py``: rank 0's side: start, send, watch (a dead or failed worker ends the engine
  with ``RankFailure``), stop;
* ``worker.py``: a worker's life: join, load, build, run steps until told to stop;
* ``kv_ranks.py``: the store's bytes over the ranks (heads joined onto rank 0, split from it);
* ``startup.py``: start-up's ranks section (rank 0's model, the workers, their pools).
"""
