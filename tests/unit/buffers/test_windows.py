"""Windows of consecutive steps as the buffers' samples: each kind's promise per window, each step held once."""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
import torch

from melissa_dl.buffers.kinds import Buffer, make_buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.buffers.windows import Window, Windowing, stacked, windows_of
from melissa_dl.train.dataset import collate
from melissa_dl.wire.protocol import Route

pytestmark = pytest.mark.timeout(60)

SIDE = 4  # each step's field is SIDE x SIDE float64 values, all equal to the step's code


def code(sim: int, step: int) -> float:
    return 1000.0 * sim + step


def step(sim: int, t: int) -> Sample:
    return Sample(sim, t, np.array([float(sim)]), {"u": np.full((SIDE, SIDE), code(sim, t))})


def windowed(
    kind: str = "fifo",
    *,
    length: int = 3,
    stride: int = 1,
    capacity: int | None = 1000,
    watermark: int = 1,
    pseudo_epochs: int = 1,
    route: Route | None = None,
    rank: int = 0,
    passes: int | None = None,
) -> Buffer:
    route = route if route is not None else Route(1)
    return make_buffer(
        kind,
        capacity_samples=capacity,
        capacity_bytes=None,
        watermark=watermark,
        seed=7,
        pseudo_epochs=pseudo_epochs,
        passes_after_data=passes,
        windowing=Windowing(length, stride, route.owner, rank),
    )


def all_windows(steps: int, length: int, stride: int = 1) -> list[int]:
    return list(range(0, steps - length + 1, stride))


def check_whole(window: Window, length: int) -> None:
    """A served window is its steps, consecutive, none missing."""
    assert [s.time_step for s in window.steps] == list(range(window.time_step, window.time_step + length))
    for s in window.steps:
        assert s.fields["u"][0, 0] == code(window.simulation_id, s.time_step)


def drain(buffer: Buffer, size: int = 4) -> list[Window]:
    """Every window a closed buffer still serves."""
    assert buffer.closed
    served = []
    while batch := buffer.get_batch(size, timeout=1):
        served += batch
    return served  # type: ignore[return-value]


def take_all(buffer: Buffer) -> list[Window]:
    """Every window an open buffer holds, served now."""
    batch = buffer.get_batch(len(buffer), timeout=1) if len(buffer) else []
    assert batch is not None
    return batch  # type: ignore[return-value]


def test_fifo_serves_each_window_once_in_the_order_it_was_made_and_holds_each_step_once() -> None:
    buffer = windowed("fifo", length=3)
    for t in range(10):
        for sim in (0, 1):
            buffer.put(step(sim, t))
    # 8 windows per simulation are made; each of the 20 steps is held once, not once per window
    assert len(buffer) == 16
    assert buffer.held_steps == 20
    assert buffer.nbytes == 20 * step(0, 0).nbytes
    batch = buffer.get_batch(16, timeout=1)
    assert batch is not None
    assert [(w.simulation_id, w.time_step) for w in batch] == [(sim, a) for a in range(8) for sim in (0, 1)]
    spans = [s for w in batch for s in w.steps]
    assert len({id(s) for s in spans}) == 20  # one object per step, shared by the windows spanning it
    for w in batch:
        check_whole(w, 3)  # type: ignore[arg-type]
    # the last two steps of each simulation wait for windows still to come; once it ends they leave
    assert buffer.held_steps == 4
    buffer.end_simulation(0)
    assert buffer.held_steps == 2
    buffer.close()
    assert (buffer.held_steps, buffer.nbytes, len(buffer)) == (0, 0, 0)


def test_a_step_leaves_once_no_window_in_the_buffer_holds_it() -> None:
    buffer = windowed("fifo", length=4)
    for t in range(8):
        buffer.put(step(0, t))
    assert buffer.held_steps == 8  # windows 0..4 span every step
    first = buffer.get_batch(1, timeout=1)
    assert first is not None and first[0].time_step == 0
    assert buffer.held_steps == 7  # step 0 was only in window 0
    buffer.get_batch(1, timeout=1)
    assert buffer.held_steps == 6


def test_stride_starts_windows_at_its_multiples_and_frees_the_steps_no_window_spans() -> None:
    buffer = windowed("fifo", length=2, stride=3)
    for t in range(9):
        buffer.put(step(0, t))
    assert buffer.held_steps == 6  # steps 2, 5 and 8 are in no window
    buffer.close()
    assert [w.time_step for w in drain(buffer, 10)] == [0, 3, 6]
    assert buffer.held_steps == 0


@pytest.mark.parametrize("epochs", [1, 3])
def test_firo_serves_each_window_pseudo_epochs_times(epochs: int) -> None:
    buffer = windowed("firo", length=3, pseudo_epochs=epochs)
    for t in range(12):
        buffer.put(step(5, t))
    buffer.close()
    served = drain(buffer, 3)
    for w in served:
        check_whole(w, 3)
    assert Counter(w.time_step for w in served) == {a: epochs for a in all_windows(12, 3)}
    assert (buffer.held_steps, buffer.nbytes) == (0, 0)


