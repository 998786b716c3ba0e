"""Checkpoints (docs/explanation/design.md#checkpoints): versions on disk, what a rank saves and restores, snapshots
written off the training thread, serialisation.
"""
