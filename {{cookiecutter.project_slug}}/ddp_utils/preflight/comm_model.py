"""What the gradients cost to send, and what that does to a step: the preflight's model of a
job's communication (preflight.py measures; this predicts from the measurements).

Pure functions of sizes and measured all-reduce times: no collective, no device.
"""

import math

from ..core.units import size_text
from ..parallel.comm_hooks import POWERSGD_MIN_COMPRESSION_RATE, POWERSGD_RANK


def bus_bandwidth(algbw, world_size):
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2(n-1)/n, comparable across sizes of n."""
    return algbw * 2 * (world_size - 1) / world_size


def allreduce_seconds(num_bytes, rows):
    """Estimated all-reduce time for `num_bytes`, from the measured row of the nearest size
    (rows of measure_allreduce: the size in MiB first; 0 without rows: nothing to all-reduce with)."""
    if not rows or not num_bytes:
        return 0.0
    size_mib, seconds, _, _ = min(rows, key=lambda row: abs(math.log(row[0] * 2**20 / num_bytes)))
    return seconds * num_bytes / (size_mib * 2**20)


def gradient_bytes(parameters, hook):
    """Bytes each process all-reduces per optimizer step for these gradients under `hook`."""
    total = 0
    for parameter in parameters:
        size = parameter.element_size()
        if hook in ("bf16", "fp16"):
            total += 2 * parameter.numel()
        elif hook == "powersgd" and parameter.dim() > 1:
            # PowerSGD's rule (torch's _should_compress): an n x m matrix travels as P (n x r)
            # and Q (m x r) when that is at least 2x smaller, otherwise whole.
            rows = parameter.shape[0]
            columns = parameter.numel() // rows
            compressed = (rows + columns) * POWERSGD_RANK
            whole = compressed * POWERSGD_MIN_COMPRESSION_RATE >= rows * columns
            total += size * (rows * columns if whole else compressed)
        else:
            total += size * parameter.numel()
    return total


def internode_bytes(parameters, cfg, world_size, nodes, sent, backend="nccl"):
    """Bytes each node sends over the inter-node link per optimizer step under each strategy, as
    ring collectives move them (a ring crosses each node boundary once; NCCL's rings and trees
    move about as much): {"ddp", "fsdp", "hsdp"}, all 0 on one node.

    - ddp: the gradients' all-reduce over every process: 2 (W-1)/W x the gradient bytes (of
      the configured comm hook).
    - fsdp: each block's parameters all-gathered over every process in forward, and again in
      backward when --reshard_after_forward (in the --amp dtype), and the gradients reduce-
      scattered (fp32): (W-1)/W x their bytes (gloo reduce-scatters with a whole all-reduce:
      twice that for the gradients, as measured on two hosts by the template's benchmarks).
    - hsdp, one replica per node: the all-gathers and reduce-scatters stay inside the node; the
      replicas all-reduce their gradient shards: 2 (N-1)/N x the gradient bytes (fp32), as ddp.
    """
    if nodes < 2:
        return {"ddp": 0, "fsdp": 0, "hsdp": 0}
    numel = sum(p.numel() for p in parameters)
    amp = {"bf16": 2, "fp16": 2}.get(cfg.amp, 4)  # bytes of a parameter as the forward uses it
    gathers = 2 if cfg.reshard_after_forward else 1
    scatter = 2 if backend == "gloo" else 1
    spread = (world_size - 1) / world_size
    return {
        "ddp": round(2 * spread * sent[cfg.comm_hook]),
        "fsdp": round(spread * (gathers * amp * numel + scatter * 4 * numel)),
        "hsdp": round(2 * (nodes - 1) / nodes * 4 * numel),
    }


def predict(compute_seconds, synced_seconds, sent, job_rows, node_rows, nodes, comm_hook):
    """Step seconds of the whole job and of one node, for every comm hook; whether the job
    trains faster than one node would, and which hook to try when another pays more.

    The job's step with the configured hook is the synced step as measured. Another hook
    sends other bytes: its step differs by the all-reduce time of the difference at the
    measured bandwidth. One node all-reduces over its own links only: its step adds the
    measured communication time scaled by how much faster those links are (nothing, with one
    process per node). Communication outside the gradient all-reduce (SyncBatchNorm's
    statistics, in forward) runs in both timed passes, so it counts as compute, also for one
    node: with sync batch norm over a slow link, one node's step is predicted too slow.
    """
    communication = max(synced_seconds - compute_seconds, 0.0)  # what the all-reduce costs, overlap and all
    configured = allreduce_seconds(sent[comm_hook], job_rows)
    within_node = allreduce_seconds(sent[comm_hook], node_rows)
    one_node = compute_seconds + (communication * within_node / configured if configured else 0.0)
    by_hook = {}
    for hook, num_bytes in sent.items():
        job = max(synced_seconds + allreduce_seconds(num_bytes, job_rows) - configured, compute_seconds)
        speedup = nodes * one_node / job  # throughput against one node's, the per-process batch the same
        by_hook[hook] = {"gradient_bytes": num_bytes, "job_step_seconds": job, "speedup": speedup,
                         "scaling_efficiency": speedup / nodes}  # fmt: skip
    chosen = by_hook[comm_hook]
    prediction = {
        "comm_hook": comm_hook,
        "compute_seconds": compute_seconds,
        "gradient_bytes": sent[comm_hook],
        "one_node_step_seconds": one_node,
        "job_step_seconds": chosen["job_step_seconds"],
        "predicted_speedup": chosen["speedup"],
        "scaling_efficiency": chosen["scaling_efficiency"],
        "multi_node_pays": chosen["speedup"] > 1 if nodes > 1 else None,
        "by_comm_hook": by_hook,
        "try_comm_hook": None,
    }
    best = max(by_hook, key=lambda hook: by_hook[hook]["speedup"])
    # Worth a change only when it wins back a tenth or more of the job's throughput.
    if nodes > 1 and best != comm_hook and by_hook[best]["speedup"] > 1.1 * chosen["speedup"]:
        prediction["try_comm_hook"] = best
    return prediction


def hook_advice(prediction):
    """One sentence on the scaling over nodes, and the comm hook to try if one pays more."""
    nodes_line = (
        f"one node's step ~{1000 * prediction['one_node_step_seconds']:.2f} ms, the job's "
        f"~{1000 * prediction['job_step_seconds']:.2f} ms: predicted speedup over one node "
        f"{prediction['predicted_speedup']:.2f}x ({'pays' if prediction['multi_node_pays'] else 'does NOT pay'})"
    )
    hook = prediction["try_comm_hook"]
    if hook:
        other = prediction["by_comm_hook"][hook]
        nodes_line += (
            f"; --comm_hook {hook} would send {size_text(other['gradient_bytes'])} a step for a "
            f"predicted {other['speedup']:.2f}x"
        )
    return nodes_line


# Per strategy: what a step communicates, and what to do when that dominates. Under fsdp
# gradient accumulation saves nothing of it: the gradients are reduce-scattered on every
# micro-step, and the parameters all-gathered in every forward.
COMMUNICATION = {
    "ddp": ("the gradient all-reduce", "Raise --batch_size or --grad_accum_steps, use a faster interconnect, or "
            "compress gradients (--comm_hook)"),
    "fsdp": ("FSDP's all-gathers and reduce-scatters", "Raise --batch_size, use a faster interconnect, or "
             "--strategy ddp where the model fits one process"),
}  # fmt: skip


def verdict(comm_seconds, compute_seconds, world_size, strategy="ddp"):
    communication, advice = COMMUNICATION[strategy]
    ratio = comm_seconds / compute_seconds
    summary = (
        f"per optimizer step: compute {1000 * compute_seconds:.2f} ms, plus {1000 * comm_seconds:.2f} ms "
        f"for {communication} ({ratio:.2f}x compute)"
    )
    if world_size == 1:
        return summary + "; single process, nothing to all-reduce"
    if ratio < 0.5:
        return summary + ": compute-bound, adding processes should scale well"
    if ratio < 1:
        return summary + ": communication is a large share; it overlaps with compute, expect sub-linear scaling"
    return summary + f": communication-bound, more nodes may train SLOWER than one. {advice}"
