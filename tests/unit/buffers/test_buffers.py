"""Semantics of the FIFO, FIRO and Reservoir buffers."""

from __future__ import annotations

import pickle
import threading
import time
from collections import Counter

import numpy as np
import pytest

from melissa_dl.buffers.kinds import (
    Buffer,
    FifoBuffer,
    FiroBuffer,
    ReservoirBuffer,
    make_buffer,
)
from melissa_dl.buffers.sample import Sample
from melissa_dl.config.registry import BUFFERS
from melissa_dl.errors import BufferClosed, ConfigError

pytestmark = pytest.mark.timeout(60)

SHORT = 0.05  # seconds: long enough to prove a wait, short enough for a fast suite


def mk(i: int, n: int = 4, sim: int = 0) -> Sample:
    """Sample number ``i``; its bytes are 8 (parameters) + 8 * n (one float64 field)."""
    return Sample(sim, i, np.zeros(1), {"u": np.zeros(n)})


def ids(batch: list[Sample]) -> list[int]:
    return [s.time_step for s in batch]


def buf(
    kind: str,
    *,
    cap: int | None = 100,
    cap_bytes: int | None = None,
    watermark: int = 0,
    seed: int = 0,
    pseudo_epochs: int = 1,
    passes: int | None = None,
) -> Buffer:
    return make_buffer(
        kind,
        capacity_samples=cap,
        capacity_bytes=cap_bytes,
        watermark=watermark,
        seed=seed,
        pseudo_epochs=pseudo_epochs,
        passes_after_data=passes,
    )


def fill(b: Buffer, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        assert b.put(mk(i), timeout=1)


def drain(b: Buffer, size: int) -> list[int]:
    """Close, then serve until end of stream; the served ids in order."""
    b.close()
    out: list[int] = []
    for _ in range(10_000):
        batch = b.get_batch(size, timeout=1)
        assert batch is not None
        if not batch:
            return out
        assert len(set(ids(batch))) == len(batch)
        out += ids(batch)
    raise AssertionError("buffer never drained")


# ---------------------------------------------------------------- FIFO
def test_fifo_serves_in_arrival_order_and_removes():
    b = buf("fifo")
    fill(b, 10)
    assert ids(b.get_batch(3, timeout=1)) == [0, 1, 2]
    assert len(b) == 7
    assert [c[1] for c in b.served_counts()] == list(range(3, 10))
    assert ids(b.get_batch(4, timeout=1)) == [3, 4, 5, 6]
    fill(b, 2, start=10)
    assert drain(b, 4) == [7, 8, 9, 10, 11]
    assert len(b) == 0 and b.nbytes == 0
    assert b.total_put == 12 and b.total_served == 12


# ---------------------------------------------------------------- FIRO
def test_firo_random_order_each_served_once():
    b = buf("firo", seed=1)
    fill(b, 20)
    order = [i for _ in range(5) for i in ids(b.get_batch(4, timeout=1))]
    assert sorted(order) == list(range(20))
    assert order != list(range(20))
    assert len(b) == 0
    assert b.get_batch(1, timeout=SHORT) is None  # empty, not closed


def test_firo_pseudo_epochs():
    n, epochs = 10, 3
    b = buf("firo", seed=2, pseudo_epochs=epochs)
    fill(b, n)
    served: list[int] = []
    while len(b) >= 2:
        batch = ids(b.get_batch(2, timeout=1))
        assert len(set(batch)) == 2
        served += batch
        assert all(c <= epochs for *_, c in b.served_counts())
    served += drain(b, 2)
    assert Counter(served) == {i: epochs for i in range(n)}
    assert b.total_served == n * epochs


@pytest.mark.parametrize("kind", ["firo", "reservoir"])
def test_random_kinds_pick_every_held_sample_equally_often(kind: str) -> None:
    """Over 2000 seeds, each of 8 samples is in the first batch of 2 about 500 times (sd 19): neither the
    last arrivals (a FIRO's order is built at insertion) nor any place is favoured. The Reservoir is
    measured open and, closed, draining."""
    for closed in (False, True) if kind == "reservoir" else (False,):
        counts: Counter[int] = Counter()
        for seed in range(2000):
            b = buf(kind, seed=seed)
            fill(b, 8)
            if closed:
                b.close()
            counts.update(ids(b.get_batch(2, timeout=1)))
        assert set(counts) == set(range(8)) and all(420 < c < 580 for c in counts.values()), counts


def test_firo_seed_decides_order():
    orders = []
    for seed in (5, 5, 6):
        b = buf("firo", seed=seed)
        fill(b, 20)
        orders.append(drain(b, 20))
    assert orders[0] == orders[1] != orders[2]


# ---------------------------------------------------------------- Reservoir
def test_reservoir_keeps_served_samples():
    b = buf("reservoir", cap=5, seed=3)
    fill(b, 5)
    for _ in range(10):
        assert len(b.get_batch(3, timeout=1)) == 3
    assert len(b) == 5
    assert sum(c for *_, c in b.served_counts()) == 30 == b.total_served


def test_reservoir_put_waits_when_full_and_nothing_served():
    b = buf("reservoir", cap=4, seed=3)
    fill(b, 4)
    assert b.put(mk(99), timeout=SHORT) is False
    assert b.put_wait_seconds >= SHORT * 0.9
    assert len(b) == 4


def test_reservoir_replaces_only_served():
    b = buf("reservoir", cap=6, seed=4)
    fill(b, 6)
    served = set(ids(b.get_batch(2, timeout=1)))
    fill(b, 2, start=100)  # each arrival evicts one served sample
    held = {t for _, t, _ in b.served_counts()}
    assert held == (set(range(6)) - served) | {100, 101}
    assert b.put(mk(102), timeout=SHORT) is False  # no served sample left
    # Evicted samples are always served ones, over many rounds.
    for r in range(50):
        batch = ids(b.get_batch(3, timeout=1))
        counts = {t: c for _, t, c in b.served_counts()}
        assert all(counts[t] >= 1 for t in batch)
        before = {t for t, c in counts.items() if c >= 1}
        assert b.put(mk(200 + r), timeout=1)
        after = {t for _, t, _ in b.served_counts()}
        evicted = set(counts) - after
        assert len(evicted) == 1 and evicted <= before


def test_reservoir_put_unblocked_by_serving():
    b = buf("reservoir", cap=3, seed=5)
    fill(b, 3)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(b.put(mk(9), timeout=10)))
    t.start()
    assert len(b.get_batch(1, timeout=1)) == 1
    t.join(timeout=10)
    assert not t.is_alive()
    assert result == [True] and 9 in {s for _, s, _ in b.served_counts()}


