"""How the model is spread over the ranks: --strategy ddp, fsdp or hsdp.

strategy.py  building, wrapping and sharding the model; its state saved and loaded
"""
