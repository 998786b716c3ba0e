"""Ten thousand simulations, a thousand at once, on one node
(docs/explanation/performance.md#what-the-targets-are, issue 31).

Runs ``mpirun -n 2 melissa-server`` on a study of ``--simulations`` C clients
(``scale_client`` from ``make native``: one 8x8 float32 field, 5 steps, each
after a ``--pause`` that stands for the solver, so that ``--job-limit``
simulations are running at once), scheduler ``local``, FIFO buffer, a small
model trained on what arrives; then the same study with ``--small``
simulations, and one of ``--simulations`` shorter ones for the start rate.
Meanwhile it reads rank 0's resident memory and both ranks' CPU time from
``/proc`` and the study's done count from ``status.json``; after, the status
history (``progress.jsonl``) and the report. Prints:

- ``scale_starts_per_s``: simulations started per second, from the first
  status with one started to the first with all started (target >= 100), in
  a third study of ``--simulations`` whose simulations pause ``--rate-pause``
  seconds a step. With ``--job-limit`` simulations running at once, starts
  can be no faster than ``--job-limit`` over a simulation's life (Little's
  law): 1,024 over the 5 x 2 s of the large study is 102.4 a second, however
  fast the server, so that study measures the job limit, not the server. The
  shorter simulations leave the slots free, and starts wait only for the
  server and the two cores. The line also gives that study's most
  simulations running at once (``running_max``), and the large study's own
  rate beside its ceiling (``at_job_limit``, ``ceiling_at_job_limit``);
- ``scale_completed``: done / simulations of the large study (target 1.0, with
  0 failed and exit 0, both said on the line);
- ``scale_round_p99``: p99 of the interval between status lines while at least
  half of ``--job-limit`` were running, over ``server.status_interval``
  (target <= 2);
- ``scale_memory_per_simulation``: what rank 0 keeps per finished
  simulation, in bytes (target <= 2048): its least resident memory once
  every simulation is done (reception over, the connections' freed memory
  given back), large study minus small, over the difference in simulations.
  Like the CPU figure below, the difference leaves out what both studies pay
  alike, the start-up above all. The line also gives rank 1's figure and the
  slope of rank 0's resident memory against done simulations from 20% to 90%
  of the large study (``slope_20_to_90``): that slope follows the heaps'
  pages as they are touched for the first time (their size stays flat once
  ``--job-limit`` run), not what a simulation leaves;
- ``scale_cost_growth``: the ranks' CPU seconds per simulation in the large
  study over the same in the small one (target <= 1.2).

``--launcher-kill`` runs the large study under ``melissa-launcher`` instead,
kills rank 1 with SIGKILL once half the simulations are done, and prints
``scale_kill_completed``: done / simulations, with the report's samples
against simulations x 5 (every sample once).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from studies import ROOT, environment, mpirun

STEPS, SIDE = 5, 8
STATUS_INTERVAL = 1.0
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


def config(output: Path, simulations: int, job_limit: int, pause: float, client: Path) -> dict[str, Any]:
    return {
        "output_dir": str(output),
        "study": {
            "fields": ["field"],
            "parameters": [{"name": "a", "low": 0.0, "high": 1.0}],
            "simulations": simulations,
            "time_steps": STEPS,
            "seed": 1,
        },
        "server": {"status_interval": STATUS_INTERVAL},
        "buffer": {"kind": "fifo", "capacity_samples": 4096, "per_server_watermark": 32},
        "launcher": {
            "command": [str(client), str(STEPS), str(SIDE * SIDE), str(pause)],
            "scheduler": "local",
            "job_limit": job_limit,
            "simulation_timeout": 120,
            "max_retries": 2,
            "client_timeout": 60,
        },
        "training": {
            "module": str(Path(__file__).with_name("scale_module.py")),
            "class_name": "ScaleModel",
            "batch_size": 32,
            "nb_batches_update": 1000,
            "seed": 0,
        },
    }


@dataclass
class Watch:
    """What the bench reads of the server while it runs."""

    output: Path
    config: Path
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> pid
    cpu: dict[int, float] = field(default_factory=dict)  # rank -> CPU seconds at the last look
    memory: list[tuple[int, int]] = field(default_factory=list)  # (done, rank 0's resident bytes)
    other: list[tuple[int, int]] = field(default_factory=list)  # (done, rank 1's): no study, the same stream
    done: threading.Event = field(default_factory=threading.Event)

    def follow(self) -> None:
        while not self.done.wait(0.25):
            self._find_ranks()
            for rank, pid in list(self.ranks.items()):
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    self.cpu[rank] = (int(stat[11]) + int(stat[12])) / TICKS  # utime, stime
                    resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
                    done = json.loads((self.output / "status.json").read_text())["simulations"]["done"]
                    (self.memory if rank == 0 else self.other).append((done, resident))
                except (OSError, ValueError, KeyError):
                    pass  # not yet there, or gone: the last look stands

    def _find_ranks(self) -> None:
        """The server ranks: the processes running this config whose environment names their MPI rank."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in self.ranks.values():
                continue
            try:
                if str(self.config) not in (entry / "cmdline").read_text():
                    continue
                environ = dict(
                    item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item
                )
            except OSError:
                continue
            if "PMI_RANK" in environ and "mpirun" not in (entry / "cmdline").read_text().split("\0")[0]:
                self.ranks.setdefault(int(environ["PMI_RANK"]), int(entry.name))