def test_reservoir_drains_after_close():
    b = buf("reservoir", cap=8, seed=6)
    fill(b, 8)
    for _ in range(5):
        b.get_batch(3, timeout=1)
    assert sorted(drain(b, 3)) == list(range(8))
    assert len(b) == 0


# ---------------------------------------------------------------- common rules
@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_watermark(kind):
    b = buf(kind, cap=20, watermark=5)
    fill(b, 4)
    assert b.get_batch(2, timeout=SHORT) is None
    assert b.get_wait_seconds >= SHORT * 0.9
    fill(b, 1, start=4)
    assert len(b.get_batch(2, timeout=1)) == 2


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_watermark_is_cumulative(kind):
    b = buf(kind, cap=20, watermark=3)
    fill(b, 3)
    assert len(b.get_batch(3, timeout=1)) == 3
    fill(b, 1, start=3)
    if kind != "reservoir":  # FIFO/FIRO removed the first three
        assert b.get_batch(1, timeout=1) is not None


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_closed_serves_below_watermark(kind):
    b = buf(kind, cap=20, watermark=10)
    fill(b, 3)
    b.close()
    assert sorted(ids(b.get_batch(8, timeout=1))) == [0, 1, 2]
    if kind == "reservoir":
        assert b.get_batch(8, timeout=1) == []


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_get_batch_wakes_on_put(kind):
    b = buf(kind, cap=20, watermark=2)
    got: list = []
    t = threading.Thread(target=lambda: got.append(b.get_batch(2, timeout=10)))
    t.start()
    fill(b, 2)
    t.join(timeout=10)
    assert not t.is_alive()
    assert sorted(ids(got[0])) == [0, 1]


