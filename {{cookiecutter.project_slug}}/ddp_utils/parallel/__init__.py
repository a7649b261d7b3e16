"""How the model is spread over the ranks: --strategy ddp, fsdp or hsdp.

strategy.py    the strategies: wrapping and sharding the model, clipping, its state saved and loaded
model_init.py  the initial weights, the same under every strategy; the blocks fsdp shards
comm_hooks.py  ddp's gradient compression (--comm_hook): the one list of hooks, PowerSGD's settings
"""