@dataclass
class Study:
    code: int
    seconds: float
    report: dict[str, Any]
    history: list[dict[str, Any]]
    cpu_s: float
    memory: list[tuple[int, int]]
    other: list[tuple[int, int]]


def run(simulations: int, job_limit: int, pause: float, client: Path, kill_at: float | None = None) -> Study:
    with tempfile.TemporaryDirectory(prefix="melissa-scale-") as folder:
        output = Path(folder) / "output"
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config(output, simulations, job_limit, pause, client)))
        if kill_at is None:
            command = [mpirun(), "-n", "2", sys.executable, "-m", "melissa_dl", str(path)]
        else:
            command = [str(Path(sys.executable).with_name("melissa-launcher")), str(path), "--ranks", "2"]
        watch = Watch(output, path)
        follower = threading.Thread(target=watch.follow)
        follower.start()
        start = time.monotonic()
        server = subprocess.Popen(
            command, env=environment(), stdout=subprocess.DEVNULL, stderr=open(Path(folder) / "server.log", "w")
        )
        try:
            if kill_at is not None:
                kill_when_done(watch, kill_at * simulations)
            code = server.wait(timeout=3600)
        finally:
            server.kill()
            watch.done.set()
            follower.join()
        seconds = time.monotonic() - start
        if code != 0:
            print((Path(folder) / "server.log").read_text()[-3000:], file=sys.stderr)
        report = json.loads((output / "report.json").read_text()) if (output / "report.json").exists() else {}
        history = [json.loads(line) for line in (output / "progress.jsonl").read_text().splitlines()]
        return Study(code, seconds, report, history, sum(watch.cpu.values()), watch.memory, watch.other)


def kill_when_done(watch: Watch, done: float) -> None:
    """SIGKILL rank 1 once ``done`` simulations are done."""
    while not watch.memory or watch.memory[-1][0] < done or 1 not in watch.ranks:
        time.sleep(0.25)
    os.kill(watch.ranks[1], signal.SIGKILL)
    print(f"killed rank 1 (pid {watch.ranks[1]}) at {watch.memory[-1][0]} done", file=sys.stderr)


def starts_per_s(history: list[dict[str, Any]], simulations: int) -> float:
    started = [(h["elapsed_s"], simulations - h["simulations"]["queued"]) for h in history]
    first = next((t, n) for t, n in started if n > 0)
    last = next(((t, n) for t, n in started if n == simulations), started[-1])
    return (last[1] - first[1]) / max(last[0] - first[0], 1e-9)


def round_p99(history: list[dict[str, Any]], job_limit: int) -> tuple[float, int]:
    """p99 of the intervals between status lines while at least half of job_limit ran, and how many there were."""
    times = [
        h["elapsed_s"] for h in history if h["state"] == "running" and h["simulations"]["running"] >= job_limit / 2
    ]
    intervals = np.diff(times)
    return (float(np.quantile(intervals, 0.99)) if len(intervals) else float("nan")), len(intervals)


def memory_slope(memory: list[tuple[int, int]], simulations: int, start: float = 0.2, end: float = 0.9) -> float:
    points = np.array([(d, m) for d, m in memory if start * simulations <= d <= end * simulations], dtype=np.float64)
    return float(np.polyfit(points[:, 0], points[:, 1], 1)[0]) if len(points) > 2 else float("nan")


def resident_when_done(memory: list[tuple[int, int]], simulations: int) -> float:
    """The least resident memory seen once every simulation was done: after reception ended, the server gives
    the connections' freed memory back, and before the report and plots take some."""
    return min((float(m) for d, m in memory if d >= simulations and m > 0), default=float("nan"))  # 0: exiting


