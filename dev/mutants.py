"""Mutation check of the generated project's own test suite (not part of CI: minutes per bug).

Bakes the template with its defaults (and each other task a mutant names), then for each
mutant, one at a time: copies the project of its task, applies one realistic bug (an exact
text replacement that must match once, so a mutant that no longer fits the code fails loudly
instead of passing silently), and runs the tests that should catch it. A mutant is *caught*
when those tests fail. First, a control run checks that the same tests pass on the unchanged
projects. Prints a Markdown table.

    bash dev/mutants.sh                        # every mutant, once
    bash dev/mutants.sh --repeat 3             # each three times: "caught every time"
    bash dev/mutants.sh no_sync_dropped rng_not_restored
    bash dev/mutants.sh --list
    bash dev/mutants.sh --quick-check loss_not_divided_by_accumulation     # a plain `pytest` must catch it
    bash dev/mutants.sh --quick-check --zoo llama optimizer_not_restored   # on tests/zoo's Llama

With --quick-check each mutant is run against the project's default `pytest` (the quick check:
the tests marked quick) instead of its own tests, and the failing assertion is printed: its
numbers against the tolerance are the margin by which the mutant is caught. With --zoo NAME
the language bake's model.py gets tests/zoo/language.py appended and runs with ZOO_MODEL=NAME
(a model nobody here wrote, as test_zoo.py drops it in).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent
TIMEOUT = 900  # seconds for one mutant's tests; a hang counts as caught only if the tests fail


@dataclass(frozen=True)
class Mutant:
    name: str
    bug: str
    file: str
    old: str
    new: str
    tests: tuple
    task: str = "language"  # the project it applies to; the default task unless a task's own code


CORRECTNESS = "tests/test_correctness.py"
RESILIENCE = "tests/test_resilience.py"
PREEMPTION = "tests/test_preemption.py"
FSDP = "tests/test_fsdp.py"
CLAIM = "tests/test_folder_claim.py"
SWEEP = "tests/test_sweep.py"
ACTIVATIONS = "tests/test_activation_checkpointing.py"
OFFLOAD = "tests/test_cpu_offload.py"
STREAMING = "tests/test_streaming.py"
CHAOS = "tests/test_chaos.py"
OOM = "tests/test_out_of_memory.py"

MUTANTS = [
    Mutant(
        "sampler_ignores_epoch",
        "every epoch sees the same order",
        "ddp_utils/data/loaders.py",
        "manual_seed(mix_seed(self.seed, self.epoch))",
        "manual_seed(mix_seed(self.seed, 0))",
        ("tests/test_data.py::test_epochs_and_seeds_change_the_order",),
    ),
    Mutant(
        "no_sync_dropped",
        "gradients all-reduced on every micro-step",
        "ddp_utils/parallel/strategy.py",
        "return contextlib.nullcontext() if sync else self.model.no_sync()",
        "return contextlib.nullcontext()",
        (f"{CORRECTNESS}::test_accumulation_all_reduces_once_per_optimizer_step",),
    ),
    Mutant(
        "loss_not_divided_by_accumulation",
        "accumulated gradients are grad_accum_steps times too large",
        "ddp_utils/train/trainer.py",
        "self.scaler.scale(loss / accum if accum > 1 else loss).backward()",
        "self.scaler.scale(loss).backward()",
        (f"{CORRECTNESS}::test_world_size_and_accumulation_give_the_same_gradients",),
    ),
    Mutant(
        "per_rank_mean_evaluation",
        "validation averages the ranks' averages",
        "ddp_utils/train/evaluation.py",
        "        dist.all_reduce(totals)  # sums and counts, not an average of per-rank averages\n",
        "        totals[:-1] /= totals[-1]\n"
        "        dist.all_reduce(totals)\n"
        "        totals[:-1] *= totals[-1] / dist.get_world_size()\n",
        (f"{CORRECTNESS}::test_evaluation_counts_every_sample_once",),
    ),
    Mutant(
        "padded_validation",
        "validation pads ranks to equal size (DistributedSampler)",
        "ddp_utils/data/loaders.py",
        "val_sampler = range(ctx.rank, len(val_set), ctx.world_size)",
        "val_sampler = [i % len(val_set) for i in range(ctx.rank, -(-len(val_set) // ctx.world_size) * "
        "ctx.world_size, ctx.world_size)]",
        ("tests/test_data.py::test_validation_covers_every_sample_once_for_any_world_size",),
    ),
    Mutant(
        "non_atomic_save",
        "checkpoints written in place",
        "ddp_utils/core/files.py",
        '    tmp = path.with_name(f".{WRITER}.{path.name}.tmp")\n    try:\n        with open(tmp, mode, **open_args) as f:',
        '    tmp = path.with_name(f".{WRITER}.{path.name}.tmp")\n    try:\n        with open(path, mode, **open_args) as f:',
        (f"{RESILIENCE}::test_a_crash_during_any_checkpoint_write_loses_nothing",),
    ),
    Mutant(
        "non_atomic_last",
        "last.pt written in place after the numbered file",
        "ddp_utils/checkpoint/single_file.py",
        "            _atomic_link(numbered, last, state)",
        "            torch.save(state, last)",
        (f"{RESILIENCE}::test_a_crash_during_any_checkpoint_write_loses_nothing",),
    ),
    Mutant(
        "optimizer_not_restored",
        "resume starts AdamW's moments afresh",
        "ddp_utils/parallel/strategy.py",
        "        optimizer.load_state_dict(saved)\n",
        "",
        (f"{RESILIENCE}::test_resume_mid_epoch_is_bit_identical",),
    ),
    Mutant(
        "rng_not_restored",
        "resume restarts the random generators",
        "ddp_utils/checkpoint/checkpointer.py",
        '            set_rng_state(ranks[self.ctx.rank]["rng"])\n',
        "",
        (f"{RESILIENCE}::test_resume_mid_epoch_restores_the_random_generators",),
    ),
    Mutant(
        "stop_decided_alone",
        "a rank acts on its own stop request without the others",
        "ddp_utils/distributed/faults.py",
        "        return self.decide(agreement.result(), step, epoch)\n",
        "        self.decide(agreement.result(), step, epoch)\n        return bool(flags[0])  # this rank's stop request\n",
        (f"{CORRECTNESS}::test_stop_request_on_one_rank_stops_every_rank_together",),
    ),
    Mutant(
        "non_finite_decided_alone",
        "the non-finite check uses this rank's loss only",
        "ddp_utils/distributed/faults.py",
        "        return self.decide(agreement.result(), step, epoch)\n",
        "        agreed = agreement.result()\n"
        "        agreed[1] = float(flags[1])  # this rank's loss only\n"
        "        return self.decide(agreed, step, epoch)\n",
        (f"{CORRECTNESS}::test_non_finite_loss_on_one_rank_stops_every_rank",),
    ),
    Mutant(
        "negative_lr_accepted",
        "the lr check lets negative values through",
        "ddp_utils/configuration.py",
        "            if not getattr(self, name) > 0:",
        "            if getattr(self, name) == 0:",
        ("tests/test_config.py",),
    ),
    Mutant(
        "clip_before_unscale",
        "fp16 gradients clipped while still loss-scaled",
        "ddp_utils/train/trainer.py",
        "            self.scaler.unscale_(self.optimizer)\n",
        "",
        (f"{CORRECTNESS}::test_clipping_sees_the_true_gradient_norm",),
    ),
    Mutant(
        "node_rank_ignored",
        "launch.sh gives every node rank 0",
        "scripts/launch.sh",
        '--node-rank="$NODE_RANK"',
        "--node-rank=0",
        ("tests/cluster/test_multinode.py::test_static_rendezvous_across_two_hosts_equals_one_node",),
    ),
    Mutant(
        "store_prefix_removed",
        "restarted groups share store keys with dead ones",
        "ddp_utils/distributed/process_group.py",
        "        store = dist.PrefixStore(group_prefix(os.environ, world_size), store)\n",
        "",
        (f"{PREEMPTION}::test_each_restart_and_group_size_gets_its_own_store_keys",),
    ),
    Mutant(
        "warmup_off_by_one",
        "the lr is computed before the step's samples are counted (step 1 at lr 0)",
        "ddp_utils/train/trainer.py",
        "        self.samples_seen += self.global_batch\n"
        "        for group in self.optimizer.param_groups:  # AdamW's at --lr, Muon's at --muon_lr\n"
        '            group["lr"] = lr_at(self.samples_seen, cfg, self.plan, peak_lr(group, cfg))\n'
        '            self.lrs["muon_lr" if group.get("muon") else "lr"] = group["lr"]  # logged as the step used them\n',
        "        for group in self.optimizer.param_groups:  # AdamW's at --lr, Muon's at --muon_lr\n"
        '            group["lr"] = lr_at(self.samples_seen, cfg, self.plan, peak_lr(group, cfg))\n'
        '            self.lrs["muon_lr" if group.get("muon") else "lr"] = group["lr"]  # logged as the step used them\n'
        "        self.samples_seen += self.global_batch\n",
        ("tests/test_train.py::test_the_trainer_follows_the_schedule_from_the_first_step",),
    ),
    # Issue 10: fp16, elastic resizing, checkpoint waits.
    Mutant(
        "fp16_scale_floor_ignored",
        "fp16 goes on with a vanishing loss scale",
        "ddp_utils/distributed/faults.py",
        "low_scale, skipped = new_scale < self.cfg.min_loss_scale, new_scale < scale",
        "low_scale, skipped = False, new_scale < scale",
        (f"{CORRECTNESS}::test_fp16_failure_stops_every_rank_with_one_line_naming_the_knobs",),
    ),
    Mutant(
        "fp16_nan_loss_ignored",
        "a NaN loss under fp16 is taken for an overflow",
        "ddp_utils/distributed/faults.py",
        "        if loss_not_finite or (grads_not_finite and not self.fp16):",
        "        if (loss_not_finite or grads_not_finite) and not self.fp16:",
        (f"{CORRECTNESS}::test_fp16_failure_stops_every_rank_with_one_line_naming_the_knobs",),
    ),
    Mutant(
        "lr_on_steps",
        "the schedule runs on steps at the current global batch",
        "ddp_utils/train/trainer.py",
        '            group["lr"] = lr_at(self.samples_seen, cfg, self.plan, peak_lr(group, cfg))\n',
        '            group["lr"] = lr_at(self.step * self.global_batch + self.global_batch, cfg, self.plan, peak_lr(group, cfg))\n',
        (f"{RESILIENCE}::test_the_learning_rate_stays_on_course_when_the_world_size_changes",),
    ),
    Mutant(
        "checkpoint_wait_in_a_collective",
        "ranks wait for rank 0's write in a collective",
        "ddp_utils/checkpoint/single_file.py",
        '    error = store_barrier(ctx, f"checkpoint_step_{step}", error, timeout_seconds)\n',
        "    from ..distributed.collectives import any_rank\n\n    any_rank(error is not None, device=ctx.device)\n",
        (f"{PREEMPTION}::test_a_checkpoint_slower_than_every_timeout_completes_under_sigusr1",),
    ),
    Mutant(
        "torchrun_grace_default",
        "launch.sh leaves torchrun's 30 s grace after a signal",
        "scripts/launch.sh",
        "export PET_SHUTDOWN_TIMEOUT=$(( STOP_GRACE_SECONDS > 20 ? STOP_GRACE_SECONDS - 10 : STOP_GRACE_SECONDS ))",
        "PET_SHUTDOWN_TIMEOUT=$(( STOP_GRACE_SECONDS > 20 ? STOP_GRACE_SECONDS - 10 : STOP_GRACE_SECONDS ))",
        (f"{PREEMPTION}::test_a_checkpoint_slower_than_every_timeout_completes_under_sigusr1",),
    ),
    Mutant(
        "embeddings_untied",
        "the GPT's output layer gets its own matrix",
        "model.py",
        "        self.lm_head.weight = self.tok_emb.weight\n",
        "",
        ("tests/test_task.py::test_input_and_output_embeddings_are_one_matrix",),
    ),
    Mutant(
        "fsdp_clip_per_shard",
        "fsdp: each rank clips its gradient shards by their own norm",
        "ddp_utils/parallel/strategy.py",
        "        norm = clip_grad_norm(parameters, max_norm)\n",
        "        shards = [p.grad.to_local() for p in parameters]\n"
        "        norm = torch.nn.utils.get_total_norm(shards)\n"
        "        torch.nn.utils.clip_grads_with_norm_(shards, max_norm, norm)\n",
        (f"{FSDP}::test_fsdp_trains_the_same_parameters_as_ddp",),
    ),
    Mutant(
        "ddp_clip_measures_only",
        "ddp: the gradients' norm is measured but never scaled down to --max_grad_norm",
        "ddp_utils/optim/optimizer.py",
        "    if max_norm != math.inf:\n",
        "    if max_norm == math.inf:\n",
        (f"{CORRECTNESS}::test_clipping_sees_the_true_gradient_norm",),
    ),
    Mutant(
        "agreement_drops_tensor_values",
        "on the CPU the step agreement sends its Python flags only: the loss and norm values are left out",
        "ddp_utils/distributed/collectives.py",
        "[float(value) for value in values]",
        "[0.0 if isinstance(value, torch.Tensor) else float(value) for value in values]",
        (f"{CORRECTNESS}::test_non_finite_loss_on_one_rank_stops_every_rank",),
    ),
    Mutant(
        "doctor_misses_unused_parameters",
        "doctor.py reports every parameter as used",
        "ddp_utils/doctor/model_checks.py",
        "    unused = [name for name, p in named if p.grad is None]\n",
        "    unused = []\n",
        ("tests/test_doctor.py::test_each_fault_is_named",),
    ),
    Mutant(
        "doctor_resume_forgets_the_generators",
        "doctor.py's resume loads the model and AdamW but not the random generators",
        "ddp_utils/doctor/equivalence.py",
        '    set_rng_state(saved["rng"])\n',
        "",
        ("tests/test_doctor.py::test_a_resume_that_is_not_exact_is_found",),
    ),
    Mutant(
        "doctor_ranks_sum_their_gradients",
        "doctor.py's 2-process gradients are the ranks' sum, not DDP's average",
        "ddp_utils/doctor/equivalence.py",
        "        (loss_fn(model(model_inputs(batch)), batch) / len(batches)).backward()\n",
        "        loss_fn(model(model_inputs(batch)), batch).backward()\n",
        ("tests/test_doctor.py::test_a_synchronised_norm_and_a_plain_model_are_the_same_on_one_process_and_two",),
    ),
    Mutant(
        "doctor_plans_fsdp_unsharded",
        "doctor.py's memory plan gives fsdp the whole model state on every GPU",
        "ddp_utils/doctor/memory.py",
        '"fsdp": (world_size,',
        '"fsdp": (1,',
        (f"{FSDP}::test_the_doctor_plans_the_model_state_each_process_held",),
    ),
    Mutant(
        "doctor_data_ignores_the_rank",
        "doctor.py builds the training set as rank 0 twice",
        "ddp_utils/doctor/equivalence.py",
        "            for rank in (0, 1):\n                with as_rank(rank, 2):\n",
        "            for rank in (0, 0):\n                with as_rank(rank, 2):\n",
        ("tests/test_doctor.py::test_data_that_depends_on_the_rank_is_found",),
    ),
    Mutant(
        "doctor_scales_activations_with_the_batch",
        "doctor.py scales a few samples' activations to --batch_size, autocast's weight copies included",
        "ddp_utils/doctor/memory.py",
        "    if len(half) != len(whole):\n",
        "    if True:\n",
        ("tests/test_doctor.py::test_activations_count_once_what_does_not_grow_with_the_batch",),
    ),
    Mutant(
        "doctor_judges_ddp_whatever_the_strategy",
        "doctor.py's memory plan asks whether ddp fits, whatever --strategy says",
        "ddp_utils/doctor/memory.py",
        '    if cfg.strategy == "ddp":\n',
        "    if True:\n",
        ("tests/test_doctor.py::test_the_configured_strategy_is_the_one_judged",),
    ),
    Mutant(
        "doctor_fsdp_never_shards",
        "doctor.py's fsdp check steps the plain model twice: FSDP is never applied",
        "ddp_utils/doctor/equivalence.py",
        "        sharded = build_strategy(cfg, context, build_model).model\n",
        "        sharded = build_module(cfg, build_model, cpu, on_meta=cfg.init_on_meta)\n",
        ("tests/test_doctor.py::test_a_parameter_used_outside_its_shard_unit_fails_under_fsdp",),
    ),
    Mutant(
        "doctor_resume_skips_the_generators_position",
        "doctor.py's resume compares weights and AdamW, not where the random generators stand",
        "ddp_utils/doctor/equivalence.py",
        "    for name, state in generators.items():\n",
        "    for name, state in {}.items():\n",
        ("tests/test_doctor.py::test_a_resume_that_is_not_exact_is_found",),
    ),
    Mutant(
        "doctor_fsdp_steps_draw_other_dropout",
        "doctor.py's fsdp check draws the plain and the sharded step's dropout from one stream: a false fail",
        "ddp_utils/doctor/equivalence.py",
        "                torch.manual_seed(STREAM)  # the same dropout in both\n",
        "",
        ("tests/test_doctor.py::test_a_parameter_used_outside_its_shard_unit_fails_under_fsdp",),
    ),
    Mutant(
        "doctor_data_compares_nan_as_different",
        "doctor.py compares samples with torch.equal alone: a NaN in the data is a false fail",
        "ddp_utils/doctor/rows.py",
        "    return torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))\n",
        "    return torch.equal(x, y)\n",
        ("tests/test_doctor.py::test_data_that_depends_on_the_rank_is_found",),
    ),
    Mutant(
        "doctor_processes_without_ddp",
        "doctor.py's 2 processes run the bare module: no gradient all-reduce, rank 0's half compared",
        "ddp_utils/doctor/processes.py",
        '                job["loss_fn"](strategy.model(model_inputs(share)), share).backward()\n',
        '                job["loss_fn"](strategy.module(model_inputs(share)), share).backward()\n',
        ("tests/test_doctor.py::test_the_shipped_task_passes_the_doctor",),
    ),
    Mutant(
        "doctor_steps_compare_nothing",
        "doctor.py's 2 processes take their steps but nothing after them is compared",
        "ddp_utils/doctor/processes.py",
        "        for kind, tensors in expected[stage].items():\n",
        "        for kind, tensors in {}.items():\n",
        ("tests/test_doctor.py::test_a_forward_that_changes_parameters_is_found_by_the_steps_of_two_processes",),
    ),
    Mutant(
        "doctor_names_the_last_error",
        "doctor.py reports the rank that raised last: the peer's lost connection, not the cause",
        "ddp_utils/doctor/processes.py",
        "min(errors, key=lambda error: error[-1])",
        "max(errors, key=lambda error: error[-1])",
        ("tests/test_doctor.py::test_the_rank_that_raised_is_named_not_the_peer_it_left",),
    ),
    Mutant(
        "doctor_data_starts_at_the_resumed_epoch",
        "doctor.py's uninterrupted read starts at the resumed epoch: persistent workers see its epoch",
        "ddp_utils/doctor/equivalence.py",
        "            read(loaders, 0, 1)\n",
        "",
        ("tests/test_doctor.py::test_a_resume_that_reads_other_data_is_found",),
    ),
    Mutant(
        "doctor_data_resumes_at_the_start",
        "doctor.py's resumed loader starts the epoch over instead of past the batches done",
        "ddp_utils/doctor/equivalence.py",
        "start=RESUMED_AT * global_batch)",
        "start=0)",
        ("tests/test_doctor.py::test_a_resume_that_reads_other_data_is_found",),
    ),
    Mutant(
        "doctor_data_resume_forgets_the_generators",
        "doctor.py's resumed loader reads without the checkpoint's random generators: a false fail",
        "ddp_utils/doctor/equivalence.py",
        "            set_rng_state(states[RESUMED_AT - 1])  # the checkpoint's",
        "            pass  # the checkpoint's",
        ("tests/test_doctor.py::test_a_resume_that_reads_other_data_is_found",),
    ),
    Mutant(
        "clip_without_epsilon",
        "the loop's clipping divides by the norm without torch's 1e-6: not torch's result to the bit",
        "ddp_utils/optim/optimizer.py",
        "max_norm / (norm + 1e-6)",
        "max_norm / norm",
        ("tests/test_train.py::test_clipping_is_torchs_to_the_bit",),
    ),
    Mutant(
        "init_from_the_global_rng",
        "weights drawn from the global generator: a module-by-module start depends on the process's generator",
        "ddp_utils/parallel/model_init.py",
        "        torch.manual_seed(mix_seed(seed, zlib.crc32(name.encode())))\n",
        "",
        (f"{FSDP}::test_both_strategies_start_from_the_weights_the_model_makes",),
    ),
    Mutant(
        "fsdp_evaluation_not_in_step",
        "fsdp: a rank with fewer validation batches stops all-gathering before the others",
        "ddp_utils/train/evaluation.py",
        "    if sharded:\n",
        "    if False:\n",
        (f"{FSDP}::test_fsdp_trains_the_same_parameters_as_ddp",),
    ),
    Mutant(
        "async_save_not_awaited_on_stop",
        "fsdp: the process exits with its asynchronous checkpoint unfinished",
        "ddp_utils/checkpoint/checkpointer.py",
        "        if stopping:\n",
        "        if False:\n",
        (f"{FSDP}::test_sigterm_under_fsdp_saves_shards_and_resume_is_exact",),
    ),
    Mutant(
        "batchnorm_not_synced",
        "each process normalises by its own share of the batch",
        "model.py",
        "if on_gpus else sync_batchnorms(model)",
        "if on_gpus else model",
        (f"{CORRECTNESS}::test_world_size_and_accumulation_give_the_same_parameters",),
        task="vision",
    ),
    Mutant(
        "batchnorm_not_synced_for_the_doctor",
        "each process normalises by its own share of the batch (the vision bake's CI runs the doctor on it)",
        "model.py",
        "if on_gpus else sync_batchnorms(model)",
        "if on_gpus else model",
        ("tests/test_doctor.py::test_the_shipped_task_passes_the_doctor",),
        task="vision",
    ),
    Mutant(
        "augmentation_epoch_not_shared_with_workers",
        "the epoch set in a plain attribute: persistent DataLoader workers crop the first epoch's way "
        "ever after, and a resume reads other images (the vision bake's CI runs the doctor, not the SIGTERM test)",
        "ddp_utils/data/images.py",
        "self.epoch.fill_(epoch)",
        "self.epoch = torch.tensor(epoch)",
        ("tests/test_doctor.py::test_the_shipped_task_passes_the_doctor",),
        task="vision",
    ),
    Mutant(
        "augmentation_from_the_global_rng",
        "crops and flips drawn from the process's generator, not (seed, epoch, index)",
        "ddp_utils/data/images.py",
        "generator = torch.Generator().manual_seed(mix_seed(self.seed, int(self.epoch), index))",
        "generator = None",
        ("tests/test_task.py::test_augmentation_depends_on_seed_epoch_and_index_only",),
        task="vision",
    ),
    Mutant(
        "torch_syncbatchnorm_unused_on_gpus",
        "GPUs get the hand-written synchronised batch norm, not torch's fused SyncBatchNorm",
        "model.py",
        "nn.SyncBatchNorm.convert_sync_batchnorm(model) if on_gpus",
        "sync_batchnorms(model) if on_gpus",
        ("tests/test_task.py::test_sync_batchnorm_is_torchs_on_gpus_and_ddp_resends_buffers_only_without_it",),
        task="vision",
    ),
    Mutant(
        "dataloader_workers_die_on_sigterm",
        "DataLoader workers keep torch's SIGTERM handler: a stop signal kills them before the checkpoint",
        "ddp_utils/data/loaders.py",
        "        worker_init_fn=functools.partial(ignore_stop_signals, main_pid=os.getpid()),\n",
        "",
        (f"{PREEMPTION}::test_sigterm_to_torchrun_saves_mid_epoch_and_resume_is_exact",),
    ),
    Mutant(
        "stop_status_lost",
        "after a signal stop the nodes exit with torchrun's 1, not 143: a preemption looks like a crash",
        "ddp_utils/distributed/faults.py",
        "                write_stop_status(self.code)\n",
        "",
        (f"{PREEMPTION}::test_sigterm_to_one_node_stops_every_node_with_the_preemption_status",),
    ),
    Mutant(
        "stalled_rank_ignores_the_stop",
        "a stalled rank logs the stop request but stays: torchrun kills it after its grace period",
        "ddp_utils/distributed/faults.py",
        "                logging.shutdown()\n                os._exit(1)\n",
        "                self.stop.signum = 0  # noticed, then forgotten\n",
        ("tests/test_diagnosis.py::test_stalled_rank_fails_the_job_within_the_timeout_with_stacks",),
    ),
    Mutant(
        "cpu_when_gpus_were_asked_for",
        "GPUs given but CUDA unusable: every rank trains on the CPU without a word",
        "ddp_utils/distributed/device.py",
        '    asked = "--device cuda" if device == "cuda" else gpus_requested(environ)',
        "    asked = None",
        ("tests/test_diagnosis.py::test_gpus_asked_for_but_cuda_unusable_stops_with_one_line",),
    ),
    Mutant(
        "weight_decay_ignored",
        "--weight_decay silently ignored (AdamW built with 0)",
        "ddp_utils/optim/optimizer.py",
        '"weight_decay": cfg.weight_decay}',
        '"weight_decay": 0.0}',
        ("tests/test_train.py::test_weight_decay_shrinks_matrices_and_never_biases_or_norms",),
    ),
    Mutant(
        "weight_decay_on_norms_and_biases",
        "one weight decay for every parameter, LayerNorm gains and biases included",
        "ddp_utils/optim/optimizer.py",
        '{"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}',
        '{"params": [p for p in parameters if p.dim() < 2], "weight_decay": cfg.weight_decay}',
        ("tests/test_train.py::test_weight_decay_shrinks_matrices_and_never_biases_or_norms",),
    ),
    Mutant(
        "one_group_state_misplaced",
        "an old one-group checkpoint's Adam moments go to the wrong parameters in the two groups",
        "ddp_utils/checkpoint/sharded.py",
        "    new_index = {old_index[id(p)]: i for i, p in enumerate(ours)}",
        "    new_index = {i: i for i in range(len(ours))}",
        (f"{RESILIENCE}::test_checkpoint_of_the_one_group_optimizer_resumes_with_its_state",),
    ),
    Mutant(
        "checkpoint_read_whole",
        "every rank reads the whole checkpoint into memory instead of mapping it",
        "ddp_utils/checkpoint/loading.py",
        'map_location="cpu", mmap=True,',
        'map_location="cpu",',
        (f"{RESILIENCE}::test_resume_maps_the_checkpoint_into_host_memory",),
    ),
    Mutant(
        "staging_buffers_allocated_per_save",
        "fsdp: each asynchronous save stages into freshly allocated host memory (DCP's default stager)",
        "ddp_utils/checkpoint/sharded.py",
        ", async_stager=stager)",
        ")",
        (f"{FSDP}::test_sigterm_under_fsdp_saves_shards_and_resume_is_exact",),
    ),
    Mutant(
        "tf32_through_the_new_api_only",
        "TF32 set with torch's fp32_precision alone: the legacy flags, which Inductor reads, then raise",
        "ddp_utils/distributed/device.py",
        "    torch.backends.cuda.matmul.allow_tf32 = enabled\n"
        "    torch.backends.cudnn.allow_tf32 = enabled\n"
        '    torch.set_float32_matmul_precision("high" if enabled else "highest")\n',
        '    precision = "tf32" if enabled else "ieee"\n'
        "    torch.backends.cuda.matmul.fp32_precision = precision\n"
        "    torch.backends.cudnn.conv.fp32_precision = precision\n",
        ("tests/test_diagnosis.py::test_tf32_leaves_both_of_torchs_apis_readable_and_agreeing",),
    ),
    Mutant(
        "hsdp_without_its_mesh",
        "fsdp shards over every process whatever --replicate_degree says (no 2-D mesh)",
        "ddp_utils/parallel/strategy.py",
        "fully_shard(unit, mesh=self.mesh, ",
        "fully_shard(unit, ",
        (f"{FSDP}::test_hsdp_trains_the_same_parameters_as_ddp",),
    ),
    Mutant(
        "hsdp_groups_with_default_timeout",
        "the device mesh's process groups get torch's default timeout, not --timeout_seconds",
        "ddp_utils/parallel/strategy.py",
        ",\n                                         backend_override=mesh_group_settings(names, cfg.timeout_seconds))",
        ")",
        (f"{FSDP}::test_hsdp_trains_the_same_parameters_as_ddp",),
    ),
    Mutant(
        "user_init_thrown_away",
        "every module's reset_parameters() rerun after build_model: the model's own init is lost",
        "ddp_utils/parallel/model_init.py",
        "            model = build_model(cfg).to(device)\n",
        "            model = build_model(cfg).to(device)\n"
        '            [m.reset_parameters() for m in model.modules() if hasattr(m, "reset_parameters")]\n',
        (f"{FSDP}::test_both_strategies_start_from_the_weights_the_model_makes",),
        task="tabular",
    ),
    Mutant(
        "fsdp_always_from_meta",
        "fsdp initialises module by module on the meta device even for a model without init_weights",
        "ddp_utils/parallel/strategy.py",
        "on_meta=cfg.init_on_meta, shard=shard)",
        "on_meta=True, shard=shard)",
        (f"{FSDP}::test_both_strategies_start_from_the_weights_the_model_makes",),
        task="tabular",
    ),
    Mutant(
        "keep_checkpoints_ignored_for_one_file",
        "--keep_checkpoints ignored for single-file (ddp) checkpoints: no step file is ever pruned",
        "ddp_utils/checkpoint/single_file.py",
        "for old in others[: len(others) - (keep - 1)]:",
        "for old in []:",
        (f"{RESILIENCE}::test_only_the_newest_checkpoints_are_kept",),
    ),
    Mutant(
        "training_windows_same_every_epoch",
        "the language task's training windows identical every epoch (the epoch dropped from the seed)",
        "dataset.py",
        "mix_seed(self.seed, int(self.epoch), index)",
        "mix_seed(self.seed, 0, index)",
        ("tests/test_task.py::test_training_windows_are_fresh_every_epoch_and_the_same_on_resume",),
    ),
    Mutant(
        "table_features_not_standardised",
        "a table's features reach the model on their own scales (the training rows' statistics unused)",
        "ddp_utils/data/tables.py",
        'return torch.from_numpy((inputs - np.array(state["mean"])) / np.array(state["std"])).float()',
        "return torch.from_numpy(inputs).float()",
        ("tests/test_task.py::test_a_csv_with_unscaled_features_and_text_labels_trains",),
        task="tabular",
    ),
    Mutant(
        "table_split_not_stratified",
        "the validation rows drawn from the whole table, not each class's share",
        "ddp_utils/data/tables.py",
        "groups = [np.arange(rows)] if labels is None else",
        "groups = [np.arange(rows)] if True else",
        ("tests/test_task.py::test_the_validation_split_is_a_function_of_the_rows_and_seed",),
        task="tabular",
    ),
    Mutant(
        "data_error_after_output_dir",
        "bad data is found after logging has created output_dir (the old path: a logged ERROR, train.log written)",
        "ddp_utils/train/run.py",
        "    datasets, notes = check_inputs(task, cfg, ctx)\n",
        "    setup_logging(ctx, cfg.output_dir)\n    datasets, notes = check_inputs(task, cfg, ctx)\n",
        ("tests/test_task.py::test_missing_data_is_one_line_naming_the_flag",),
    ),
    Mutant(
        "sixteen_bit_images_clipped",
        "16-bit images go through Pillow's convert('RGB'): everything but black turns white",
        "ddp_utils/data/images.py",
        'if image.mode.startswith("I;16") or image.mode == "I":',
        "if False:",
        ("tests/test_task.py::test_16_bit_images_keep_their_values",),
        task="vision",
    ),
    Mutant(
        "image_check_cache_ignores_changes",
        "the image check's cache trusts a file it has seen, whatever its size and modification time now",
        "ddp_utils/data/images.py",
        "return self.known.get(self.key(path)) == [stat.st_size, stat.st_mtime_ns]",
        "return self.key(path) in self.known",
        ("tests/test_task.py::test_the_check_decodes_only_new_or_changed_images",),
        task="vision",
    ),
    Mutant(
        "token_files_always_uint16",
        "token files read as uint16 whatever meta.json says: a uint32 file's ids come out in halves",
        "dataset.py",
        'self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")',
        'self.tokens = np.memmap(self.path, dtype=np.uint16, mode="r")',
        ("tests/test_task.py::test_a_vocabulary_over_65535_writes_uint32_token_files_that_train",),
    ),
    Mutant(
        "sample_ignores_the_checkpoint_tokenizer",
        "sample.py encodes and decodes bytes whatever tokenizer the model learned",
        "sample.py",
        "tokenizer = from_text(saved)",
        "tokenizer = from_text(None)",
        ("tests/test_task.py::test_a_trained_bpe_tokenizer_round_trips_and_the_gpt_learns_its_tokens",),
    ),
    Mutant(
        "config_file_stops_at_the_first_bad_key",
        "a config file's problems reported one per run: the first unknown key ends the parse",
        "ddp_utils/configuration.py",
        'problems.append(f"unknown key {place}{hint}")',
        'exit_with_error(f"--config {path}: unknown key {place}{hint}")',
        ("tests/test_experiments.py::test_bad_file_is_one_line_naming_the_file_and_key",),
    ),
    Mutant(
        "bad_samples_reported_one_at_a_time",
        "the scan for bad samples stops at the first rank's problems: the others' are lost",
        "ddp_utils/data/loaders.py",
        "return dict(sorted(item for problems in everyone for item in problems.items()))",
        "return dict(sorted(everyone[0].items()))",
        ("tests/test_data.py::test_bad_samples_are_found_on_every_rank_and_reported_or_skipped_together",),
    ),
    Mutant(
        "gpt2_square_conv1d_not_transposed",
        "GPT-2's attention output Conv1D (square, so every shape still fits) loaded untransposed",
        "language/hf_gpt2.py",
        'CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")',
        'CONV1D = ("attn.c_attn.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")',
        ("tests/test_task.py::test_init_from_a_gpt2_folder_gives_transformers_logits",),
    ),
    Mutant(
        "hf_export_untransposed",
        "export.py --format hf writes this GPT's [out, in] weights where GPT-2's Conv1D wants [in, out]",
        "language/hf_gpt2.py",
        "tensors[hf_name] = (tensor.t() if hf_name.endswith(CONV1D) else tensor).float().contiguous()",
        "tensors[hf_name] = tensor.float().contiguous()",
        ("tests/test_task.py::test_a_fine_tuned_gpt2_exports_a_folder_transformers_loads[ddp]",),
    ),
    Mutant(
        "init_from_applied_again_on_resume",
        "a resumed fine-tune loads the pretrained folder over its own checkpoint's weights",
        "ddp_utils/train/trainer.py",
        "self.checkpointer.restore_rank(state, self.loss_totals)",
        "self.checkpointer.restore_rank(state, self.loss_totals)\n"
        "        load_full_weights(self.strategy.module, self.task.pretrained_weights(self.cfg))",
        ("tests/test_task.py::test_fine_tuning_resumes_exactly_after_sigterm_without_loading_the_folder_again",),
    ),
    Mutant(
        "fsdp_shards_get_no_pretrained_weights",
        "under fsdp the pretrained weights are skipped: the shards keep the model's own initialisation",
        "ddp_utils/parallel/strategy.py",
        "    with torch.no_grad():\n        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:",
        "    with torch.no_grad():\n        for name, tensor in [*module.named_parameters(), *module.named_buffers()][:0]:",
        ("tests/test_task.py::test_a_fine_tuned_gpt2_exports_a_folder_transformers_loads[fsdp]",),
    ),
    Mutant(
        "sampling_draws_from_the_training_generator",
        "a text sample draws from the training's random generator: the dropout masks after it change",
        "ddp_utils/train/evaluation.py",
        "with torch.random.fork_rng(devices=devices), torch.no_grad():",
        "with torch.no_grad():",
        ("tests/test_task.py::test_fine_tuning_resumes_exactly_after_sigterm_without_loading_the_folder_again",),
    ),
    Mutant(
        "sampling_leaves_the_model_in_eval_mode",
        "after a text sample the model stays in evaluation mode: dropout is off for the rest of the run",
        "ddp_utils/train/evaluation.py",
        "        finally:\n            model.train()",
        "        finally:\n            pass",
        ("tests/test_task.py::test_fine_tuning_resumes_exactly_after_sigterm_without_loading_the_folder_again",),
    ),
    Mutant(
        "pretrained_tokenizer_not_compared",
        "a GPT-2 folder trains on data of another tokenizer: its ids mean other tokens to the model",
        "dataset.py",
        'own.read_text(encoding="utf-8") != files["tokenizer"]',
        "False",
        ("tests/test_task.py::test_a_gpt2_folder_with_another_tokenizer_than_the_data_is_one_line",),
    ),
    Mutant(
        "inference_loads_a_model_in_training_mode",
        "sample.py and predict.py run the model in training mode: dropout on, BatchNorm's batch statistics",
        "ddp_utils/inference.py",
        "return model.to(device).eval(), cfg, state",
        "return model.to(device), cfg, state",
        ("tests/test_inference.py",),
    ),
    Mutant(
        "other_ranks_exit_before_rank0_reports",
        "a bad setting under torchrun: the other ranks exit at once and torchrun stops rank 0 before it prints",
        "ddp_utils/core/logs.py",
        "    if not first:\n        time.sleep(ERROR_WAIT_SECONDS)\n",
        "    if not first:\n        sys.exit(2)\n",
        ("tests/test_config.py::test_bad_value_under_torchrun_is_reported_once",),
    ),
    Mutant(
        "fsdp_mesh_on_the_accelerator",
        "fsdp's one-dimension mesh on torch's accelerator (cuda wherever a GPU is visible), not on --device",
        "ddp_utils/parallel/strategy.py",
        "self.mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))",
        "self.mesh = init_device_mesh(torch._C._get_accelerator().type, (ctx.world_size,))",
        (
            f"{FSDP}::test_fsdp_trains_the_same_parameters_as_ddp",
            "tests/test_doctor.py::test_the_shipped_task_passes_the_doctor",
        ),
    ),
    Mutant(
        "fsdp_gradients_unsharded_until_the_last_micro_step",
        "fsdp accumulates the whole unsharded gradient on every rank, reduce-scattered on the last micro-step only",
        "ddp_utils/parallel/strategy.py",
        "        if self.mesh.ndim > 1:\n            self.model.set_requires_all_reduce(sync)\n",
        "        self.model.set_requires_gradient_sync(sync)\n",
        (f"{FSDP}::test_fsdp_accumulates_gradients_as_shards",),
    ),
    Mutant(
        "hsdp_dimensions_share_group_options",
        "both dimensions of HSDP's mesh made with one process-group options object",
        "ddp_utils/parallel/strategy.py",
        "return {name: group_settings(timeout_seconds) for name in names}",
        "return dict.fromkeys(names, group_settings(timeout_seconds))",
        (f"{FSDP}::test_each_mesh_dimension_gets_its_own_group_options",),
    ),
    Mutant(
        "fsdp_clip_per_tensor",
        "clipping fsdp's DTensor gradients told not to use torch's foreach kernels: a norm per tensor",
        "ddp_utils/optim/optimizer.py",
        "return torch.nn.utils.clip_grad_norm_(parameters, max_norm)",
        "return torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=False)",
        (f"{FSDP}::test_clipping_sharded_gradients_takes_torchs_foreach_kernels",),
    ),
    Mutant(
        "older_torchrun_keeps_its_30_s",
        "under torchrun 2.11 (no --shutdown-timeout) the workers get torchrun's fixed 30 s, not launch.sh's grace",
        "scripts/torchrun_status.py",
        "    processes.close = close_with_grace\n",
        "",
        ("tests/test_train.py::test_older_torchrun_gives_the_workers_launch_shs_stop_grace",),
    ),
    Mutant(
        "single_use_stager_reused",
        "under torch 2.11 one DCP stager for every asynchronous save: the second save raises KeyError",
        "ddp_utils/core/compat.py",
        '        return "self._state_dict_stager.close()" not in inspect.getsource(stager_class._stage)\n',
        "        return True\n",
        (f"{FSDP}::test_a_stager_that_stages_once_is_told_apart",),
    ),
    Mutant(
        "fp16_scale_read_to_the_host",
        "fp16's loss scale read to the host twice every optimizer step (GradScaler.get_scale)",
        "ddp_utils/core/precision.py",
        "    return scaler._get_scale_async().clone()\n",
        "    return torch.tensor(scaler.get_scale())\n",
        ("tests/test_experiments.py::test_log_steps_show_gradient_norm_and_fp16_loss_scale",),
    ),
    Mutant(
        "peak_tflops_by_prefix",
        "the MFU peak matched by the device name's beginning: a MIG slice gets the whole GPU's peak",
        "ddp_utils/observe/flops.py",
        "    peaks = PEAK_TFLOPS.get(device_name.strip())\n",
        "    peaks = next((p for name, p in PEAK_TFLOPS.items() if device_name.startswith(name)), None)\n",
        ("tests/test_observability.py::test_peak_tflops_match_the_exact_device_and_precision",),
    ),
    Mutant(
        "doctor_builds_the_model_for_the_gpu",
        "on a GPU host the doctor's CPU checks build the model as a GPU run would (torch's SyncBatchNorm)",
        "ddp_utils/doctor/run.py",
        '    gpu_cfg, cfg = cfg, dataclasses.replace(cfg, device="cpu")\n',
        "    gpu_cfg = cfg\n",
        ("tests/test_doctor.py::test_the_shipped_task_passes_the_doctor",),
        task="vision",
    ),
    Mutant(
        "task_ignores_unknown_hooks",
        "a misspelled hook passed to Task() is dropped without a word (its default takes over)",
        "ddp_utils/contract.py",
        "            if name not in names:\n",
        '            if name not in names and name.startswith("__"):\n',
        ("tests/test_contract.py::test_a_misspelled_task_hook_is_an_error_naming_the_hook",),
    ),
    Mutant(
        "progress_line_every_step",
        "without a progress bar, rank 0 prints a progress line after every step, not once an interval",
        "ddp_utils/observe/progress.py",
        "    return every > 0 and now + step_seconds - last_line >= every\n",
        "    return every > 0\n",
        ("tests/test_progress.py::test_progress_lines_from_rank_zero_once_per_interval",),
    ),
    Mutant(
        "near_misses_on_the_top_module_only",
        "a misspelled hook on a submodule (same_buffers_on_every_rank, shard_units) goes unreported",
        "ddp_utils/contract.py",
        "    classes = {type(module): None for module in model.modules()}\n",
        "    classes = {type(model): None}\n",
        ("tests/test_contract.py::test_a_near_miss_of_a_hook_on_the_model_the_datasets_or_the_config_is_reported",),
    ),
    Mutant(
        "flop_count_failure_escapes",
        "a model whose forward cannot run on the meta device (Hugging Face's mask code) crashes the run "
        "where MFU is reported, instead of training without it",
        "ddp_utils/observe/flops.py",
        "model = counted_flops(cfg, task, one_sample) if peak > 0 else 0",
        "model = flops_per_sample(cfg, task, one_sample) if peak > 0 else 0",
        ("tests/test_observability.py::test_nothing_outside_the_step_stops_a_run",),
    ),
    Mutant(
        "doctor_tolerance_loosened",
        "the doctor compares float64 runs at 1e-1 of the largest entry, not 1e-10: subtle faults pass",
        "ddp_utils/doctor/numerics.py",
        "EXACT = 1e-10",
        "EXACT = 1e-1",
        (
            "tests/test_doctor.py::test_two_processes_are_judged_at_the_precision_the_model_computes_in",
            "tests/test_doctor.py::test_one_process_judges_at_the_precision_the_model_computes_in_too",
        ),
    ),
    Mutant(
        "doctor_float32_tolerance_loosened",
        "a model that computes in float32 inside is compared at 1e-2, not 1e-6: a fault under 1% passes",
        "ddp_utils/doctor/numerics.py",
        "TOLERANCES = {torch.float32: 1e-6,",
        "TOLERANCES = {torch.float32: 1e-2,",
        ("tests/test_doctor.py::test_two_processes_are_judged_at_the_precision_the_model_computes_in",),
    ),
    Mutant(
        "tabular_statistics_over_all_rows",
        "the table's features are standardised with statistics of the validation rows too (a leak)",
        "ddp_utils/data/tables.py",
        "state = data_state(cfg, columns, chunkwise(inputs, train_rows, len(table.columns)), target)",
        "state = data_state(cfg, columns, chunkwise(inputs, np.arange(table.rows), len(table.columns)), target)",
        ("tests/test_task.py::test_the_saved_statistics_are_the_training_rows_own",),
        task="tabular",
    ),
    Mutant(
        "tabular_target_statistics_over_all_rows",
        "a regression target is standardised with statistics of the validation rows too (a leak)",
        "ddp_utils/data/tables.py",
        "chunkwise(targets[:, None], train_rows, len(table.columns))",
        "chunkwise(targets[:, None], np.arange(table.rows), len(table.columns))",
        ("tests/test_task.py::test_the_saved_statistics_are_the_training_rows_own",),
        task="tabular",
    ),
    Mutant(
        "loader_restacks_gathered_batches",
        "the loaders default-collate a dataset's one-gather Batch: unbound and stacked again sample by sample",
        "ddp_utils/data/loaders.py",
        "        collate_fn=collate,\n",
        "",
        ("tests/test_task.py::test_a_training_batch_is_the_datasets_one_gather_not_restacked_sample_by_sample",),
        task="tabular",
    ),
    Mutant(
        "tabular_batch_as_samples",
        "the tabular rows' one gather returned as a list of samples: collated again one at a time",
        "ddp_utils/data/rows.py",
        "return Batch(inputs, self.targets[index])",
        "return list(zip(inputs.unbind(), self.targets[index].unbind()))",
        ("tests/test_task.py::test_a_training_batch_is_the_datasets_one_gather_not_restacked_sample_by_sample",),
        task="tabular",
    ),
    Mutant(
        "folder_claim_dropped",
        "a run never claims its output folder: a second run trains beside the first",
        "ddp_utils/train/folder_claim.py",
        """            if _create(path, me):
                return cls(path, me, note)""",
        """            if True:
                return cls(path, me, note)""",
        (f"{CLAIM}::test_a_second_run_into_a_live_folder_is_refused_and_the_first_ends_as_if_alone",),
    ),
    Mutant(
        "dead_owner_claim_kept",
        "a claim whose process is gone (a SIGKILL of the whole job) locks the folder for ever",
        "ddp_utils/train/folder_claim.py",
        "        return None if process_alive(owner) else f\"its process {owner['pid']} no longer exists\"",
        "        return None",
        (f"{CLAIM}::test_after_a_sigkill_of_the_whole_job_the_same_command_takes_over_and_resumes_exactly",),
    ),
    Mutant(
        "stale_remote_claim_kept",
        "a claim from another machine that nobody renews (its host lost) locks the folder for ever",
        "ddp_utils/train/folder_claim.py",
        "    if age is None or age < STALE_SECONDS:",
        "    if True:",
        (f"{CLAIM}::test_a_claim_from_another_machine_not_renewed_is_taken_over",),
    ),
    Mutant(
        "half_written_save_not_cleared",
        "fsdp: a save killed half-way leaves its temporary folder, and saving that step again after the resume fails",
        "ddp_utils/checkpoint/sharded.py",
        "        shutil.rmtree(tmp, ignore_errors=True)  # a save that died half-way\n",
        "",
        ("tests/test_chaos.py",),
    ),
    Mutant(
        "full_disk_not_named",
        "a save that fills the disk stops with torch's 'unexpected pos' instead of the free and needed space",
        "ddp_utils/checkpoint/space.py",
        "reason = out_of_space(error, folder, checkpoint)",
        "reason = None",
        (
            "tests/test_disk_space.py::test_a_full_disk_stops_the_save_in_plain_words_and_the_same_command_resumes",
            "tests/test_disk_space.py::test_a_full_disk_under_fsdp_removes_the_partial_checkpoint_and_resumes",
        ),
    ),
    Mutant(
        "muon_rows_reassembled_out_of_order",
        "fsdp: Muon puts each matrix's rows together in the wrong ranks' order (no error says so)",
        "ddp_utils/optim/muon.py",
        "wholes = {p: torch.cat([rows[rank][i] for rank in ranks])",
        "wholes = {p: torch.cat([rows[rank][i] for rank in reversed(ranks)])",
        ("tests/test_muon.py::test_fsdp_orthogonalises_whole_matrices_and_trains_ddps_parameters_under_muon",),
    ),
    Mutant(
        "muon_state_outside_the_checkpoint",
        "Muon's momentum kept beside the optimizer's state: a resume starts it from zero",
        "ddp_utils/optim/muon.py",
        '                if "momentum_buffer" not in self.state[p]:\n'
        '                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)\n'
        "            if stepped:\n"
        "                grads = [local(p.grad) for p in stepped]\n"
        '                buffers = [local(self.state[p]["momentum_buffer"]) for p in stepped]',
        '                self.__dict__.setdefault("momentum", {}).setdefault(p, torch.zeros_like(p.grad))\n'
        "            if stepped:\n"
        "                grads = [local(p.grad) for p in stepped]\n"
        "                buffers = [local(self.momentum[p]) for p in stepped]",
        ("tests/test_muon.py::test_resume_after_sigterm_and_after_a_sigkill_of_the_job_is_exact_under_muon",),
    ),
    Mutant(
        "muon_gram_on_the_large_side",
        "Newton-Schulz on a tall matrix as it is: its Gram matrix the large side (torch's bits lost)",
        "ddp_utils/optim/muon.py",
        "    x = matrices.mT if tall else matrices  # rows <= columns: the Gram matrices are the small side",
        "    x, tall = matrices, False",
        ("tests/test_muon.py::test_the_update_is_torch_optim_muons_to_the_bit",),
    ),
    Mutant(
        "muon_every_rank_every_matrix",
        "ddp: every rank orthogonalises every matrix (the same result, the work not shared)",
        "ddp_utils/optim/muon.py",
        "        elif process_group is not None:",
        "        elif False:",
        ("tests/test_muon.py::test_each_rank_orthogonalises_its_share_of_the_matrices",),
    ),
    Mutant(
        "muon_lr_ignored",
        "Muon's matrices at --lr: --muon_lr has no effect",
        "ddp_utils/optim/optimizer.py",
        'return cfg.muon_lr if group.get("muon") else cfg.lr',
        "return cfg.lr",
        ("tests/test_muon.py::test_muons_matrices_follow_the_schedule_at_muon_lr_and_the_rest_at_lr",),
    ),
    Mutant(
        "full_collections_left_on",
        "automatic full garbage collections left on while training (a pause on every rank mid-step)",
        "ddp_utils/core/collector.py",
        "        gc.set_threshold(young, middle, NEVER)",
        "        gc.set_threshold(*self.thresholds)",
        ("tests/test_train.py::test_no_full_garbage_collection_runs_inside_the_training_steps",),
    ),
    Mutant(
        "fsdp_whole_model_compiled",
        "fsdp --compile: the whole sharded model compiled, a graph break at every FSDP2 hook",
        "ddp_utils/parallel/strategy.py",
        "        for unit in (shard_units(self.model) or [self.model]) if cfg.compile else ():",
        "        for unit in [self.model] if cfg.compile else ():",
        ("tests/test_observability.py::test_compile_trains_and_matches_eager_closely",),
    ),
    Mutant(
        "taken_over_run_writes_on",
        "a run whose folder was taken over while it stalled goes on writing checkpoints and metrics into the new owner's folder",
        "ddp_utils/core/files.py",
        "    problem = _fence() if _fence is not None else None",
        "    problem = None",
        (f"{CLAIM}::test_a_one_file_save_woken_between_write_and_rename_puts_nothing_in_place",),
    ),
    Mutant(
        "claim_never_renewed",
        "a running job never renews its claim: any other job on another machine takes its folder after the staleness",
        "ddp_utils/train/folder_claim.py",
        "                os.utime(self.path)",
        "                pass",
        (f"{CLAIM}::test_a_training_run_renews_its_claim_on_the_file_systems_clock",),
    ),
    Mutant(
        "claim_renewed_too_slowly",
        "the claim's heartbeat slowed past the staleness (every 150 s, stale after 120 s)",
        "ddp_utils/train/folder_claim.py",
        "BEAT_SECONDS = 10  # how often the owner renews its claim",
        "BEAT_SECONDS = 150  # how often the owner renews its claim",
        (f"{CLAIM}::test_a_training_run_renews_its_claim_on_the_file_systems_clock",),
    ),
    Mutant(
        "dead_rank_waited_for",
        "a rank waiting at a checkpoint's barrier never looks at the others' heartbeats: a dead partner keeps it until torchrun's kill",
        "ddp_utils/distributed/store_waits.py",
        "            watched, gone = now, _heartbeats.gone()",
        "            watched, gone = now, []",
        (
            f"{PREEMPTION}::test_a_rank_killed_at_a_checkpoint_stops_its_partner_in_seconds_and_the_restart_resumes_exactly",
        ),
    ),
    Mutant(
        "out_of_memory_unnamed",
        "CUDA out of memory is torch's traceback on every rank, not one line with the phase and the knobs",
        "ddp_utils/train/out_of_memory.py",
        "            raise OutOfMemory(out_of_memory_line(self.cfg, self.ctx, step, phase, self.checkpointable)) from None",
        "            raise",
        ("tests/test_out_of_memory.py",),
    ),
    Mutant(
        "peer_error_after_out_of_memory_reported",
        "the rank whose collective broke when its peer ran out of memory logs its own traceback too",
        "ddp_utils/distributed/faults.py",
        "        return store is not None and store.check([FAILED_KEY])",
        "        return False",
        ("tests/test_out_of_memory.py::test_one_rank_out_of_memory_stops_every_rank_at_once",),
    ),
    Mutant(
        "out_of_memory_keeps_the_claim",
        "a run stopped by out of memory keeps its folder claim: the next start on another machine waits for the staleness",
        "ddp_utils/train/folder_claim.py",
        "            at_exit_now(self.release)",
        "            pass",
        ("tests/test_out_of_memory.py::test_out_of_memory_in_each_phase_is_one_line_naming_where_and_what_helps",),
    ),
    Mutant(
        "pruned_trial_not_stopped",
        "a trial the pruner stops is only marked pruned: its run trains on to its last step",
        "ddp_utils/sweep/run.py",
        """                if outcome is not None:
                    stop(process)""",
        """                if outcome is not None:
                    pass""",
        (f"{SWEEP}::test_every_trial_ends_with_its_reason_and_none_is_lost",),
    ),
    Mutant(
        "dead_workers_trial_lost",
        "a trial whose worker died is marked failed but never run again: its parameters are lost",
        "ddp_utils/sweep/run.py",
        """        if again:
            first = t.user_attrs.get("retry_of", t.number)""",
        """        if False:
            first = t.user_attrs.get("retry_of", t.number)""",
        (f"{SWEEP}::test_every_trial_ends_with_its_reason_and_none_is_lost",),
    ),
    Mutant(
        "trial_outlives_its_worker",
        "a SIGKILLed worker's trial trains on, unowned (no PR_SET_PDEATHSIG on its launcher)",
        "ddp_utils/sweep/trial.py",
        "            preexec_fn=die_with_parent,",
        "            preexec_fn=None,",
        (f"{SWEEP}::test_every_trial_ends_with_its_reason_and_none_is_lost",),
    ),
    Mutant(
        "checkpointed_recompute_draws_new_dropout",
        "--activation_checkpointing's recompute does not restore the random generators: other dropout masks",
        "ddp_utils/parallel/activation_checkpointing.py",
        "use_reentrant=False, preserve_rng_state=True, context_fn=context",
        "use_reentrant=False, preserve_rng_state=False, context_fn=context",
        (f"{ACTIVATIONS}::test_a_checkpointed_step_is_the_same_step_to_the_bit",),
    ),
    Mutant(
        "activation_checkpointing_does_nothing",
        "--activation_checkpointing is accepted and checkpoints no block (the knob a no-op, as it was for any model but the GPT)",
        "ddp_utils/parallel/activation_checkpointing.py",
        '    chosen = blocks[::2] if mode == "every_other" else blocks\n',
        "    chosen = []\n",
        (f"{ACTIVATIONS}::test_every_mode_keeps_fewer_activations_than_none",),
    ),
    Mutant(
        "recompute_updates_batch_norm_twice",
        "a checkpointed block's recompute updates its batch norms' running statistics a second time",
        "ddp_utils/parallel/activation_checkpointing.py",
        "    return forward, _both(_statistics_frozen(block), recompute)",
        "    return forward, recompute",
        (f"{ACTIVATIONS}::test_a_checkpointed_step_is_the_same_step_to_the_bit",),
    ),
    Mutant(
        "hardware_flops_without_the_recompute",
        "with --activation_checkpointing the metrics' hardware FLOPs are the model's: the recompute is not counted",
        "ddp_utils/observe/flops.py",
        'counted_flops(cfg, task, one_sample, checkpoint_blocks, "HFU") if recomputes else 0',
        'counted_flops(cfg, task, one_sample, None, "HFU") if recomputes else 0',
        ("tests/test_observability.py::test_mfu_is_reported_where_the_peak_is_known",),
    ),
    Mutant(
        "out_of_memory_line_misreads_what_checkpointing_saves",
        "the out-of-memory line's figure of what --activation_checkpointing full saves reads none's activations twice",
        "ddp_utils/train/out_of_memory.py",
        'before, after, cost = none["activations"], full["activations"], full["recompute_flops"]',
        'before, after, cost = none["activations"], none["activations"], full["recompute_flops"]',
        ("tests/test_out_of_memory.py::test_out_of_memory_in_each_phase_is_one_line_naming_where_and_what_helps",),
    ),
    Mutant(
        "doctor_recommends_the_costliest_checkpointing",
        "the doctor's activation checkpointing row names the fitting mode of most recompute, not least",
        "ddp_utils/doctor/memory.py",
        'best = min(fits, key=lambda m: modes[m]["recompute_flops"])',
        'best = max(fits, key=lambda m: modes[m]["recompute_flops"])',
        ("tests/test_doctor.py::test_the_activation_checkpointing_row_names_the_mode_that_fits_and_what_it_costs",),
    ),
    Mutant(
        "offload_ignored",
        "--cpu_offload is accepted and nothing is offloaded",
        "ddp_utils/parallel/strategy.py",
        'offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if cfg.cpu_offload else OffloadPolicy()',
        "offload = OffloadPolicy()",
        (f"{OFFLOAD}::test_offload_trains_fsdps_parameters_to_the_bit",),
    ),
    Mutant(
        "offload_pinned_without_an_accelerator",
        "--cpu_offload pins host memory on a CPU-only machine (pinning needs an accelerator)",
        "ddp_utils/parallel/strategy.py",
        'CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")',
        "CPUOffloadPolicy()",
        (f"{OFFLOAD}::test_offload_trains_fsdps_parameters_to_the_bit",),
    ),
    Mutant(
        "doctor_ddp_stage_keeps_offload",
        "the doctor's DDP stage keeps --cpu_offload, which ddp refuses: the doctor crashes on an offload config",
        "ddp_utils/doctor/processes.py",
        "find_unused_parameters=True, cpu_offload=False)",
        "find_unused_parameters=True)",
        (f"{OFFLOAD}::test_the_doctor_steps_fsdp_and_hsdp_with_offload_as_ddp",),
    ),
    Mutant(
        "offload_accepted_under_ddp",
        "--strategy ddp --cpu_offload is accepted and does nothing",
        "ddp_utils/configuration.py",
        "        elif self.cpu_offload:\n"
        '            raise ConfigError("cpu_offload", "needs --strategy fsdp (ddp keeps the whole model state on every device)")\n',
        "",
        (f"{OFFLOAD}::test_ddp_refuses_offload_in_one_line",),
    ),
    Mutant(
        "memory_plan_keeps_offloaded_state_on_the_gpu",
        "the doctor's plan counts --cpu_offload's host-held state on the GPU",
        "ddp_utils/doctor/memory.py",
        "plan.update(parameters=0, gradients=0, optimizer=0, gathered=",
        "plan.update(gathered=",
        (f"{OFFLOAD}::test_the_memory_plan_keeps_only_gathered_units_and_activations_on_the_gpu",),
    ),
    Mutant(
        "hsdp_groups_with_gloo_options_beside_nccl",
        "with a 'cuda:nccl,cpu:gloo' backend (--cpu_offload on GPUs) HSDP's mesh groups get gloo's options",
        "ddp_utils/parallel/strategy.py",
        'if "nccl" in backend else',
        'if backend == "nccl" else',
        (f"{OFFLOAD}::test_hsdp_groups_on_gpus_take_nccls_options_beside_gloo",),
    ),
    Mutant(
        "stream_order_over_all_shards",
        "a streamed epoch shuffles every sample of every shard together: each batch needs many shards at once",
        "ddp_utils/data/loaders.py",
        'order = getattr(train_set, "epoch_order", None)',
        "order = None",
        (f"{STREAMING}::test_every_sample_once_an_epoch_in_one_order_for_any_world_size",),
    ),
    Mutant(
        "shard_used_unverified",
        "a downloaded shard is renamed into the cache without its size and sha256 checked",
        "ddp_utils/data/shards.py",
        '                fs.get_file(f"{root}/{name}", str(partial))\n                self._verify(partial, shard, where)',
        '                fs.get_file(f"{root}/{name}", str(partial))',
        (f"{STREAMING}::test_a_missing_or_corrupt_shard_stops_with_one_line_naming_it",),
    ),
    Mutant(
        "shard_cache_per_process",
        "each process and DataLoader worker keeps a cache of its own: every shard downloaded by each",
        "ddp_utils/data/shards.py",
        "hashlib.sha256(self.url.encode()).hexdigest()[:16]",
        'hashlib.sha256(f"{self.url}{os.getpid()}".encode()).hexdigest()[:16]',
        (f"{STREAMING}::test_two_streaming_processes_train_as_one_reading_local_shards",),
    ),
    Mutant(
        "shard_download_not_retried",
        "a download cut half-way stops the run instead of being fetched again",
        "ddp_utils/data/shards.py",
        "    for attempt in range(ATTEMPTS):\n        try:\n            return action()",
        "    for attempt in range(ATTEMPTS - 1, ATTEMPTS):\n        try:\n            return action()",
        (f"{STREAMING}::test_a_download_cut_half_way_is_fetched_again_and_never_read",),
    ),
    Mutant(
        "token_shards_without_the_shared_token",
        "consecutive token shards share no token: the windows change with the shard size",
        "make_shards.py",
        "tokens[start : start + per_shard + 1]",
        "tokens[start : start + per_shard]",
        (f"{STREAMING}::test_every_sample_once_an_epoch_in_one_order_for_any_world_size",),
    ),
    Mutant(
        "store_failure_as_a_crash",
        "the data's store failing mid-run is reported as a crash with a traceback, the other ranks' errors after it",
        "ddp_utils/distributed/faults.py",
        "elif isinstance(error, (OutOfMemory, DataUnavailable)):",
        "elif isinstance(error, OutOfMemory):",
        (f"{STREAMING}::test_a_store_gone_mid_epoch_stops_with_a_line_and_the_same_command_resumes_exactly",),
    ),
    Mutant(
        "sharded_tmp_without_writer",
        "a stalled fsdp run writes its shards into, and removes, the new owner's temporary folder of the same step",
        "ddp_utils/checkpoint/sharded.py",
        'name = f".{final.name}.{WRITER}.tmp"',
        'name = f".{final.name}.tmp"',
        (f"{CLAIM}::test_an_fsdp_takeover_during_a_save_leaves_the_new_owners_save_whole[write]",),
    ),
    Mutant(
        "takeover_not_a_step_stop",
        "a run whose folder was taken over trains on until its next fenced write",
        "ddp_utils/distributed/faults.py",
        "lost = folder_lost() is not None",
        "lost = False",
        (f"{CLAIM}::test_train_log_after_a_takeover_gets_no_line_of_the_stalled_run",),
    ),
    Mutant(
        "write_atomically_unfenced",
        "a one-file save woken after its write puts its checkpoint in the new owner's folder",
        "ddp_utils/core/files.py",
        "        fenced()  # the folder may have been taken over while this was written\n",
        "",
        (f"{CLAIM}::test_a_one_file_save_woken_between_write_and_rename_puts_nothing_in_place",),
    ),
    Mutant(
        "metrics_kept_on_a_fresh_start",
        "a run killed before its first checkpoint and started again logs its steps twice",
        "ddp_utils/train/trainer.py",
        'agree(self.ctx, "metrics_truncated", self.reporter.truncate(self.step), self.cfg.timeout_seconds)',
        'agree(self.ctx, "metrics_truncated", self.step and self.reporter.truncate(self.step), self.cfg.timeout_seconds)',
        (f"{RESILIENCE}::test_the_restarts_repeated_steps_are_in_metrics_jsonl_once",),
    ),
    Mutant(
        "prune_the_checkpoint_just_saved",
        "in a folder with newer steps, ddp pruning deletes the checkpoint it has just written",
        "ddp_utils/checkpoint/single_file.py",
        'others = sorted(p for p in checkpoint_dir.glob("step_*.pt") if p != numbered)',
        'others = sorted(checkpoint_dir.glob("step_*.pt"))',
        (f"{RESILIENCE}::test_a_save_never_prunes_the_checkpoint_it_has_just_written",),
    ),
    Mutant(
        "claim_lost_link_reply_refused",
        "on NFS a lost reply to the claim's link makes the run wait for and refuse itself",
        "ddp_utils/train/folder_claim.py",
        'return (read_claim(path) or {}).get("token") == me["token"]',
        "return False",
        (f"{CLAIM}::test_a_lost_reply_to_the_claims_link_is_still_this_runs_claim",),
    ),
    Mutant(
        "claim_needs_hard_links",
        "a run on a file system without hard links cannot start",
        "ddp_utils/train/folder_claim.py",
        "if error.errno not in NO_HARD_LINKS:",
        "if True:",
        (f"{CLAIM}::test_a_file_system_without_hard_links_still_claims_once",),
    ),
    Mutant(
        "shards_written_unfenced",
        "under fsdp only rank 0 reads the claim: the other ranks of a stalled run write their shards after a takeover",
        "ddp_utils/checkpoint/sharded.py",
        "error or _fence_line()",
        "error",
        (f"{CLAIM}::test_an_fsdp_takeover_during_a_save_leaves_the_new_owners_save_whole[fence]",),
    ),
    Mutant(
        "paused_watcher_counts_its_own_pause",
        "a waiting rank counts the time it was itself stopped (the whole job suspended, resumed rank by rank) against the others: it takes the live rank 0 for dead",
        "ddp_utils/distributed/store_waits.py",
        "            still = last[1] + min(now - last[2], 2 * max(BEAT_SECONDS, WAIT_SLICE_SECONDS))",
        "            still = last[1] + (now - last[2])",
        (f"{CHAOS}::test_a_job_paused_whole_and_resumed_rank_by_rank_loses_no_rank",),
    ),
    Mutant(
        "heartbeat_ends_on_a_store_error",
        "one error from the store ends a rank's heartbeat thread for good: from then on every wait takes that live rank for dead",
        "ddp_utils/distributed/store_waits.py",
        "                store = None\n                continue",
        "                return",
        (f"{CHAOS}::test_a_store_error_does_not_end_the_heartbeats_and_a_stopped_rank_is_still_seen",),
    ),
    Mutant(
        "verdict_not_read_by_waiters",
        "a waiting rank reads only rank 0's counter from the verdict, not the ranks rank 0 found gone: a dead rank other than 0 keeps it waiting",
        "ddp_utils/distributed/store_waits.py",
        '        return [rank for rank in map(int, filter(None, found.split(","))) if rank != self.rank]',
        "        return []",
        (f"{CHAOS}::test_a_waiting_rank_reads_one_key_whatever_the_world_size",),
    ),
    Mutant(
        "rank0_ignores_its_own_verdict",
        "rank 0, waiting in the store, does not look at its watcher's verdict: a dead rank keeps it waiting",
        "ddp_utils/distributed/store_waits.py",
        "            return list(self.verdict)",
        "            return []",
        (f"{CHAOS}::test_a_store_error_does_not_end_the_heartbeats_and_a_stopped_rank_is_still_seen",),
    ),
    Mutant(
        "dead_watcher_unseen",
        "a waiting rank trusts rank 0's last verdict however old: rank 0 dead (its watcher with it) keeps the others waiting",
        "ddp_utils/distributed/store_waits.py",
        "            return [0]",
        "            return []",
        (
            f"{CHAOS}::test_a_store_error_does_not_end_the_heartbeats_and_a_stopped_rank_is_still_seen",
            "tests/test_preemption.py::test_a_rank_killed_at_a_checkpoint_stops_its_partner_in_seconds_and_the_restart_resumes_exactly",
        ),
    ),
    Mutant(
        "every_waiter_reads_every_counter",
        "each waiting rank reads every rank's counter itself (world size squared reads a second on the one store)",
        "ddp_utils/distributed/store_waits.py",
        '        value = self.store.get(VERDICT_KEY).decode() if self.verdict_seen else ""',
        '        self.store.multi_get(self.watched)\n        value = self.store.get(VERDICT_KEY).decode() if self.verdict_seen else ""',
        (f"{CHAOS}::test_a_waiting_rank_reads_one_key_whatever_the_world_size",),
    ),
    Mutant(
        "out_of_memory_in_clipping_unguarded",
        "the loss scaler's unscale and the clipping unguarded: an out-of-memory there is a traceback, its fsdp peers "
        "left in the norm's all-reduce",
        "ddp_utils/train/trainer.py",
        '            with self.memory.during("gradient clipping", self.step + 1):',
        "            if True:",
        (f"{OOM}::test_out_of_memory_in_fsdps_clipping_and_sampling_stops_every_rank_at_once",),
    ),
    Mutant(
        "out_of_memory_in_batch_move_unguarded",
        "moving the batch to the device unguarded: an out-of-memory there is a traceback, not the one line",
        "ddp_utils/train/trainer.py",
        '        with self.memory.during("batch\'s move to the device", self.step + 1):',
        "        if True:",
        (f"{OOM}::test_out_of_memory_in_each_phase_is_one_line_naming_where_and_what_helps",),
    ),
    Mutant(
        "out_of_memory_in_checkpoint_unguarded",
        "a checkpoint's gathers and DCP's staging unguarded: an out-of-memory there is a traceback, not the one line",
        "ddp_utils/train/trainer.py",
        '        with self.memory.during("checkpoint", self.step):',
        "        if True:",
        (f"{OOM}::test_out_of_memory_in_each_phase_is_one_line_naming_where_and_what_helps",),
    ),
    Mutant(
        "out_of_memory_in_sampling_unguarded",
        "text sampling unguarded: an out-of-memory there is a traceback, not the one line",
        "ddp_utils/train/trainer.py",
        '                with self.memory.during("text sampling (--sample_every_steps)", self.step):',
        "                if True:",
        (f"{OOM}::test_out_of_memory_in_fsdps_clipping_and_sampling_stops_every_rank_at_once",),
    ),
    Mutant(
        "out_of_memory_in_sampling_turns_it_off",
        "an out-of-memory in sample_text caught as any error: sampling off on that rank alone, fsdp's all-gathers "
        "out of step (a hang)",
        "ddp_utils/train/evaluation.py",
        "        except torch.OutOfMemoryError:",
        "        except ZeroDivisionError:",
        (f"{OOM}::test_out_of_memory_in_fsdps_clipping_and_sampling_stops_every_rank_at_once",),
    ),
    Mutant(
        "smaller_batch_halved",
        "the out-of-memory line's smaller batch halves --batch_size: 5 -> 2 x 2, another global batch",
        "ddp_utils/train/out_of_memory.py",
        "    factor = next((f for f in range(2, cfg.batch_size + 1) if cfg.batch_size % f == 0), None)",
        "    factor = 2 if cfg.batch_size > 1 else None",
        (f"{OOM}::test_the_smaller_batch_named_keeps_the_global_batch",),
    ),
    Mutant(
        "doctor_smaller_batch_halved",
        "the doctor's memory plan row halves --batch_size: 5 -> 2 x 2, another global batch",
        "ddp_utils/doctor/memory.py",
        "            fixes.append(smaller)",
        '            fixes.append(f"--batch_size {max(1, cfg.batch_size // 2)} --grad_accum_steps {2 * cfg.grad_accum_steps}")',
        (f"{OOM}::test_the_smaller_batch_named_keeps_the_global_batch",),
    ),
    Mutant(
        "every_first_step_forward_blamed_on_compile",
        "--compile: an out-of-memory in any forward of step 1 (its later micro-batches too) blamed on the compile",
        "ddp_utils/train/out_of_memory.py",
        "            if self.cfg.compile and self.forwards == 1:",
        "            if self.cfg.compile and step == 1:",
        (f"{OOM}::test_only_the_first_forward_under_compile_is_blamed_on_the_compile",),
    ),
    Mutant(
        "newton_schulz_recompile_limit_kept",
        "compiled Newton-Schulz under Dynamo's recompile limit: the ninth matrix shape raises under fullgraph=True",
        "ddp_utils/optim/muon.py",
        '    limits = {"recompile_limit": max(config.recompile_limit, len(SHAPES)),',
        '    limits = {"recompile_limit": config.recompile_limit,',
        ("tests/test_muon.py::test_compiled_newton_schulz_takes_more_shapes_than_dynamos_recompile_limit",),
    ),
    Mutant(
        "doctor_model_ignores_init_on_meta",
        "the doctor builds the model as its own code makes it where training starts it on the meta device",
        "ddp_utils/doctor/run.py",
        '        return initial_model(cfg, task.build_model, torch.device("cpu"), on_meta=cfg.init_on_meta)',
        '        return initial_model(cfg, task.build_model, torch.device("cpu"))',
        ("tests/test_doctor.py::test_the_doctor_checks_the_model_training_builds",),
    ),
    Mutant(
        "doctor_model_as_built",
        "the doctor's model as build_model makes it, without the model's init_weights that training applies",
        "ddp_utils/doctor/run.py",
        '        return initial_model(cfg, task.build_model, torch.device("cpu"), on_meta=cfg.init_on_meta)',
        "        return task.build_model(cfg)",
        ("tests/test_doctor.py::test_the_doctor_checks_the_model_training_builds",),
    ),
    Mutant(
        "gc_thresholds_not_given_back",
        "a run that ends leaves automatic full collections off in its process (a notebook, a sweep, the doctor)",
        "ddp_utils/core/collector.py",
        "            gc.set_threshold(*self.thresholds)",
        "            pass",
        ("tests/test_doctor.py::test_a_run_that_ends_gives_the_garbage_collector_back_its_thresholds",),
    ),
    Mutant(
        "gc_thresholds_of_a_second_start",
        "a collector started twice gives back its own thresholds (full collections off) at close",
        "ddp_utils/core/collector.py",
        "        if self.thresholds is None:  # started already: gc's thresholds are this collector's own",
        "        if True:",
        ("tests/test_doctor.py::test_a_collector_started_twice_gives_back_the_thresholds_of_before",),
    ),
    Mutant(
        "best_config_rerun_at_launchs_default_processes",
        "best_config.toml's rerun line starts launch.sh's default number of processes, not the trial's: another global batch",
        "ddp_utils/sweep/results.py",
        '''f"# Rerun it with: NNODES=1 NPROC_PER_NODE={processes} scripts/launch.sh "''',
        '''f"# Rerun it with: scripts/launch.sh "''',
        (f"{SWEEP}::test_the_best_config_reproduces_its_trial_and_the_pictures_are_written",),
    ),
    Mutant(
        "stalled_worker_crashes_on_waking",
        "a worker stopped past three heartbeats, whose trial another worker failed, crashes on its next update once woken",
        "ddp_utils/sweep/run.py",
        """        except optuna.exceptions.UpdateFinishedTrialError:
            # Failed by another worker""",
        """        except optuna.exceptions.DuplicatedStudyError:
            # Failed by another worker""",
        (f"{SWEEP}::test_a_stopped_worker_keeps_its_trials_result_and_goes_on",),
    ),
    Mutant(
        "silent_workers_live_run_failed",
        "a trial whose worker is stopped is failed after three heartbeats while its run still trains (its folder claim ignored)",
        "ddp_utils/sweep/run.py",
        "            if out and run_holds_folder(out, trial_job(self.sweep.name, first)):",
        "            if False and run_holds_folder(out, trial_job(self.sweep.name, first)):",
        (f"{SWEEP}::test_a_stopped_worker_keeps_its_trials_result_and_goes_on",),
    ),
    Mutant(
        "sampler_seed_from_pid",
        "each worker's sampler seed is the file's seed plus its pid: workers in containers (pid 1 each) draw the same parameters",
        "ddp_utils/sweep/run.py",
        "    seed = (sweep.seed + secrets.randbits(32)) % 2**32",
        "    seed = (sweep.seed + os.getpid()) % 2**32",
        (f"{SWEEP}::test_workers_with_one_pid_draw_their_own_parameters",),
    ),
    Mutant(
        "results_temp_file_named_by_pid",
        "the results' temporary file is named by the pid: two workers with one pid overwrite one file and one's replace fails",
        "ddp_utils/sweep/results.py",
        """    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")""",
        """    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")""",
        (f"{SWEEP}::test_workers_with_one_pid_write_the_results_whole",),
    ),
    Mutant(
        "storage_password_printed",
        "a storage URL that cannot be opened is quoted whole in the error line, its password with it",
        "ddp_utils/sweep/run.py",
        '''f"{sweep.path}: sweep.storage {masked(url, url)}: cannot open it: {masked(first, url)}"''',
        '''f"{sweep.path}: sweep.storage {url}: cannot open it: {masked(first, url)}"''',
        (f"{SWEEP}::test_a_storage_urls_password_is_never_printed",),
    ),
    Mutant(
        "row_shards_epoch_not_shared",
        "a table's shards: persistent DataLoader workers keep the epoch they started with (input noise of epoch 0 forever)",
        "ddp_utils/data/table_shards.py",
        "self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # seen by persistent workers",
        "self.epoch = torch.zeros((), dtype=torch.int64)  # seen by persistent workers",
        (f"{STREAMING}::test_sigterm_mid_epoch_then_the_same_command_resumes_exactly",),
        task="tabular",
    ),
    Mutant(
        "fork_closes_parents_s3_clients",
        "a DataLoader worker lets the S3 clients it inherited be collected: closing them drops the training "
        "process's connections from its event loop, whose next download waits out the 60 s read timeout",
        "ddp_utils/data/shards.py",
        "        _INHERITED.extend(s3fs.S3FileSystem._cache.values())",
        "        _INHERITED.clear()",
        (f"{STREAMING}::test_a_download_cut_half_way_is_fetched_again_and_never_read",),
    ),
    Mutant(
        "table_shards_hold_the_table",
        "make_shards.py keeps every chunk of the table it has read: the table whole in memory",
        "ddp_utils/data/table_shards.py",
        'moments, done = Moments(), 0\n        for chunk in table_chunks(cfg.data_file, "data_file"):',
        'moments, done = Moments(), 0\n        for chunk in list(table_chunks(cfg.data_file, "data_file")):',
        (f"{STREAMING}::test_make_shards_writes_the_rows_training_reads_without_holding_the_table",),
        task="tabular",
    ),
    Mutant(
        "table_shards_rows_in_file_order",
        "a table's shards hold the training rows in the file's order, not in the order training on the table reads",
        "ddp_utils/data/table_shards.py",
        "place[train_rows] = np.arange(len(train_rows))",
        "place[np.sort(train_rows)] = np.arange(len(train_rows))",
        (f"{STREAMING}::test_make_shards_writes_the_rows_training_reads_without_holding_the_table",),
        task="tabular",
    ),
    Mutant(
        "table_shards_statistics_with_validation_rows",
        "make_shards.py standardises with statistics of the validation rows too",
        "ddp_utils/data/table_shards.py",
        "moments.add(inputs[train])",
        "moments.add(inputs[train | val])",
        (f"{STREAMING}::test_make_shards_writes_the_rows_training_reads_without_holding_the_table",),
        task="tabular",
    ),
    Mutant(
        "table_shards_temp_room_unchecked",
        "make_shards.py starts sorting rows into a --temp_dir without room for them: the disk fills hours later",
        "ddp_utils/data/table_shards.py",
        '        buckets.reserve(sizes["train"] + sizes["val"])\n',
        "",
        (f"{STREAMING}::test_a_temp_dir_without_room_is_one_line_before_anything_is_written",),
        task="tabular",
    ),
    Mutant(
        "table_shards_val_samples_per_chunk",
        "--val_samples of a --val_file counted per chunk: the rows after the first chunk kept too",
        "ddp_utils/data/table_shards.py",
        "kept = max(0, min(chunk.rows, cfg.val_samples - done)) if cfg.val_samples else chunk.rows",
        "kept = min(chunk.rows, cfg.val_samples) if cfg.val_samples else chunk.rows",
        (f"{STREAMING}::test_make_shards_of_a_parquet_table_with_a_validation_file_and_a_number_to_predict",),
        task="tabular",
    ),
]


