"""Checkpoints: when to save, what goes in, the formats on disk, the room they need.

checkpointer.py  the Checkpointer: choose, load, save, when to save, random generators
loading.py       which checkpoint a run resumes from, and reading one back checked, of either kind
single_file.py   one-file checkpoints (--strategy ddp), written whole or not at all
sharded.py       sharded checkpoints (--strategy fsdp): DCP folders, published whole
space.py         a checkpoint's size, the room the kept ones need, a full disk in words
"""
