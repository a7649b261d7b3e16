#!/usr/bin/env bash
# Benchmark the generated train.py against a minimal DDP loop (see bench/run.py), or with
# --fsdp its two strategies against each other (see bench/fsdp.py), or with --network the
# step time of two hosts against one over limited links (see bench/network.py; needs root;
# --network --strategies: ddp, fsdp and hsdp on 2 hosts x 2 processes over the link), or with
# --tabular-noise the tabular task's noise draw (see bench/tabular_noise.py), or with
# --tabular-loader the tabular training loader's samples/s (see bench/tabular_loader.py), or with
# --breakdown where a step's time goes, the generated loop beside the minimal one (see
# bench/breakdown.py), or with --ci-cpu where the test suite's CPU time goes (see bench/ci_cpu.py),
# or with --chaos random faults under fsdp (see bench/chaos.py), or with --time-to-quality AdamW
# against Muon to a target loss (see bench/time_to_quality.py), or with --activation-checkpointing
# each --activation_checkpointing mode's activation memory and step time (see
# bench/activation_checkpointing.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
if [[ ${1:-} == --fsdp ]]; then
    shift
    exec .venv/bin/python bench/fsdp.py "$@"
fi
if [[ ${1:-} == --network ]]; then
    shift
    exec .venv/bin/python bench/network.py "$@"
fi
if [[ ${1:-} == --breakdown ]]; then
    shift
    exec .venv/bin/python bench/breakdown.py "$@"
fi
if [[ ${1:-} == --ci-cpu ]]; then
    shift
    exec .venv/bin/python bench/ci_cpu.py "$@"
fi
if [[ ${1:-} == --chaos ]]; then
    shift
    exec .venv/bin/python bench/chaos.py "$@"
fi
if [[ ${1:-} == --time-to-quality ]]; then
    shift
    exec .venv/bin/python bench/time_to_quality.py "$@"
fi
if [[ ${1:-} == --activation-checkpointing ]]; then
    shift
    exec .venv/bin/python bench/activation_checkpointing.py "$@"
fi
if [[ ${1:-} == --tabular-loader ]]; then
    shift
    exec .venv/bin/python bench/tabular_loader.py "$@"
fi
if [[ ${1:-} == --tabular-noise ]]; then
    shift
    exec .venv/bin/python bench/tabular_noise.py "$@"
fi
exec .venv/bin/python bench/run.py "$@"