def kept_per_simulation(small: list[tuple[int, int]], large: list[tuple[int, int]], sizes: tuple[int, int]) -> float:
    """Resident bytes when all were done, large study minus small, per simulation more."""
    return (resident_when_done(large, sizes[1]) - resident_when_done(small, sizes[0])) / (sizes[1] - sizes[0])


def rss_at(memory: list[tuple[int, int]], simulations: int) -> list[str]:
    """Resident MB when 10%, 50% and all of the simulations were done."""
    return [
        f"{next((m for d, m in memory if d >= share * simulations), float('nan')) / 1e6:.0f}"
        for share in (0.1, 0.5, 1.0)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulations", type=int, default=10_000)
    parser.add_argument("--small", type=int, default=1_000)
    parser.add_argument("--job-limit", type=int, default=1024)
    parser.add_argument("--pause", type=float, default=2.0, help="seconds before each of the 5 steps")
    parser.add_argument(
        "--rate-pause", type=float, default=1.0, help="the same in the study that measures starts per second"
    )
    parser.add_argument("--native", type=Path, default=ROOT / "build" / "native" / "bin")
    parser.add_argument("--launcher-kill", action="store_true")
    args = parser.parse_args()
    client = args.native / "scale_client"
    if not client.exists():
        sys.exit(f"bench/scale.py: {client} is missing: run `make native` first")
    if args.launcher_kill:
        study = run(args.simulations, args.job_limit, args.pause, client, kill_at=0.5)
        sims = study.report["simulations"]
        print(
            f"RESULT scale_kill_completed ratio={sims['done'] / args.simulations:.4f} target=1.0 "
            f"failed={sims['failed']} exit={study.code} samples={study.report['samples_received']} "
            f"expected={args.simulations * STEPS} consumed={study.report['samples_consumed']} "
            f"duplicates_dropped={study.report['duplicate_frames_dropped']}"
        )
        return
    small = run(args.small, args.job_limit, args.pause, client)
    large = run(args.simulations, args.job_limit, args.pause, client)
    rate = run(args.simulations, args.job_limit, args.rate_pause, client)
    sims = large.report.get("simulations", {"done": 0, "failed": -1})
    p99, intervals = round_p99(large.history, args.job_limit)
    per_sim_small, per_sim_large = small.cpu_s / args.small, large.cpu_s / args.simulations
    rate_sims = rate.report.get("simulations", {"done": 0, "failed": -1})
    print(
        f"RESULT scale_starts_per_s ratio={starts_per_s(rate.history, args.simulations):.1f} target=100 "
        f"simulations={args.simulations} job_limit={args.job_limit} pause_s={args.rate_pause} "
        f"running_max={max(h['simulations']['running'] for h in rate.history)} done={rate_sims['done']} "
        f"failed={rate_sims['failed']} exit={rate.code} study_s={rate.seconds:.1f} "
        f"at_job_limit={starts_per_s(large.history, args.simulations):.1f} "
        f"ceiling_at_job_limit={args.job_limit / (STEPS * args.pause):.1f}"
    )
    print(
        f"RESULT scale_completed ratio={sims['done'] / args.simulations:.4f} target=1.0 failed={sims['failed']} "
        f"exit={large.code} samples={large.report.get('samples_received')} expected={args.simulations * STEPS} "
        f"study_s={large.seconds:.1f}"
    )
    print(
        f"RESULT scale_round_p99 ratio={p99 / STATUS_INTERVAL:.2f} target=2 p99_s={p99:.2f} "
        f"interval_s={STATUS_INTERVAL} intervals={intervals}"
    )
    sizes = (args.small, args.simulations)
    print(
        f"RESULT scale_memory_per_simulation ratio={kept_per_simulation(small.memory, large.memory, sizes):.0f} "
        f"target=2048 unit=bytes rank1={kept_per_simulation(small.other, large.other, sizes):.0f} "
        f"slope_20_to_90={memory_slope(large.memory, args.simulations):.0f} "
        f"rank0_rss_mb_at_10_50_100_percent={'/'.join(rss_at(large.memory, args.simulations))} "
        f"small_rank0_rss_mb_when_done={resident_when_done(small.memory, args.small) / 1e6:.0f}"
    )
    print(
        f"RESULT scale_cost_growth ratio={per_sim_large / per_sim_small:.2f} target=1.2 "
        f"cpu_ms_per_simulation_large={per_sim_large * 1e3:.1f} cpu_ms_per_simulation_small={per_sim_small * 1e3:.1f}"
    )


if __name__ == "__main__":
    main()
