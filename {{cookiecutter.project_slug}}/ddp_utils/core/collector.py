"""Python's garbage collector kept out of the training steps: its full collections run where
the run waits anyway (after a checkpoint, after an evaluation), never in the middle of a step.

A full collection walks every object the process holds: with torch, a model and its data,
hundreds of thousands. Left to its own thresholds it starts whenever enough objects have
survived, in the middle of some step, on every rank at about the same time (the ranks run the
same code): 0.25-0.43 s of a whole job's time seen on a CPU run at step 18, and on a GPU an idle
device for as long. As nanochat and the speedrun do, the objects of the set-up (the model,
the datasets, torch's own modules) are frozen once (`gc.freeze`: later collections skip them),
and automatic full collections are off while training; young collections, which only look at
the objects made since the last one, stay on, so short-lived reference cycles are still freed
as they come. `collect()` does a full collection (and freezes its survivors) at the places the
loop calls it. `close()` gives the collector back its thresholds, those of before the first
`start()` (a second start, a notebook training the same Trainer again, keeps them): whatever
the process runs next (a notebook, a sweep, the doctor) collects as it did before the run.
"""

import gc

NEVER = 2**31 - 1  # the oldest generation's threshold: never reached


class Collector:
    def __init__(self):
        self.thresholds = None

    def start(self):
        """Before the first step: collect, freeze what survived, no automatic full collections."""
        gc.collect()
        gc.freeze()
        if self.thresholds is None:  # started already: gc's thresholds are this collector's own
            self.thresholds = gc.get_threshold()
        young, middle = self.thresholds[:2]
        gc.set_threshold(young, middle, NEVER)

    def collect(self):
        """A full collection, where the run waits anyway (after a checkpoint or an evaluation)."""
        if self.thresholds is not None:
            gc.collect()
            gc.freeze()

    def close(self):
        if self.thresholds is not None:
            gc.set_threshold(*self.thresholds)
            gc.unfreeze()
            self.thresholds = None
