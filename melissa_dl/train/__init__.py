"""Training: the lockstep loop, the trainer, data parallelism, the user's training module and the buffer seen as a
dataset.
"""