def test_reservoir_replaces_steps_without_leaving_holes_and_serves_each_window_at_least_once() -> None:
    buffer = windowed("reservoir", length=3, capacity=12)
    served: list[Window] = []
    for t in range(60):
        while not buffer.put(step(1, t), timeout=0.01):  # full of windows never served: serve some
            got = buffer.get_batch(2, timeout=1)
            assert got is not None
            served += got  # type: ignore[arg-type]
        assert buffer.held_steps <= 12
    buffer.close()
    served += drain(buffer, 2)
    for w in served:
        check_whole(w, 3)  # no window ever lost a step it spans
    assert set(w.time_step for w in served) == set(all_windows(60, 3))
    assert (buffer.held_steps, buffer.nbytes) == (0, 0)


def test_a_buffer_that_holds_no_window_takes_steps_beyond_its_capacity_rather_than_wait_forever() -> None:
    buffer = windowed("fifo", length=3, capacity=2)
    for sim in range(3):  # three simulations' first two steps: six steps, no window yet
        for t in range(2):
            assert buffer.put(step(sim, t), timeout=0.1)
    assert buffer.held_steps == 6 and len(buffer) == 0
    assert buffer.put(step(0, 2), timeout=0.1)  # window 0 of simulation 0: now it has one to serve
    assert not buffer.put(step(1, 2), timeout=0.1)  # and waits for room


def test_passes_after_the_data_serve_every_window_each_pass() -> None:
    buffer = windowed("fifo", length=2, passes=2)
    for t in range(5):
        buffer.put(step(0, t))
    buffer.close()
    assert Counter(w.time_step for w in drain(buffer, 3)) == {a: 2 for a in all_windows(5, 2)}
    assert buffer.held_steps == 0


def test_windows_across_ranks_are_made_once_each_on_the_rank_of_their_first_step() -> None:
    """The routing sends each rank its block's steps and the next block's first length - 1: every window is made
    on exactly one rank, and no rank waits for a step it never receives."""
    length, steps = 4, 50
    route = Route(2, block=8, overlap=length - 1)
    buffers = [windowed("fifo", length=length, route=route, rank=r) for r in range(2)]
    for sim in range(3):
        for t in range(steps):
            for r in route.ranks(sim, t):
                buffers[r].put(step(sim, t))
    made: Counter[tuple[int, int]] = Counter()
    for r, buffer in enumerate(buffers):
        buffer.close()
        for w in drain(buffer, 5):
            check_whole(w, length)
            assert route.owner(w.simulation_id, w.time_step) == r
            made[(w.simulation_id, w.time_step)] += 1
        assert buffer.held_steps == 0
    assert made == {(sim, a): 1 for sim in range(3) for a in all_windows(steps, length)}


@pytest.mark.parametrize("kind", ["fifo", "firo", "reservoir"])
def test_a_checkpoint_taken_midway_resumes_every_window_once(kind: str) -> None:
    buffer = windowed(kind, length=3)
    for t in range(7):
        buffer.put(step(0, t))
    first = buffer.get_batch(2, timeout=1)
    assert first is not None
    state = pickle.loads(pickle.dumps(buffer.state_dict()))
    assert len(state["windows"]["steps"]) == buffer.held_steps  # each step once in the checkpoint too
    resumed = windowed(kind, length=3)
    resumed.load_state_dict(state)
    assert (resumed.held_steps, resumed.nbytes, len(resumed)) == (buffer.held_steps, buffer.nbytes, len(buffer))
    for t in range(7, 10):
        resumed.put(step(0, t))  # the steps kept for the windows to come make them
    resumed.close()
    served = [w.time_step for w in first] + [w.time_step for w in drain(resumed)]
    if kind == "reservoir":  # it serves what it keeps again: each window at least once
        assert set(served) == set(all_windows(10, 3))
    else:
        assert sorted(served) == all_windows(10, 3)
    assert resumed.held_steps == 0


