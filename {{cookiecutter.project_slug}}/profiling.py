"""--profile_steps A:B: what rank 0 does in optimizer steps A to B, recorded by torch.profiler.

Writes output_dir/profile/trace_steps_A-B.json, a Chrome trace (open it at
https://ui.perfetto.dev or chrome://tracing), and on GPUs memory_steps_A-B.pickle, a CUDA
memory snapshot (open it at https://pytorch.org/memory_viz). Rank 0 only: the other ranks run
as usual, so a trace shows rank 0 waiting in collectives wherever another rank is slower.
"""

from pathlib import Path

import torch

from ddp_utils import rank_zero_only


class StepProfiler:
    def __init__(self, cfg, device, output_dir):
        self.range = cfg.profile_range()
        self.cuda = device.type == "cuda"
        self.folder = Path(output_dir) / "profile"
        self.profiler = None
        self.marker = None  # the open "optimizer_step#N" range

    @rank_zero_only
    def at_step(self, done):
        """Call with the optimizer steps done: as training starts, and after each step."""
        if self.range is None:
            return
        first, last = self.range
        if self.profiler is None and done == first - 1:
            self._start()
            self._mark(done + 1)
        elif self.profiler is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None
            if done >= last:
                self.stop()
            else:
                self._mark(done + 1)

    def _mark(self, step):
        """A range named after the optimizer step, as train.log numbers it, around its work."""
        self.marker = torch.profiler.record_function(f"optimizer_step#{step}")
        self.marker.__enter__()

    def _start(self):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.start()

    @rank_zero_only
    def stop(self):
        """Write what was recorded (the run may end, or stop, before step B)."""
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None
        profiler.stop()
        first, last = self.range
        self.folder.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(self.folder / f"trace_steps_{first}-{last}.json"))
        if self.cuda:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory_steps_{first}-{last}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        self.range = None  # once per run
