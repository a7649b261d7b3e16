"""train.py's main: the config parsed, the process group started and destroyed, the inputs
checked and the output folder claimed before anything is written, and the Trainer run under
the exit path (faults.ExitPath), which turns every way a run ends into an exit code."""

import socket
import sys
from pathlib import Path

from ..configuration import parse_config, write_resolved_config
from ..core.logs import launch_local_rank, print_error, print_from_first, rank_zero_only, setup_logging, warn_main
from ..distributed.faults import ExitPath, write_stop_status
from ..distributed.process_group import cleanup_distributed, setup_distributed
from ..distributed.store_waits import agree
from ..errors import DeviceError, InputError
from .folder_claim import claim_output_dir
from .inputs import check_inputs
from .trainer import Trainer


def write_config(trainer):
    """output_dir/config.toml, once the run is known to start (or resume): the config of its
    latest start, which `--config` reads back."""
    problem = rank_zero_only(write_resolved_config)(trainer.cfg, trainer.output_dir)
    agree(trainer.ctx, "config_written", problem, trainer.cfg.timeout_seconds)


def open_trackers(trainer):
    """Start the trackers' runs (rank 0), or continue them when training resumed."""
    problem = trainer.reporter.open_trackers(trainer.cfg, trainer.step if trainer.resumed else None)
    agree(trainer.ctx, "trackers_open", problem, trainer.cfg.timeout_seconds)


def run(cfg, ctx, task):
    """Train; returns the exit code (ExitPath: how each failure ends). Everything holding
    process-group work (DDP's reducer) is released when this returns, before the group is
    destroyed. Bad data or settings raise InputError before output_dir is created, and so does
    an output_dir that another run owns (folder_claim)."""
    datasets, notes = check_inputs(task, cfg, ctx)
    claim = claim_output_dir(ctx, cfg.output_dir, say=lambda line: print(f"train.py: {line}", file=sys.stderr))
    try:
        setup_logging(ctx, cfg.output_dir)
        for note in [claim.note, *notes]:
            if note:
                warn_main(note)
        with ExitPath(ctx, cfg.timeout_seconds) as ending:
            trainer = ending.watch(Trainer(cfg, ctx, task, datasets))
            trainer.resume()
            write_config(trainer)
            open_trackers(trainer)
            trainer.train()
            trainer.checkpointer.wait()  # an asynchronous save complete before the exit
    finally:  # after a crash ExitPath exits at once: faults.exit_now lets go of the claim (at_exit_now)
        claim.release()
    return ending.code


def main(task, argv=None):
    """Train `task` (contract.Task) with the flags in `argv`; returns the exit code."""
    cfg = parse_config(task.config, argv)
    write_stop_status(None)  # a stop of an earlier (elastic) start is not this one's
    try:
        trace_dir = Path(cfg.output_dir) / "nccl_trace"
        ctx = setup_distributed(cfg.timeout_seconds, trace_dir, cfg.device, host_collectives=cfg.cpu_offload)
    except DeviceError as error:  # each node's first process names its node (a driver broken on one)
        line = f"error: {socket.gethostname()}: {error}"
        print_from_first(line, launch_local_rank() == 0, line)
        return 2
    try:
        code = run(cfg, ctx, task)  # a crash exits inside (faults.ExitPath), without destroying the group
    except InputError as error:  # agreed by every rank; nothing written yet
        print_error(str(error))
        code = 2
    cleanup_distributed()
    return code
