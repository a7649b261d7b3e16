"""Training: train.py's main, the loop, and what guards a run's folder and memory.

run.py            train.py's main: the config, the process group, the Trainer's exit path
trainer.py        the Trainer: the training loop, read top to bottom
evaluation.py     the Validator (the task's metrics over the whole validation set) and
                  TextSamples (--sample_every_steps)
inputs.py         what must hold before a run writes anything: data, trackers (check_inputs)
folder_claim.py   one run per output folder: the claim, its heartbeat, takeovers, refusals
out_of_memory.py  out of GPU memory, named: the rank, step, phase, memory, the doctor's plan, the knobs
"""

from .run import main

__all__ = ["main"]
