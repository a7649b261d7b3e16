"""Run a training script (the generated train.py or a floor) with the same named ranges added
to both, for bench/breakdown.py. Under torchrun, from the generated project's folder:

    torchrun ... bench/profiled.py train.py --profile_steps 101:200 ...   # its own profiler
    torchrun ... bench/profiled.py minimal_gpt_ddp.py --profile_steps 101:200 ...

The ranges wrap the functions both loops call (`Tensor.backward`, `F.cross_entropy`) and the
generated loop's own steps (clipping, the step agreement); they cost a Python call each, in
both loops alike, only here. For a script with no --profile_steps of its own (the floor), this
records optimizer steps A to B on rank 0 (both loops without shapes and memory), started
and stopped at an optimizer step's end (nothing is in flight then: the floor has no
collective of its own).
"""

import functools
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path.cwd()))  # the generated project


def named(name, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return function(*args, **kwargs)

    return wrapper


_profile = torch.profiler.profile


def light_profile(*args, **kwargs):
    """Without shapes and memory, for both loops: each recorded operation costs less, so the
    breakdown is nearer to a plain step."""
    return _profile(*args, **{**kwargs, "record_shapes": False, "profile_memory": False})


torch.profiler.profile = light_profile
# train.py's profiler also records a CUDA memory history (a stack per allocation): host work a
# plain step does not do, so the breakdown leaves it out.
torch.cuda.memory._record_memory_history = lambda *args, **kwargs: None
torch.cuda.memory._dump_snapshot = lambda *args, **kwargs: None
torch.Tensor.backward = named("bench:backward", torch.Tensor.backward)
F.cross_entropy = named("bench:loss", F.cross_entropy)
try:  # the generated project's machinery; absent in a floor's run it is simply unused
    from ddp_utils.distributed import collectives
    from ddp_utils.parallel import strategy

    for cls in (strategy.DDPStrategy, strategy.FSDPStrategy):
        cls.clip_gradients = named("bench:clip", cls.clip_gradients)
    collectives.Agreement.__init__ = named("bench:agreement", collectives.Agreement.__init__)
    collectives.Agreement.result = named("bench:agreement_read", collectives.Agreement.result)
except ImportError:
    pass

script, *args = sys.argv[1:]
if "train.py" not in script:  # the floor: the profiler is this driver's
    first, last = 0, -1
    if "--profile_steps" in args:
        at = args.index("--profile_steps")
        first, _, last = args.pop(at + 1).partition(":")
        first, last = int(first), int(last)
        args.pop(at)
    steps, recording = 0, None

    def at_step_end(optimizer, *_):
        global steps, recording
        steps += 1
        if os.environ.get("RANK", "0") != "0":
            return
        if steps == first - 1:
            recording = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            recording.start()
        elif steps == last and recording is not None:
            recording.stop()
            folder = Path(os.environ["BENCH_PROFILE_DIR"])
            folder.mkdir(parents=True, exist_ok=True)
            recording.export_chrome_trace(str(folder / f"trace_steps_{first}-{last}.json"))
            recording = None

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(at_step_end)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
