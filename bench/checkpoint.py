"""Checkpoint write speed and training stall
(docs/explanation/performance.md#what-the-targets-are, row "checkpoint write").

Two figures, each against a baseline measured in the same run (median of ``--repeat``):

* write: a ``--mib`` MiB state (a few float32 tensors plus a buffer-like list
  of numpy arrays, serialised once with ``serialization.dumps``) written as one
  checkpoint version of one rank (``write_rank_files`` + ``commit``: temp
  files, CRC-32, fsyncs, renames, manifest, ``LATEST``) against a plain
  sequential write + fsync of the same bytes into the same number of files.
  Serialisation time is printed apart. ratio = baseline time / checkpoint time.
* stall: a training-like loop (``--steps`` matrix multiplies) that submits one
  checkpoint to ``BackgroundWriter`` at a quarter of the loop (the in-memory
  snapshot is copied while the next step computes, see ``Loop``) and waits for
  it at the end, against the same loop without a checkpoint. stall = the
  difference, or the time the loop spent on the snapshot if that is larger
  (noise); ratio = stall / time of the same save done blocking (copy + dumps
  + write).
  The loop uses ``--threads`` torch threads, by default one core fewer than
  the machine, as a server leaves room for its receiver and writer threads.

The scratch folder is on the disk of the project (``bench/.tmp``) and removed at the end.

    python bench/checkpoint.py [--mib 256] [--steps 200] [--size 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from melissa_dl.checkpoint.serialization import dumps
from melissa_dl.checkpoint.snapshots import BackgroundCopy, BackgroundWriter, copy_to_cpu
from melissa_dl.checkpoint.versions import commit, version_dir, write_rank_files


def make_state(mib: int) -> tuple[dict[str, torch.Tensor], list[np.ndarray]]:
    """5/8 of the bytes in four tensors (model and optimizer), 3/8 in 1 MiB numpy samples (buffer)."""
    generator = torch.Generator().manual_seed(0)
    tensor_elems = (mib * 5 // 8 << 20) // 4 // 4
    tensors = {f"layer{i}": torch.randn(tensor_elems, generator=generator) for i in range(4)}
    rng = np.random.default_rng(0)
    buffer = [rng.random(1 << 18, dtype=np.float32) for _ in range(mib - mib * 5 // 8)]
    return tensors, buffer


def serialise(tensors: dict[str, torch.Tensor], buffer: list[np.ndarray]) -> dict[str, list[memoryview]]:
    return {"model.pt": dumps(tensors), "buffer.pkl": dumps(buffer)}


def size(chunks: list[memoryview]) -> int:
    return sum(chunk.nbytes for chunk in chunks)


def save_version(root: Path, number: int, files: dict[str, list[memoryview]]) -> None:
    records = write_rank_files(version_dir(root, number), 0, files)
    commit(root, number, [records], {"bench": True}, batch=number, config_digest="bench", keep=1000)


def plain_write(folder: Path, files: dict[str, list[memoryview]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, chunks in files.items():
        with open(folder / name, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())


def timed(function: Callable[[], Any]) -> float:
    os.sync()  # earlier deletions and writes are not billed to this one
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def bench_write(scratch: Path, files: dict[str, list[memoryview]], repeat: int) -> tuple[float, float]:
    ours, base = [], []
    for r in range(repeat):  # interleaved, so drifts hit both sides
        root = scratch / f"store{r}"
        ours.append(timed(lambda: save_version(root, 1, files)))
        shutil.rmtree(root)
        base.append(timed(lambda: plain_write(scratch / f"plain{r}", files)))
        shutil.rmtree(scratch / f"plain{r}")
    return statistics.median(ours), statistics.median(base)


class Loop:
    """Matrix multiplies standing in for training steps, with an optional checkpoint on the way.

    As in the server (``Trainer.state_dict``/``step``): the tensors are copied by a
    ``BackgroundCopy`` while the next step computes, and that step waits for
    the copy before its "optimizer update"; the buffer-like list is copied at
    once (samples are immutable). ``snapshot_time`` is what the loop spent on
    the snapshot: starting the copy plus waiting for it. As from a server's
    second checkpoint on, the copy reuses the memory of the last written one
    (``arena``), for the blocking save too.
    """

    def __init__(self, size: int, steps: int, tensors: dict[str, torch.Tensor], buffer: list[np.ndarray]) -> None:
        self.x = torch.randn(size, size, generator=torch.Generator().manual_seed(1))
        self.w = torch.randn(size, size, generator=torch.Generator().manual_seed(2)) / size**0.5
        self.steps, self.tensors, self.buffer = steps, tensors, buffer
        self.snapshot_time = 0.0
        self.arena: Any = None

    def save(self, root: Path, copied: dict[str, torch.Tensor], buffer: list[np.ndarray]) -> None:
        save_version(root, 1, serialise(copied, buffer))
        self.arena = copied

    def run(self, root: Path | None = None, writer: BackgroundWriter | None = None) -> float:
        os.sync()
        copy = None
        start = time.perf_counter()
        for step in range(self.steps):
            torch.tanh(self.x @ self.w)  # not chained: repeated tanh drifts into denormals, which are slow
            if copy is not None:  # this step's update would change the tensors
                begin = time.perf_counter()
                copy.wait()
                self.snapshot_time += time.perf_counter() - begin
                copy = None
            if root is not None and writer is not None and step == self.steps // 4:
                begin = time.perf_counter()
                copy, buffer = BackgroundCopy(self.tensors, self.arena), list(self.buffer)
                self.arena = None
                writer.submit(lambda copy=copy: self.save(root, copy.wait(), buffer))
                self.snapshot_time = time.perf_counter() - begin
        if writer is not None:
            writer.wait()
        return time.perf_counter() - start

    def blocking_save(self, root: Path) -> float:
        arena, self.arena = self.arena, None
        return timed(lambda: self.save(root, copy_to_cpu(self.tensors, arena), list(self.buffer)))


def bench_stall(scratch: Path, loop: Loop, repeat: int) -> tuple[float, float, float, float]:
    plain, background, blocking, snapshots = [], [], [], []
    with BackgroundWriter() as writer:
        loop.run(scratch / "warm", writer)  # warm up, and the steady state: a snapshot's memory to reuse
        shutil.rmtree(scratch / "warm")
        for r in range(repeat):
            plain.append(loop.run())
            root = scratch / f"bg{r}"
            background.append(loop.run(root, writer))
            snapshots.append(loop.snapshot_time)
            shutil.rmtree(root)
            blocking.append(loop.blocking_save(scratch / f"block{r}"))
            shutil.rmtree(scratch / f"block{r}")
    return (
        statistics.median(plain),
        statistics.median(background),
        statistics.median(blocking),
        statistics.median(snapshots),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) - 1),
        help="torch threads of the loop (default: leave one core to the I/O threads)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    (Path(__file__).parent / ".tmp").mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=Path(__file__).parent / ".tmp"))
    try:
        tensors, buffer = make_state(args.mib)
        serialise(tensors, buffer)  # warm up
        start = time.perf_counter()
        files = serialise(tensors, buffer)
        dumps_time = time.perf_counter() - start
        nbytes = sum(size(chunks) for chunks in files.values())
        ours, base = bench_write(scratch, files, args.repeat)
        mb = nbytes / 1e6
        print(f"state {mb:.0f} MB in {len(files)} files; dumps {dumps_time:.3f} s ({mb / dumps_time:.0f} MB/s)")
        print(
            f"checkpoint version {ours:.3f} s ({mb / ours:.0f} MB/s), plain write+fsync {base:.3f} s "
            f"({mb / base:.0f} MB/s); with dumps the checkpoint is {base / (ours + dumps_time):.2f} of the baseline"
        )
        loop = Loop(args.size, args.steps, tensors, buffer)
        plain, background, blocking, snapshot = bench_stall(scratch, loop, args.repeat)
        stall = max(background - plain, snapshot)  # the snapshot is on the loop even when noise hides it
        print(
            f"loop {plain:.3f} s, with a background checkpoint {background:.3f} s (snapshot {snapshot * 1e3:.0f} ms "
            f"on the loop), blocking save {blocking:.3f} s, torch threads {torch.get_num_threads()}, "
            f"cpus {os.cpu_count()}"
        )
        print(
            f"RESULT checkpoint_write ratio={base / ours:.2f} target=0.7 checkpoint_mb_per_s={mb / ours:.0f} "
            f"baseline_mb_per_s={mb / base:.0f}"
        )
        print(
            f"RESULT checkpoint_stall ratio={stall / blocking:.3f} target=0.1 stall_s={stall:.3f} "
            f"snapshot_s={snapshot:.3f} blocking_save_s={blocking:.3f} loop_s={plain:.3f}"
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            (Path(__file__).parent / ".tmp").rmdir()
        except OSError:
            pass


if __name__ == "__main__":
    main()
