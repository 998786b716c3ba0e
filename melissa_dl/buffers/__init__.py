"""Where received samples wait to be trained on: the buffer kinds (FIFO, FIRO, Reservoir), a sample, and rows of
processed samples.
"""
