"""How a server tells the outside world (``melissa-launcher``, batch scripts) how it is doing."""

EXIT_CONFIG = (
    2  # bad configuration, an output folder full or not writable, or nothing to resume from: a restart cannot help
)
EXIT_FAILED_SIMULATIONS = 3  # the study ran to its end, some simulations failed
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after a checkpoint; the same command resumes
HEARTBEAT = "heartbeat"  # file in the output folder that rank 0 touches at every bookkeeping round
STATUS = "status.json"  # rank 0's latest status, rewritten atomically (``melissa-server --status``)
HISTORY = "progress.jsonl"  # every status so far, one JSON per line (what the plots draw over time)
