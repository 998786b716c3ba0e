"""A rank's receiver, never started: the order in which it and its buffer take their locks."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from melissa_dl.buffers.kinds import make_buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.ingest.assembly import StreamSpec
from melissa_dl.ingest.receiver import Receiver

pytestmark = pytest.mark.timeout(60)


def test_a_report_while_a_put_commits_its_sample_does_not_deadlock() -> None:
    """A put holds the buffer's lock while it commits the sample under the receiver's; a report taken meanwhile
    reads the buffer (its passes after the data) and must not hold the receiver's lock while it waits for the
    buffer's (bench/threads.py's study once deadlocked so, both ranks for good)."""
    spec = StreamSpec(["u"], np.zeros((1, 1)), bytes(32), server_rank=0, server_size=1)
    buffer = make_buffer("fifo", capacity_samples=10, capacity_bytes=None, watermark=1, seed=0, passes_after_data=2)
    receiver = Receiver(spec, buffer, "127.0.0.1", receive_queue_bytes=1 << 20)
    sample = Sample(0, 0, np.zeros(1), {"u": np.zeros(3, np.float32)})
    committing = threading.Event()

    def commit() -> None:  # under the buffer's lock, as Receiver.handle's put runs it
        committing.set()
        time.sleep(0.2)  # the report below starts meanwhile
        receiver._commit(sample)

    put = threading.Thread(target=lambda: buffer.put(sample, on_insert=commit))
    put.start()
    assert committing.wait(10)
    reports = []
    report = threading.Thread(target=lambda: reports.append(receiver.report()), daemon=True)
    report.start()
    put.join(10)
    report.join(10)
    assert not put.is_alive() and not report.is_alive(), "the put and the report wait for each other's lock"
    assert reports[0].samples == 1 and reports[0].buffer_size == 1
