"""Checkpoints: when to save, what goes in, the formats on disk, the room they need.

checkpointer.py  the Checkpointer: choose, load, save, when to save, random generators
formats.py       the checkpoint formats on disk: single files, DCP folders
space.py         a checkpoint's size, the room the kept ones need, a full disk in words
"""