def bake(folder, task):
    cookiecutter = Path(sys.executable).parent / "cookiecutter"
    subprocess.run([str(cookiecutter), "--no-input", str(TEMPLATE), "--output-dir", str(folder), f"task={task}"],
                   check=True, capture_output=True)  # fmt: skip
    (project,) = [p for p in Path(folder).iterdir() if p.is_dir()]
    return project


def apply(mutant, project):
    path = project / mutant.file
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(f"mutant {mutant.name}: its text occurs {count} times in {mutant.file}, not once; update it")
    path.write_text(text.replace(mutant.old, mutant.new))


def run_tests(project, tests, zoo=None):
    """The tests (none: the project's default pytest, the whole quick check, every failure
    reported), with tests/zoo's model `zoo` in place; returns the exit code, seconds, and the
    last line of the output, after the failing assertions of the quick check."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **({"ZOO_MODEL": zoo} if zoo else {}),
        "COLUMNS": "1000",  # pytest's summary lines whole: the failing assertions' numbers
    }
    command = [sys.executable, "-m", "pytest", *(["-x"] if tests else []), "-q", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    try:
        result = subprocess.run(command, check=False, cwd=project, env=env, capture_output=True, text=True,
                                timeout=TIMEOUT)  # fmt: skip
        lines = (result.stdout + result.stderr).strip().splitlines()
        failed = [] if tests else [line.strip() for line in lines if line.startswith("FAILED ")]
        code, tail = result.returncode, [" / ".join([*failed, *lines[-1:]])]
    except subprocess.TimeoutExpired:
        code, tail = "timeout", ["timed out"]
    return code, time.monotonic() - started, tail[0] if tail else ""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per mutant")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-control", action="store_true", help="skip the run on the unchanged project")
    parser.add_argument("--quick-check", action="store_true", help="run the default pytest, not each mutant's tests")
    parser.add_argument("--zoo", metavar="NAME", help="the language bake with tests/zoo's model NAME (ZOO_MODEL)")
    args = parser.parse_args()
    by_name = {m.name: m for m in MUTANTS}
    unknown = [name for name in args.names if name not in by_name]
    if unknown:
        parser.error(f"unknown mutant(s): {', '.join(unknown)}; see --list")
    if args.list:
        for m in MUTANTS:
            print(f"{m.name}: {m.bug} ({m.task}: {m.file}) -> {', '.join(m.tests)}")
        return 0
    selected = [by_name[name] for name in args.names] or MUTANTS
    with tempfile.TemporaryDirectory(prefix="mutants-") as scratch:
        tasks = sorted({m.task for m in selected})
        base = {task: bake(Path(scratch) / "base" / task, task) for task in tasks}
        if args.zoo:
            with open(base["language"] / "model.py", "a") as model:
                model.write("\n\n" + (TEMPLATE / "tests" / "zoo" / "language.py").read_text())
        chosen = (lambda tests: []) if args.quick_check else (lambda tests: tests)
        for mutant in selected:  # every mutant still fits the code before anything runs
            copy = Path(scratch) / "check" / mutant.name
            shutil.copytree(base[mutant.task], copy)
            apply(mutant, copy)
        for task in [] if args.no_control else tasks:
            tests = sorted({test for m in selected if m.task == task for test in m.tests})
            code, seconds, tail = run_tests(base[task], chosen(tests), args.zoo)
            print(f"control ({task}, unchanged, {len(tests)} test selections): {tail} [{seconds:.0f} s]", flush=True)
            if code != 0:
                print("the control run failed: fix the suite before reading the mutants", file=sys.stderr)
                return 1
        rows, missed = [], 0
        for mutant in selected:
            outcomes = []
            for attempt in range(args.repeat):
                project = Path(scratch) / "runs" / f"{mutant.name}_{attempt}"
                shutil.copytree(base[mutant.task], project)
                apply(mutant, project)
                code, seconds, tail = run_tests(project, chosen(mutant.tests), args.zoo)
                outcomes.append((code != 0, seconds))
                shutil.rmtree(project, ignore_errors=True)
                print(f"{mutant.name} run {attempt + 1}: {'caught' if code != 0 else 'MISSED'} ({tail}) [{seconds:.0f} s]",
                      flush=True)  # fmt: skip
            caught = sum(c for c, _ in outcomes)
            missed += caught < len(outcomes)
            seconds = sum(s for _, s in outcomes) / len(outcomes)
            tests = ", ".join(t.split("::")[-1] for t in mutant.tests)
            rows.append(f"| {mutant.name} | {mutant.bug} | {tests} | {caught}/{len(outcomes)} | {seconds:.0f} |")
    print("\n| mutant | bug | tests | caught | s |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\n{len(selected) - missed} of {len(selected)} mutants caught every time")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
