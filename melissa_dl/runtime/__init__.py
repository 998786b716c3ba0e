"""What a rank process needs whatever it does: ending the whole MPI job on a failure, collectives, logs, the output
folder, status and exit codes, the allocator, loading user classes.
"""
