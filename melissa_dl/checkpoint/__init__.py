"""Checkpoints (DESIGN.md §7): versions on disk, what a rank saves and restores, snapshots written off the training
thread, serialisation.
"""