@pytest.mark.parametrize("sent", [13, 21])
def test_a_restart_on_fewer_ranks_makes_each_window_a_lost_copy_left_unmade_once(sent: int) -> None:
    """Rank 0 owns windows 0..7 of simulation 0, whose last ones need its copies of steps 8..10, and rank 1 windows
    8..15: rank 0's checkpoint lacks the copy of step 10 that rank 1 received. On one rank, window 7 is made at
    once from both ranks' steps while rank 1 still holds step 10 (13 steps sent), or once step 10 comes again
    (21 sent: rank 1 let it go), and every other window as it was: each once."""
    length = 4
    route = Route(2, block=8, overlap=length - 1)
    ranks = [windowed("fifo", length=length, route=route, rank=r) for r in range(2)]
    for t in range(sent):
        for r in route.ranks(0, t):
            if not (r == 0 and t == 10):  # rank 0's copy of step 10 is still in flight at the checkpoint
                ranks[r].put(step(0, t))
    made_before = Counter((w.simulation_id, w.time_step) for b in ranks for w in take_all(b))
    assert (0, 7) not in made_before
    olds = [pickle.loads(pickle.dumps(b.state_dict())) for b in ranks]
    one = windowed("fifo", length=length, route=Route(1), rank=0)
    one.load_resharded(olds, 0, 1)
    received = np.arange(sent)
    again = received[one.lacks(0, received)].tolist()
    assert again == ([] if sent == 13 else [10])
    for t in [*again, sent, sent + 1, sent + 2]:  # the relaunched simulation: what was seen is dropped, then on
        one.put(step(0, t))
    made_after = Counter((w.simulation_id, w.time_step) for w in take_all(one))
    assert made_before + made_after == {(0, a): 1 for a in all_windows(sent + 3, length)}


def test_stacked_windows_give_process_views_and_collate_takes_them_without_a_copy() -> None:
    buffer = windowed("fifo", length=5)
    for t in range(8):
        buffer.put(step(2, t))
    batch = buffer.get_batch(4, timeout=1)
    assert batch is not None
    samples, arrays = stacked(batch)  # type: ignore[arg-type]
    assert samples[1].fields["u"].shape == (5, SIDE, SIDE) and samples[1].time_step == 1
    assert samples[1].fields["u"][:, 0, 0].tolist() == [code(2, t) for t in range(1, 6)]
    inputs, targets = collate([(s.fields["u"][:4], s.fields["u"][4:]) for s in samples], arrays)
    assert np.shares_memory(inputs.numpy(), arrays[0]) and np.shares_memory(targets.numpy(), arrays[0])
    assert inputs.shape == (4, 4, SIDE, SIDE) and targets.shape == (4, 1, SIDE, SIDE)
    assert targets[:, 0, 0, 0].tolist() == [code(2, a + 4) for a in range(4)]
    assert inputs[3, :, 1, 1].tolist() == [code(2, t) for t in range(3, 7)]
    # a view of a sample's own memory is copied, as np.stack does
    own = collate([s.fields["u"] for s in samples])
    assert not np.shares_memory(own.numpy(), arrays[0])


def test_windows_of_held_out_steps_are_every_whole_window() -> None:
    steps = [step(9, t) for t in (4, 0, 1, 2, 3, 3, 6, 7, 8)] + [step(1, t) for t in range(3)]
    found = [(w.simulation_id, w.time_step) for w in windows_of(steps, 3, 1)]
    assert found == [(1, 0), (9, 0), (9, 1), (9, 2), (9, 6)]


def test_a_simulation_that_ends_shorter_than_a_window_is_named_and_its_steps_leave(
    caplog: pytest.LogCaptureFixture,
) -> None:
    buffer = windowed("fifo", length=4)
    for t in range(3):
        buffer.put(step(6, t))
    for t in range(5):
        buffer.put(step(7, t))
    with caplog.at_level("WARNING"):
        buffer.end_simulation(6)
        buffer.end_simulation(7)
    assert [r.getMessage() for r in caplog.records] == [
        "simulation 6: its steps 0 to 2 make no window of 4 steps (training.window): none is trained"
    ]
    assert buffer.held_steps == 5  # simulation 7's, spanned by its two windows


def test_outputs_that_view_the_same_steps_are_not_one_view_twice() -> None:
    """Teacher forcing (inputs ``u[:-1]``, targets ``u[1:]``): the targets are copied, so that an in-place change
    of the inputs cannot change them; the inputs stay a view."""
    buffer = windowed("fifo", length=4)
    for t in range(8):
        buffer.put(step(0, t))
    batch = buffer.get_batch(4, timeout=1)
    assert batch is not None
    samples, arrays = stacked(batch)  # type: ignore[arg-type]
    inputs, targets = collate([(s.fields["u"][:-1], s.fields["u"][1:]) for s in samples], arrays)
    assert np.shares_memory(inputs.numpy(), arrays[0]) and not np.shares_memory(targets.numpy(), arrays[0])
    before = targets.clone()
    inputs.mul_(0)
    assert torch.equal(targets, before)
    assert targets[:, :, 0, 0].tolist() == [[code(0, a + t) for t in (1, 2, 3)] for a in range(4)]


def test_a_step_put_as_its_simulation_ended_is_not_held() -> None:
    """A failed simulation's last step may be put while the news of its end is taken: it makes nothing."""
    buffer = windowed("fifo", length=3)
    buffer.put(step(4, 0))
    buffer.end_simulation(4)
    assert buffer.held_steps == 0
    buffer.put(step(4, 1))
    assert (buffer.held_steps, buffer.nbytes, len(buffer)) == (0, 0, 0)
