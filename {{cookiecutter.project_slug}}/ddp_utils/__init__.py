"""The machinery of training: what the entry points at the top of the project run, and what a
user does not need to edit.

The user's files are at the top of the project (config.py, model.py, dataset.py, task.py and
the task's scripts); this package never imports them. train.py, doctor.py, preflight.py,
export.py and sweep.py hand it the task (task.py's TASK, a contract.Task) and call the `main(task)`
of the part of the same name here. One line per part, floor by floor: a part imports only from
the parts listed below it (tests/test_structure.py holds this); each folder's __init__.py lists
its modules.

    sweep/            sweep.py: a worker of an Optuna study, each trial a training run; its results
    preflight/        preflight.py: the job's step timed on its nodes, what the network costs, the verdict
    doctor/           doctor.py: the model checked on a laptop: 1 vs 2 processes, resume, memory per GPU
    export.py         export.py's main: a checkpoint as one file or a Hugging Face folder
    train/            train.py: the Trainer's loop, its run, the folder claim, inputs, evaluation, out of memory
    parallel/         --strategy ddp, fsdp or hsdp: building, wrapping and sharding the model
    configuration.py  a run's config from config.py's defaults, a TOML file and the flags; the
                      checks across fields; the TOML file that reproduces a run
    observe/          metrics lines, trackers, MFU, profiles: nothing here may stop a run
    checkpoint/       the Checkpointer, the formats on disk (one file, DCP folders), the room they need
    data/             which rank sees which samples, loaders, seeding; tables, image folders and shards read and checked
    optim/            the optimizer (AdamW, Muon), gradient clipping, the learning rate schedule
    distributed/      the process group, devices, collectives, waits through the store, faults
    inference.py      a trained model in one process (the task's scripts): device, checkpoint
    contract.py       the Task: every hook the machinery reads, its defaults, near misses
                      reported, and how a batch of any structure is handled
    knobs.py          how a config field is declared, and the one-line error for a bad value
    core/             logging by rank, files written whole, byte sizes, torch bridges, autocast, the collector
    errors.py         every error class the machinery raises, and what each means for the run

Rules the package keeps for the rest of the project:
- Rank-0-only side effects (files, console) go through `logs.rank_zero_only`; code under it
  never calls a collective, which would hang the other ranks.
- Decisions that end or skip work are agreed by all ranks with one collective (collectives.Agreement).
- On an error the root cause is logged first and nothing blocks the exit (faults.ExitPath).
"""
