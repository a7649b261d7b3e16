"""--profile_steps A:B: what rank 0 does in optimizer steps A to B, recorded by torch.profiler.

Writes output_dir/profile/trace_steps_A-B.json, a Chrome trace (open it at
https://ui.perfetto.dev or chrome://tracing), and on GPUs memory_steps_A-B.pickle, a CUDA
memory snapshot (open it at https://pytorch.org/memory_viz). Rank 0 only: the other ranks run
as usual, so a trace shows rank 0 waiting in collectives wherever another rank is slower.
"""

from pathlib import Path

import torch

from ..core.logs import global_rank, log, rank_zero_only


class StepProfiler:
    def __init__(self, cfg, device, output_dir, before_toggle):
        self.range = cfg.profile_range() if global_rank() == 0 else None  # rank 0 records
        self.before_toggle = before_toggle  # waits until no collective is in flight
        self.cuda = device.type == "cuda"
        self.folder = Path(output_dir) / "profile"
        self.profiler = None
        self.marker, self.marker_step = None, None  # the open "optimizer_step#N" range, and N
        self.first_recorded = None

    def at_step(self, done):
        """Call before each micro-batch with the optimizer steps done. Records steps A to B, or
        the steps left of them when a run resumes inside the range. Each step is a range named
        after it (as train.log numbers it), from its first micro-batch to the next step's."""
        if self.range is None or self.marker_step == done + 1:  # nothing to record, or the same step
            return
        first, last = self.range
        if self.profiler is not None:
            self._end_mark()
            if done >= last:
                self.stop()
                return
        elif first - 1 <= done < last:
            if not self._started():
                return
            self.first_recorded = done + 1
        else:
            return
        self.marker, self.marker_step = torch.profiler.record_function(f"optimizer_step#{done + 1}"), done + 1
        self.marker.__enter__()

    def _end_mark(self):
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None

    def _started(self):
        """Start recording; False (with a warning, and --profile_steps off) when the profiler
        cannot start here: a profile never stops a run."""
        try:
            self._start()
        except Exception as error:  # noqa: BLE001 - CUPTI missing, a profiler already running...
            self.profiler, self.range = None, None
            log.warning("--profile_steps: the profiler could not start and is turned off: %s: %s",
                        type(error).__name__, error)  # fmt: skip
            return False
        return True

    def _start(self):
        self.before_toggle()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.start()

    @rank_zero_only
    def stop(self):
        """Write what was recorded, named after the steps in it (a run may end before B)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        self._end_mark()
        self.before_toggle()
        steps = f"{self.first_recorded}-{self.marker_step}"
        self.range = None  # once per run
        try:
            profiler.stop()
            self.folder.mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(self.folder / f"trace_steps_{steps}.json"))
            if self.cuda:
                torch.cuda.memory._dump_snapshot(str(self.folder / f"memory_steps_{steps}.pickle"))
        except Exception as error:  # noqa: BLE001 - a full disk, say: the profile is lost, not the run
            log.warning("--profile_steps: the profile of steps %s could not be written to %s: %s: %s",
                        steps, self.folder, type(error).__name__, error)  # fmt: skip
        finally:
            if self.cuda:
                torch.cuda.memory._record_memory_history(enabled=None)
