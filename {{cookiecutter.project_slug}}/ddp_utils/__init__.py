"""The machinery of training: what the entry points at the top of the project run, and what a
user does not need to edit.

The user's files are at the top of the project (config.py, model.py, dataset.py, task.py and
the task's scripts); this package never imports them. train.py, doctor.py, preflight.py,
export.py and sweep.py hand it the task (task.py's TASK, a contract.Task) and call a
`main(task)` here. Each module has one job, on one floor; a module imports only from the modules listed below it:

    sweep.py         sweep.py's main: a worker of an Optuna study, each trial a training run
    sweep_results.py a sweep's table, best config and pictures; any runs' loss curves
    sweep_trial.py   one trial: scripts/launch.sh started, its metrics followed, stopped, judged
    sweep_file.py    a sweep file read and checked: knobs, ranges, metric, the trials' flags
    preflight.py     preflight.py's main: the job's step timed, what the network costs, the verdict
    run.py           train.py's main: the config, the process group, the Trainer's exit path
    trainer.py       the Trainer: the training loop, read top to bottom
    preflight_checks.py  the preflight's checks of one process and its network measurements
    doctor.py        doctor.py's main: what each check does, the report
    doctor_processes.py    1 vs 2 real processes, their steps under ddp, fsdp and hsdp
    doctor_memory.py       the memory plan per GPU, activations measured
    doctor_equivalence.py  1 vs 2 in one process, an exact resume, the data position, data per
                           rank, fsdp = ddp
    doctor_checks.py       the doctor's rows; gradients, shard units, host syncs
    doctor_numerics.py     how closely two runs must agree: the model's own precision
    export.py        export.py's main: a checkpoint as one file or a Hugging Face folder
    inputs.py        what must hold before a run writes anything: data, trackers (check_inputs)
    folder_claim.py  one run per output folder: the claim, its heartbeat, takeovers, refusals
    checkpoint.py    the Checkpointer: choose, load, save, when to save, random generators,
                     room for the checkpoints before the first step
    evaluation.py    the Validator (the task's metrics over the whole validation set) and
                     TextSamples (--sample_every_steps)
    metrics.py       the Meter and Reporter: metrics.jsonl, progress, step timing, loss lines
    out_of_memory.py out of GPU memory, named: the rank, step, phase, memory, the doctor's plan, the knobs
    flops.py         MFU: a sample's FLOPs and the GPU's peak
    strategy.py      --strategy ddp or fsdp: building, wrapping and sharding the model
    profiling.py     --profile_steps
    configuration.py a run's config from config.py's defaults, a TOML file and the flags; the
                     checks across fields; the TOML file that reproduces a run
    trackers.py      TensorBoard, W&B, MLflow (--tracker)
    checkpoint_files.py  the checkpoint formats on disk: single files, DCP folders
    checkpoint_space.py  a checkpoint's size, the room the kept ones need, a full disk in words
    data.py          which rank sees which samples, loaders, seeding
    dist.py          the process group, devices, collectives
    store_waits.py   waits through the store, cut short by the ranks' heartbeats
    faults.py        error types, stop signals, the watchdog, step agreements, the exit path
    logs.py          rank-aware logging (`rank_zero_only`)
    contract.py      the Task: every hook the machinery reads, its defaults, near misses
                     reported, and how a batch of any structure is handled
    inference.py     a trained model in one process (the task's scripts): device, checkpoint
    knobs.py         how a config field is declared, and the one-line error for a bad value
    files.py         files and folders written whole or not at all
    precision.py     --amp: the autocast dtypes and the one autocast context
    schedule.py      the learning rate as a pure function of samples trained
    optim.py         the optimizer (AdamW, fused) and gradient clipping
    comm_model.py    what gradients cost to send: the preflight's prediction of a job's step
    compat.py        bridges between the torch releases the project supports
    collector.py     Python's garbage collector kept out of the training steps

Rules the package keeps for the rest of the project:
- Rank-0-only side effects (files, console) go through `logs.rank_zero_only`; code under it
  never calls a collective, which would hang the other ranks.
- Decisions that end or skip work are agreed by all ranks with one collective (dist.Agreement).
- On an error the root cause is logged first and nothing blocks the exit (faults.ExitPath).
"""
