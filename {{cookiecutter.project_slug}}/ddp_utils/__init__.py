"""The machinery of training: what train.py orchestrates and a user does not need to edit.

The files a user edits are at the top of the project (config.py, model.py, dataset.py,
train.py and the scripts); this package never imports them, except model.py and dataset.py
through contract.py (the task contract). Each module has one job, on one floor; a module
imports only from the modules listed below it:

    inputs.py        what must hold before a run writes anything: data, trackers (check_inputs)
    doctor_processes.py    doctor.py: 1 vs 2 real processes, their steps under ddp, fsdp and hsdp
    doctor_equivalence.py  doctor.py: 1 vs 2 in one process, an exact resume, the data position,
                           data per rank, fsdp = ddp
    doctor_memory.py       doctor.py: the memory plan per GPU, activations measured
    doctor_checks.py       doctor.py's rows; gradients, shard units, host syncs
    checkpoint.py    the Checkpointer: choose, load, save, the resume position, random generators
    evaluation.py    the Validator: the task's metrics over the whole validation set
    metrics.py       the Meter and Reporter: metrics.jsonl, progress bar, step timing, loss lines, MFU
    strategy.py      --strategy ddp or fsdp: building, wrapping and sharding the model
    profiling.py     --profile_steps
    trackers.py      TensorBoard, W&B, MLflow (--tracker)
    checkpoint_files.py  the checkpoint formats on disk: atomic single files, DCP folders
    data.py          which rank sees which samples, loaders, seeding
    dist.py          the process group, devices, collectives and store waits
    faults.py        error types, stop signals, the watchdog, step agreements, the exit path
    logs.py          rank-aware logging (`rank_zero_only`)
    contract.py      what the loop reads from model.py and dataset.py (the one module that
                     imports them), its defaults, and how a batch of any structure is handled
    inference.py     a trained model in one process (sample.py, predict.py): device, checkpoint
    knobs.py         how a config field is declared, and the one-line error for a bad value
    schedule.py      the learning rate as a pure function of samples trained
    optim.py         the optimizer (AdamW, fused) and gradient clipping
    comm_model.py    what gradients cost to send: the preflight's prediction of a job's step

Rules the package keeps for the rest of the project:
- Rank-0-only side effects (files, console) go through `logs.rank_zero_only`; code under it
  never calls a collective, which would hang the other ranks.
- Decisions that end or skip work are agreed by all ranks with one collective (dist.Agreement).
- On an error the root cause is logged first and nothing blocks the exit (faults.ExitPath).
"""
