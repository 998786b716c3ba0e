"""Buffers that keep processed samples as rows (``deterministic_process``): once per sample, same batches."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch

from melissa_dl.buffers.kinds import Buffer, make_buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.config.registry import BUFFERS
from melissa_dl.errors import ConfigError
from melissa_dl.train.dataset import END, StreamDataset, collate

pytestmark = pytest.mark.timeout(60)


def sample(i: int, sim: int = 0) -> Sample:
    return Sample(sim, i, np.full(2, float(i)), {"u": np.arange(3, dtype=np.float32) + i})


class Counted:
    """A deterministic ``process`` that counts its calls per sample."""

    def __init__(self) -> None:
        self.calls: Counter[int] = Counter()

    def __call__(self, s: Sample) -> dict[str, object]:
        self.calls[s.time_step] += 1
        return {"x": s.parameters.astype(np.float32), "y": (s.fields["u"] * 2, s.time_step)}


def buffer(kind: str, capacity: int | None = 8, pseudo_epochs: int = 1) -> Buffer:
    return make_buffer(
        kind, capacity_samples=capacity, capacity_bytes=None, watermark=0, seed=3, pseudo_epochs=pseudo_epochs
    )


@pytest.mark.parametrize("kind", tuple(BUFFERS))
def test_kept_rows_give_the_batches_that_processing_each_serving_gives(kind: str) -> None:
    process = Counted()
    kept, plain = buffer(kind, pseudo_epochs=2), buffer(kind, pseudo_epochs=2)  # same seed: same picks
    dataset = StreamDataset(kept, process, 3, deterministic=True)
    for i in range(8):
        kept.put(sample(i))
        plain.put(sample(i))
    for _ in range(2):  # 6 of the 8 samples: a FIFO serves each once
        served = plain.get_batch(3)
        expected = collate([process(s) for s in served])
        batch = dataset.next_batch()
        assert batch.ids.tolist() == [[s.simulation_id, s.time_step] for s in served]
        assert batch.data["x"].dtype == torch.float32 and batch.data["y"][0].dtype == torch.float32
        for got, want in zip(torch.utils._pytree.tree_leaves(batch.data), torch.utils._pytree.tree_leaves(expected)):
            torch.testing.assert_close(got, want)
    assert set(process.calls) == set(range(8))


@pytest.mark.parametrize("kind", ["firo", "reservoir"])
def test_process_runs_once_per_sample_however_often_it_is_served(kind: str) -> None:
    process = Counted()
    kept = buffer(kind, capacity=4, pseudo_epochs=5)
    dataset = StreamDataset(kept, process, 2, deterministic=True)
    for i in range(4):
        kept.put(sample(i))
    for _ in range(6):
        assert dataset.next_batch() is not None
    assert kept.total_served == 12 and process.calls == Counter(range(4))


def test_rows_are_reused_after_samples_leave_and_the_end_is_signalled() -> None:
    process = Counted()
    fifo = buffer("fifo", capacity=2)
    dataset = StreamDataset(fifo, process, 2, deterministic=True)
    for round_ in range(5):  # 10 samples through 2 rows
        fifo.put(sample(2 * round_))
        fifo.put(sample(2 * round_ + 1))
        batch = dataset.next_batch()
        assert batch.data["y"][1].tolist() == [2 * round_, 2 * round_ + 1]
        assert batch.ids.tolist() == [[0, 2 * round_], [0, 2 * round_ + 1]]
    assert fifo._rows is not None and fifo._rows._used == 2  # the storage never grew
    assert dataset.next_batch(timeout=0.01) is None
    fifo.close()
    assert dataset.next_batch() is END


def test_samples_held_or_restored_before_are_processed_when_rows_are_kept() -> None:
    process = Counted()
    old = buffer("reservoir")
    for i in range(3):
        old.put(sample(i))
    restored = buffer("reservoir")
    dataset = StreamDataset(restored, process, 3, deterministic=True)
    restored.put(sample(9))
    restored.load_state_dict(old.state_dict())
    restored.close()
    assert sorted(dataset.next_batch().data["y"][1].tolist()) == [0, 1, 2]
    assert process.calls == Counter({9: 1, 0: 1, 1: 1, 2: 1})


def test_a_sample_processing_to_another_shape_is_refused_by_name() -> None:
    kept = buffer("fifo")
    StreamDataset(kept, lambda s: s.fields["u"], 1, deterministic=True)
    kept.put(sample(0))
    with pytest.raises(ConfigError, match=r"simulation 4 step 1 gave \[\(\(5,\), torch.float32\)\]"):
        kept.put(Sample(4, 1, np.zeros(2), {"u": np.zeros(5, dtype=np.float32)}))
    assert len(kept) == 1


@pytest.mark.parametrize(
    "process",
    [lambda s: [s.parameters, s.fields["u"]], lambda s: s.fields["u"], lambda s: (s.fields["u"], (s.parameters,))],
    ids=["list", "bare", "nested"],
)
def test_batches_keep_the_structure_of_one_output_whatever_their_size(process: Callable[[Sample], object]) -> None:
    fifo = buffer("fifo", capacity=None)
    dataset = StreamDataset(fifo, process, 3, deterministic=True)
    for i in range(5):
        fifo.put(sample(i))
    fifo.close()
    for want in ([0, 1, 2], [3, 4]):  # the last batch is short: the index is rebuilt for it
        expected = collate([process(sample(i)) for i in want])
        batch = dataset.next_batch().data
        assert type(batch) is type(expected)
        for got, exp in zip(torch.utils._pytree.tree_leaves(batch), torch.utils._pytree.tree_leaves(expected)):
            torch.testing.assert_close(got, exp)
    assert dataset.next_batch() is END