class CountingCondition(threading.Condition):
    """A condition that counts its waits: each one after the first is a waiter woken too early."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_a_waiting_get_is_woken_only_once_its_batch_is_there(kind):
    b = buf(kind, cap=20)
    b._cond = condition = CountingCondition()
    got: list = []
    t = threading.Thread(target=lambda: got.append(b.get_batch(8, timeout=10)))
    t.start()
    while not condition.waits:  # the get waits
        time.sleep(0.001)
    fill(b, 7)
    time.sleep(SHORT)
    assert condition.waits == 1 and t.is_alive()
    fill(b, 1, start=7)
    t.join(timeout=10)
    assert not t.is_alive() and condition.waits == 1
    assert sorted(ids(got[0])) == list(range(8))


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_of_two_waiting_gets_the_smaller_is_served_first(kind):
    b = buf(kind, cap=20)
    b._cond = condition = CountingCondition()
    got: dict[int, list] = {}
    takers = [
        threading.Thread(target=lambda size=size: got.setdefault(size, b.get_batch(size, timeout=10)))
        for size in (8, 2)
    ]
    for t in takers:
        waits = condition.waits
        t.start()
        while condition.waits == waits:  # this get waits
            time.sleep(0.001)
    fill(b, 2)
    takers[1].join(timeout=10)
    assert not takers[1].is_alive() and len(got[2]) == 2 and takers[0].is_alive()
    fill(b, 8, start=2)
    takers[0].join(timeout=10)
    assert not takers[0].is_alive() and len(got[8]) == 8


@pytest.mark.parametrize("kind,pe", [("fifo", 1), ("firo", 1), ("firo", 4), ("reservoir", 1)])
def test_no_duplicates_in_batch(kind, pe):
    b = buf(kind, cap=6, seed=7, pseudo_epochs=pe)
    fill(b, 6)
    for _ in range(30 if kind == "reservoir" or pe > 1 else 1):
        if len(b) < 4:
            break
        batch = ids(b.get_batch(4, timeout=1))
        assert len(set(batch)) == 4
    drain(b, 4)  # checks every batch, including the short ones
    # Full buffer, batch larger than what is held: what is there, once each.
    b = buf(kind, cap=3, seed=7, pseudo_epochs=pe)
    fill(b, 3)
    for _ in range(5):
        batch = ids(b.get_batch(10, timeout=1))
        assert sorted(batch) == [0, 1, 2]
        if kind != "reservoir" and pe == 1:
            break
        if kind == "firo" and len(b) == 0:
            break


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_capacity_samples(kind):
    b = buf(kind, cap=3)
    fill(b, 3)
    assert b.put(mk(3), timeout=SHORT) is False
    assert b.put(mk(3), timeout=0) is False
    assert len(b) == 3


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_capacity_bytes(kind):
    one = mk(0).nbytes  # 40
    b = buf(kind, cap=None, cap_bytes=3 * one + 20)
    fill(b, 3)
    assert b.nbytes == 3 * one
    assert b.put(mk(3), timeout=SHORT) is False
    assert b.put(mk(3, n=1), timeout=0)  # 16 bytes still fit
    assert b.nbytes == 3 * one + 16


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_oversize_sample_accepted_only_when_empty(kind):
    b = buf(kind, cap=None, cap_bytes=100)
    big = mk(0, n=50)
    assert big.nbytes > 100
    assert b.put(big, timeout=0)
    assert b.put(mk(1, n=1), timeout=SHORT) is False
    assert ids(b.get_batch(5, timeout=1)) == [0]  # full: served below size
    if kind == "reservoir":
        assert b.put(mk(1, n=1), timeout=1)  # evicts the served big one
        assert ids(b.get_batch(1, timeout=1)) == [1]
    else:
        assert len(b) == 0
        assert b.put(mk(1, n=50), timeout=0)


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_full_buffer_serves_below_batch_size_and_watermark(kind):
    b = buf(kind, cap=4, watermark=100)
    fill(b, 4)
    assert sorted(ids(b.get_batch(10, timeout=1))) == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_blocked_producer_counts_as_full(kind):
    # Bytes are not exhausted, but the next sample does not fit: a waiting
    # consumer must be woken and served what is there, not left waiting.
    b = buf(kind, cap=None, cap_bytes=100, seed=8)
    fill(b, 2)  # 80 bytes
    got: list = []
    consumer = threading.Thread(target=lambda: got.append(b.get_batch(5, timeout=5)))
    consumer.start()
    time.sleep(SHORT)  # let the consumer block first
    producer = threading.Thread(target=lambda: got.append(b.put(mk(2), timeout=10)))
    producer.start()
    for t in (consumer, producer):
        t.join(timeout=10)
        assert not t.is_alive()
    batch, stored = got
    assert sorted(ids(batch)) == [0, 1] and stored is True
    assert b.get_wait_seconds < 2  # woken by the blocked put, not by the timeout


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_close(kind):
    b = buf(kind)
    got: list = []
    t = threading.Thread(target=lambda: got.append(b.get_batch(2, timeout=10)))
    t.start()
    b.close()
    b.close()  # idempotent
    t.join(timeout=10)
    assert not t.is_alive()
    assert got == [[]] and b.closed
    with pytest.raises(BufferClosed):
        b.put(mk(0))


def test_close_wakes_blocked_put():
    b = buf("fifo", cap=1)
    fill(b, 1)
    errors: list = []

    def producer() -> None:
        try:
            b.put(mk(1), timeout=10)
        except BufferClosed as e:
            errors.append(e)

    t = threading.Thread(target=producer)
    t.start()
    b.close()
    t.join(timeout=10)
    assert not t.is_alive() and len(errors) == 1


# ---------------------------------------------------------------- state
@pytest.mark.parametrize("kind,pe", [("fifo", 1), ("firo", 1), ("firo", 2), ("reservoir", 1)])
def test_state_dict_round_trip(kind, pe):
    a = buf(kind, cap=8, watermark=3, seed=9, pseudo_epochs=pe)
    fill(a, 8)
    a.get_batch(3, timeout=1)
    state = pickle.loads(pickle.dumps(a.state_dict()))
    b = buf(kind, cap=8, watermark=3, seed=1234, pseudo_epochs=pe)
    b.load_state_dict(state)
    assert b.served_counts() == a.served_counts()
    assert (len(b), b.nbytes, b.total_put, b.total_served) == (len(a), a.nbytes, a.total_put, a.total_served)

    def run(x: Buffer) -> list[int]:
        out: list[int] = []
        for r in range(6):
            x.put(mk(100 + r), timeout=0)  # may refuse (full Reservoir): same for both
            out += ids(x.get_batch(1, timeout=1))
        return out + drain(x, 3)

    assert run(a) == run(b)


def test_load_state_dict_rejects_other_kind():
    a = buf("fifo")
    with pytest.raises(ConfigError, match="fifo"):
        buf("firo").load_state_dict(a.state_dict())


def test_state_dict_keeps_closed_flag():
    a = buf("firo")
    fill(a, 2)
    a.close()
    b = buf("firo")
    b.load_state_dict(a.state_dict())
    assert b.closed
    assert len(b.get_batch(5, timeout=1)) == 2


# ---------------------------------------------------------------- passes after the data
@pytest.mark.parametrize("kind,pe", [("fifo", 1), ("firo", 1), ("firo", 3), ("reservoir", 1)])
def test_passes_after_the_data_serve_each_held_sample_once_per_pass(kind: str, pe: int) -> None:
    """Once the data has ended, 3 passes over the 7 samples held (some served already), batches of 3: each pass
    ends with a short batch rather than one that holds a sample twice; whatever the kind, nothing leaves before the
    last pass; FIFO keeps the arrival order, the random kinds draw a new order each pass."""
    b = buf(kind, cap=10, seed=4, pseudo_epochs=pe, passes=3)
    fill(b, 10)
    b.get_batch(3, timeout=1)
    held = sorted(s for _, s, _ in b.served_counts())
    assert len(held) == (7 if kind != "reservoir" and pe == 1 else 10)
    b.close()
    passes: list[list[int]] = [[] for _ in range(3)]
    sizes = []
    for p in range(3):
        assert b.passes_done == p and len(b) == len(held)
        while len(passes[p]) < len(held):
            batch = ids(b.get_batch(3, timeout=1))
            assert len(set(batch)) == len(batch)
            sizes.append(len(batch))
            passes[p] += batch
    assert b.get_batch(3, timeout=1) == [] and b.passes_done == 3 and len(b) == 0 and b.nbytes == 0
    assert all(sorted(one) == held for one in passes)
    per_pass = [3] * (len(held) // 3) + ([len(held) % 3] if len(held) % 3 else [])
    assert sizes == per_pass * 3
    if kind == "fifo":
        assert passes == [held] * 3
    else:
        assert passes[0] != passes[1] or passes[1] != passes[2]


def test_without_passes_a_buffer_drains_as_its_kind_does() -> None:
    b = buf("reservoir", cap=5)
    fill(b, 5)
    assert sorted(drain(b, 2)) == [0, 1, 2, 3, 4] and b.passes_done is None


def test_an_empty_buffer_has_no_pass_to_serve() -> None:
    b = buf("reservoir", passes=4)
    b.close()
    assert b.get_batch(2, timeout=1) == [] and b.passes_done == 4


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_a_checkpoint_in_the_middle_of_the_passes_resumes_them(kind: str) -> None:
    """Restored midway through its second pass, reopened (as the receiver restores it) and closed again when the
    study is found over, a buffer serves what the original would have, to the end."""
    a = buf(kind, cap=9, seed=2, passes=3)
    fill(a, 9)
    a.close()
    for _ in range(4):  # the first pass (3 batches) and one batch of the second
        a.get_batch(3, timeout=1)
    b = buf(kind, cap=9, seed=77, passes=3)
    b.load_state_dict({**pickle.loads(pickle.dumps(a.state_dict())), "closed": False})
    b.close()
    assert b.passes_done == a.passes_done == 1
    assert drain(b, 3) == drain(a, 3)
    assert len(b) == 0 and b.passes_done == 3


# ---------------------------------------------------------------- concurrency
@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_producer_consumer(kind):
    n = 2000
    b = buf(kind, cap=16, watermark=8, seed=10)
    served: list[int] = []
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            for i in range(n):
                assert b.put(mk(i), timeout=10)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
        finally:
            b.close()

    def consumer() -> None:
        try:
            while True:
                batch = b.get_batch(4, timeout=10)
                assert batch is not None, "consumer timed out"
                if not batch:
                    return
                assert len(set(ids(batch))) == len(batch)
                served.extend(ids(batch))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    if kind == "reservoir":
        assert set(served) == set(range(n))
    else:
        assert Counter(served) == Counter(range(n))
    if kind == "fifo":
        assert served == list(range(n))
    assert b.total_put == n and b.total_served == len(served) and len(b) == 0


# ---------------------------------------------------------------- factory
def test_make_buffer_kinds():
    assert tuple(BUFFERS) == ("fifo", "firo", "reservoir")
    for kind, cls in zip(tuple(BUFFERS), (FifoBuffer, FiroBuffer, ReservoirBuffer)):
        assert type(buf(kind, pseudo_epochs=2)) is cls


def test_on_insert_and_state_dict_with_see_a_put_together() -> None:
    buffer = make_buffer("fifo", capacity_samples=10, capacity_bytes=None, watermark=1, seed=0)
    committed: list[int] = []
    stop = threading.Event()

    def produce() -> None:
        for t in range(2000):
            buffer.put(Sample(0, t, np.zeros(1), {"x": np.zeros(1)}), on_insert=lambda t=t: committed.append(t))
            if t % 10 == 9:
                buffer.get_batch(10)
        stop.set()

    thread = threading.Thread(target=produce)
    thread.start()
    while not stop.is_set():
        state, count = buffer.state_dict_with(lambda: len(committed))
        assert state["total_put"] == count  # never a sample without its side effect, or the reverse
    thread.join()


@pytest.mark.parametrize("kind", ["fifo", "firo", "reservoir"])
def test_batches_a_stop_left_untrained_come_back_first_through_a_checkpoint_and_a_reshard(kind: str) -> None:
    """``hold`` keeps a formed batch as it is (the last held is the first taken, as a batch given back again is
    the oldest); a checkpoint keeps them; resharding deals them out as the ranks' samples are: new rank r takes
    old ranks r, r + K, ..."""
    b = buf(kind)
    b.hold("second")
    b.hold("first")
    restored = buf(kind)
    restored.load_state_dict(pickle.loads(pickle.dumps(b.state_dict())))
    assert [restored.take_held(), restored.take_held(), restored.take_held()] == ["first", "second", None]
    olds = []
    for rank in range(3):
        old = buf(kind)
        fill(old, 2, start=10 * rank)
        old.hold(f"of old rank {rank}")
        olds.append(old.state_dict())
    new = [buf(kind) for _ in range(2)]
    for rank, b in enumerate(new):
        b.load_resharded(olds, rank, 2)
    assert [new[0].take_held(), new[0].take_held(), new[0].take_held()] == ["of old rank 0", "of old rank 2", None]
    assert [new[1].take_held(), new[1].take_held()] == ["of old rank 1", None]
