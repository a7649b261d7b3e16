"""How the model is spread over the ranks: --strategy ddp, fsdp or hsdp, and how it fits.

strategy.py                  the strategies: wrapping and sharding the model, clipping, its state saved and loaded
model_init.py                the initial weights, the same under every strategy; activation checkpointing applied
blocks.py                    a model's blocks: fsdp's shard units, activation checkpointing's units
activation_checkpointing.py  --activation_checkpointing: blocks recomputed in backward (full, every_other, ops)
comm_hooks.py                ddp's gradient compression (--comm_hook): the one list of hooks, PowerSGD's settings
"""
