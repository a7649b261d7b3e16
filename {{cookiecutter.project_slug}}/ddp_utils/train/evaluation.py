"""Evaluation: the task's metrics (the Task's evaluation_sums and evaluation_metrics, or the
contract's defaults) over exactly the whole validation set, the same numbers on every rank;
and samples of the model's output while it trains (--sample_every_steps)."""

import torch
import torch.distributed as dist

from ..contract import count_samples, model_inputs, to_device
from ..core.logs import warn_main
from ..core.precision import autocast


class Validator:
    def __init__(self, cfg, ctx, task, strategy, loader, watchdog, amp_dtype):
        self.every = cfg.eval_every_steps  # 0: at each epoch's end (the trainer's call)
        self.device, self.task, self.strategy, self.loader = ctx.device, task, strategy, loader
        self.watchdog, self.amp_dtype = watchdog, amp_dtype

    def should_validate(self, step):
        """Whether --eval_every_steps asks for a metrics line after optimizer step `step`."""
        return bool(self.every) and step % self.every == 0

    @torch.no_grad()
    def evaluate(self):
        """Sums over every batch and rank, then divided: not an average of per-rank averages.
        Every rank calls it (it all-reduces) and gets the same metrics."""
        model = self.strategy.module  # not DDP's forward: nothing to synchronise in evaluation
        model.eval()
        names, on_device, on_host, samples = None, None, None, 0
        for batch, counted in validation_batches(self.loader, self.strategy.sharded, self.device):
            self.watchdog.beat("evaluation")
            batch = to_device(batch, self.device)
            with autocast(self.device, self.amp_dtype):
                output = model(model_inputs(batch))
            sums = self.task.evaluation_sums(output, batch)
            if names is None:
                names = list(sums)
                on_device = torch.zeros(len(names), dtype=torch.float64, device=self.device)
                on_host = [0.0] * len(names)
            if not counted:  # a batch run only to keep the ranks' all-gathers in step counts nowhere
                continue
            # Tensors on the device are summed there; Python numbers (and CPU tensors) on the host:
            # a number turned into a device tensor would be a copy the host waits for, each batch.
            for i, value in enumerate(sums.values()):
                if isinstance(value, torch.Tensor) and value.device == self.device:
                    on_device[i] += value.detach().double().reshape(())
                else:
                    on_host[i] += float(value)
            samples += count_samples(batch)
        host = torch.tensor([*on_host, samples], dtype=torch.float64).to(self.device)  # one copy
        totals = torch.cat([on_device, on_device.new_zeros(1)]) + host
        dist.all_reduce(totals)  # sums and counts, not an average of per-rank averages
        model.train()
        *sums, samples = totals.tolist()
        metrics = self.task.evaluation_metrics(dict(zip(names, sums)))
        return {**{name: float(value) for name, value in metrics.items()}, "val_samples": int(samples)}


def validation_batches(loader, sharded, device):
    """This rank's validation batches, each with whether it counts. Under FSDP every forward
    all-gathers parameters, so every rank runs as many as the rank with the most (ranks may
    hold one sample more than others): the ones short of it repeat their last batch,
    counted nowhere. Every rank runs at least one: the sums' names come from it."""
    batches = torch.tensor([max(1, len(loader))], device=device)
    if sharded:
        dist.all_reduce(batches, op=dist.ReduceOp.MAX)
    batch = None
    for batch in loader:
        yield batch, True
    if batch is None:  # no validation sample at all on this rank: any input will do
        batch = loader.collate_fn([loader.dataset[0]])
    for _ in range(batches.item() - len(loader)):
        yield batch, False


class TextSamples:
    """--sample_every_steps: the task's `sample_text(model, cfg, data)`, logged by rank 0 and sent to
    the trackers. Training goes on as if it had not run: the random generators are restored,
    no gradient is kept, the model is back in training mode. Under ddp rank 0 alone runs the
    unwrapped model (no collective); under fsdp every rank runs it, as each forward all-gathers
    the shards. An error turns sampling off and training goes on, as it is the same on every
    rank that runs it; running out of memory is not (one rank's, not its peers'): it stops the
    run, as anywhere else (the trainer's MemoryGuard names it)."""

    def __init__(self, cfg, ctx, task, strategy, reporter, amp_dtype, data):
        self.cfg, self.device, self.strategy, self.reporter = cfg, ctx.device, strategy, reporter
        self.sample_text, self.amp_dtype = task.sample_text, amp_dtype
        self.data = data  # the training set's data_state(): its tokenizer, say
        self.runs_here = ctx.is_main or strategy.sharded

    def at_step(self, step):
        if not (self.cfg.sample_every_steps and step % self.cfg.sample_every_steps == 0 and self.runs_here):
            return
        model = self.strategy.module
        model.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                with autocast(self.device, self.amp_dtype):
                    text = self.sample_text(model, self.cfg, self.data)
        except torch.OutOfMemoryError:
            raise  # turned off on this rank alone, its peers' all-gathers under fsdp would fall out of step
        except Exception as error:  # noqa: BLE001 - the same on every rank that runs it: training goes on
            warn_main(f"--sample_every_steps: sample_text failed and is turned off: {type(error).__name__}: {error}")
            self.runs_here = False
            return
        finally:
            model.train()
        self.reporter.sample(step, text)
