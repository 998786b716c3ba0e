"""Checkpoints and restarts of whole studies (docs/explanation/design.md#checkpoints): stop, crash, hang, corruption,
another K.

Every study here is paced (toy_sim ``--step-delay``) so that the server can
be interrupted in its middle, after its first checkpoint is committed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import zmq
from support import (
    HERE,
    SIMULATIONS,
    STEPS,
    TOY_SIM,
    clean_environment,
    committed,
    free_port,
    paced_config,
    run_server,
    server_command,
    signal_every_process,
    start,
    wait_for,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_active_sampling import drawn_in_checkpoint
from tiny_module import Tiny

from melissa_dl.checkpoint.serialization import loads
from melissa_dl.checkpoint.versions import latest_valid
from melissa_dl.ingest.ledger import Ledger
from melissa_dl.runtime.metrics import TRAIN_LOSS
from melissa_dl.runtime.status import EXIT_CONFIG, EXIT_STOPPED, STATUS

pytestmark = pytest.mark.timeout(240)


def stop_after_first_checkpoint(tmp_path: Path, config: dict, ranks: int) -> str:
    """Start a study, SIGTERM its mpirun once a checkpoint is committed; the log of the graceful stop."""
    process = start(server_command(tmp_path, config, ranks))
    wait_for(lambda: committed(Path(config["output_dir"])), process)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=60)
    assert process.returncode == EXIT_STOPPED, log
    assert "stopped on request" in log
    assert not (Path(config["output_dir"]) / "report.json").exists(), "the study should have been cut short"
    status = Path(config["output_dir"]) / STATUS  # written if a status interval had passed
    assert not status.exists() or json.loads(status.read_text())["state"] == "stopped"
    return log


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of a paced study on 2 ranks stopped after its first checkpoint, made once for the tests
    that damage a copy of it and resume (``resume_a_copy``)."""
    folder = tmp_path_factory.mktemp("stopped")
    stop_after_first_checkpoint(folder, paced_config(folder / "output"), ranks=2)
    return folder / "output"


def resume_a_copy(stopped: Path, output: Path) -> dict:
    """``stopped`` copied to ``output``; the config that resumes it there (the output folder is no key that a
    checkpoint fixes)."""
    shutil.copytree(stopped, output, symlinks=True)
    return paced_config(output)


def test_sigterm_before_training_ends_every_rank_with_75_even_one_inside_a_collective(
    tmp_path: Path, output: Path
) -> None:
    """Before training, SIGTERM ends the job at once with 75 (nothing to checkpoint: the same command resumes):
    rank 0, still building its held-out set, exits, while rank 1 waits for it inside a collective, where Python
    sees no signal. The job must end all the same."""
    marker = tmp_path / "stalled"
    config = paced_config(output)
    config["training"]["options"] = {"stall_rank": 0, "stall_marker": str(marker)}
    process = start(server_command(tmp_path, config, 2))
    wait_for(marker.exists, process)
    time.sleep(1)  # rank 1 reaches its collective
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=30)
    assert process.returncode == EXIT_STOPPED, log
    assert "signal 15: ending every rank (exit code 75)" in log and "Traceback" not in log


def final_ledgers(output: Path) -> list[Ledger]:
    version = latest_valid(output / "checkpoints")
    assert version is not None
    ledgers = []
    for rank in range(version.ranks):
        ledger = Ledger()
        ledger.load_state_dict(loads(version.read(rank, "stream.pt"))["ledger"])
        ledgers.append(ledger)
    return ledgers


def assert_every_step_once(output: Path, ranks: int) -> None:
    """The final checkpoint's ledgers hold each (simulation, step) of the study on exactly one rank."""
    ledgers = final_ledgers(output)
    assert len(ledgers) == ranks
    held = [{(s, t) for s in ledger.simulations() for t in ledger.steps(s)} for ledger in ledgers]
    assert sum(len(h) for h in held) == SIMULATIONS * STEPS
    assert set().union(*held) == {(s, t) for s in range(SIMULATIONS) for t in range(STEPS)}


def loss_steps(output: Path, rank: int = 0) -> list[int]:
    """The batches of the training loss points TensorBoard shows (after its purge of a dead run's extra points)."""
    events = EventAccumulator(str(output / "tensorboard" / f"rank{rank}"))
    events.Reload()
    return [event.step for event in events.Scalars(TRAIN_LOSS)]


def parameters(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_resuming_after_a_stop_gives_the_parameters_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """FIFO, one rank, one simulation at a time, fixed seeds: the sample order is fixed, so are the batches."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for folder in (straight, resumed):
        folder.mkdir()
    reference = run_server(straight, paced_config(straight / "output", job_limit=1), ranks=1)
    assert reference.code == 0, reference.log
    config = paced_config(resumed / "output", job_limit=1)
    stop_after_first_checkpoint(resumed, config, ranks=1)
    run = run_server(resumed, config, ranks=1)
    assert run.code == 0, run.log
    assert "resuming from checkpoint" in run.log
    assert run.report is not None and run.report["samples_received"] == SIMULATIONS * STEPS
    assert run.report["training"]["batches"] == reference.report["training"]["batches"] == SIMULATIONS * STEPS // 4
    expected, found = parameters(straight / "output" / "model.pt"), parameters(resumed / "output" / "model.pt")
    assert expected.keys() == found.keys()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=0, atol=0, msg=name)
    assert_every_step_once(resumed / "output", ranks=1)
    assert loss_steps(resumed / "output") == list(range(1, SIMULATIONS * STEPS // 4 + 1))


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path, output: Path) -> None:
    config = paced_config(output)
    config["launcher"]["command"].remove("--step-delay")  # no pause needed: the study runs to its end
    config["launcher"]["command"].remove("0.05")
    first = run_server(tmp_path, config, ranks=2)
    assert first.code == 0, first.log
    newest = latest_valid(output / "checkpoints")
    assert newest is not None and newest.number >= 2
    victim = newest.path / "rank1" / "stream.pt"
    victim.write_bytes(victim.read_bytes()[:-10])
    manifested = [int(m.parent.name[1:]) for m in (output / "checkpoints").glob("v*/manifest.json")]
    previous = max(n for n in manifested if n < newest.number)  # versions snapshot but never committed have none
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert f"checkpoint v{newest.number}: size mismatch of rank1/stream.pt" in run.log
    assert re.search(rf"resuming from checkpoint \S*v{previous} ", run.log), run.log
    assert_every_step_once(output, ranks=2)


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_restart_on_another_number_of_ranks_keeps_every_row_and_completes(
    tmp_path: Path, output: Path, before: int, after: int
) -> None:
    config = paced_config(output, class_name="Table")
    stop_after_first_checkpoint(tmp_path, config, ranks=before)
    version = latest_valid(output / "checkpoints")
    assert version is not None and version.ranks == before
    shards = [loads(version.read(rank, "trainer.pt"))["tables"]["table"] for rank in range(before)]
    rows = torch.cat([s["shard"] for s in sorted(shards, key=lambda s: s["extra"]["start"])])
    dense = loads(version.read(0, "dense.pt"))["module"]

    export = run_server(tmp_path, config, after, 120, "--export-model")
    assert export.code == 0, export.log
    model = parameters(output / "model.pt")
    torch.testing.assert_close(model["table.shard"], rows, rtol=0, atol=0)
    for name, tensor in dense.items():
        torch.testing.assert_close(model[name], tensor, rtol=0, atol=0, msg=name)

    run = run_server(tmp_path, config, ranks=after)
    assert run.code == 0, run.log
    assert f"written by {before} ranks" in run.log
    assert run.report is not None and run.report["simulations"]["done"] == SIMULATIONS
    assert_every_step_once(output, ranks=after)


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def assert_stopped_after_a_final_checkpoint(log: str, output: Path, sig: int = signal.SIGTERM) -> None:
    """Every rank stopped gracefully on ``sig``, and a checkpoint was committed after it; no rank ended at once,
    nothing printed a traceback."""
    assert "ending every rank" not in log and "Traceback" not in log, log
    rank0, said = (output / "logs" / "rank0.log").read_text(), f"signal {sig}: stopping after a checkpoint"
    signalled = rank0.index(said)
    assert re.search(r"checkpoint v\d+ committed", rank0[signalled:]), rank0
    assert "stopped on request" in rank0[signalled:]
    assert said in (output / "logs" / "rank1.log").read_text()


@pytest.mark.parametrize("times", [1, 2])
def test_sigterm_to_every_process_of_a_supervised_study_is_one_graceful_stop(
    tmp_path: Path, output: Path, times: int
) -> None:
    """As ``scancel`` or ``kill -TERM -PGID`` does: each rank gets its own SIGTERM, the one mpirun passes on and
    the one the supervisor passes on, all one stop (twice: the same again 100 ms later), and the simulations die of
    theirs. The supervised study exits 75 after a final checkpoint, and the same command resumes it to its end, every
    step once, no simulation counted as failed."""
    config = paced_config(output, server_timeout=60.0, max_server_restarts=2)
    supervise = [sys.executable, "-m", "melissa_dl.supervisor", server_command(tmp_path, config, 2)[-1], "-n", "2"]
    supervisor = start(supervise)
    wait_for(lambda: committed(output), supervisor)
    for time_ in range(times):
        time.sleep(0.1 * time_)
        signal_every_process(supervisor.pid, signal.SIGTERM)
    log, _ = supervisor.communicate(timeout=120)
    assert supervisor.returncode == EXIT_STOPPED, log
    assert "restarting" not in log
    assert_stopped_after_a_final_checkpoint(log, output)
    assert not (output / "report.json").exists()
    done = subprocess.run(supervise, env=clean_environment(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming from checkpoint" in (output / "logs" / "rank0.log").read_text()
    report = json.loads((output / "report.json").read_text())
    assert report["simulations"]["done"] == SIMULATIONS and report["samples_received"] == SIMULATIONS * STEPS
    assert report["simulations"]["failed"] == 0  # the stop failed none; those it interrupted say so (issue 57)
    relaunched = [s for s in report["per_simulation"] if s["reason"]]
    assert relaunched and all(
        s["reason"] == f"relaunched: the server's run ended while attempt {s['attempts'] - 2} ran (a crash, a kill or "
        "a stop)"
        for s in relaunched
    ), relaunched
    assert_every_step_once(output, ranks=2)


@pytest.mark.parametrize("after", [2, 1])
def test_a_stop_while_one_rank_holds_a_batch_the_other_cannot_match_keeps_it_in_the_checkpoint(
    tmp_path: Path, output: Path, after: int
) -> None:
    """Simulation 0 sends its 6 steps to rank 0, which forms a batch of 4; simulation 1, rank 1's, waits for a file,
    so rank 1 has none and no more data comes. SIGTERM stops the run at once with a checkpoint whose rank 0 keeps
    that batch; the resumed run (on ``after`` ranks) trains it: every sample of the study trained once, none
    twice."""
    config = paced_config(output)
    config["study"].update(simulations=2, time_steps=6)
    config["server"]["bind_simulation_to_server_rank"] = True
    go = tmp_path / "go"
    config["launcher"]["command"] = [sys.executable, TOY_SIM, "--steps", "6", "--go", str(go), "--go-now", "0"]
    config["checkpoint"] = {"interval": 0}
    process = start(server_command(tmp_path, config, 2))
    rank0 = output / "logs" / "rank0.log"
    wait_for(lambda: rank0.exists() and "simulation 0 done" in rank0.read_text(), process)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=60)
    assert process.returncode == EXIT_STOPPED, log
    assert_stopped_after_a_final_checkpoint(log, output)
    assert "rank 0 keeps a batch of 4 samples for the resumed run to train first" in log
    version = latest_valid(output / "checkpoints")
    assert version is not None and version.manifest["batch"] == 0
    held = loads(version.read(0, "stream.pt"))["buffer"]["held"]
    assert [batch.ids.tolist() for batch in held] == [[[0, 0], [0, 1], [0, 2], [0, 3]]]
    assert loads(version.read(1, "stream.pt"))["buffer"]["held"] == []
    go.touch()
    run = run_server(tmp_path, config, ranks=after)
    assert run.code == 0 and run.report is not None, run.log
    assert "resuming from checkpoint" in run.log
    assert run.report["simulations"]["done"] == 2 and run.report["samples_received"] == 12
    assert run.report["samples_consumed"] == 12, run.log


@pytest.mark.parametrize("failure", ["kill -9 rank 1", "rank 1 hangs"])
def test_the_supervisor_restarts_a_dead_or_hung_server_and_the_study_completes(
    tmp_path: Path, output: Path, failure: str
) -> None:
    # server_timeout: how long a hang goes unseen (a (re)start has 300 s to its first beat: seconds on an idle
    # machine, several times that on a busy one)
    config = paced_config(output, server_timeout=20.0, max_server_restarts=2)
    command = server_command(tmp_path, config, 2)
    supervisor = start([sys.executable, "-m", "melissa_dl.supervisor", command[-1], "-n", "2"])
    wait_for(lambda: committed(output), supervisor)
    pid = int(re.search(r"server rank 1 of 2, pid (\d+)", (output / "logs" / "rank1.log").read_text()).group(1))
    os.kill(pid, signal.SIGKILL if failure.startswith("kill") else signal.SIGSTOP)
    log, _ = supervisor.communicate(timeout=180)
    assert supervisor.returncode == 0, log
    assert "restarting it from its checkpoints (restart 1 of 2)" in log
    if failure == "rank 1 hangs":
        assert "no heartbeat from the server" in log
    assert "resuming from checkpoint" in (output / "logs" / "rank0.log").read_text()
    report = json.loads((output / "report.json").read_text())
    assert report["simulations"]["done"] == SIMULATIONS and report["samples_received"] == SIMULATIONS * STEPS
    assert_every_step_once(output, ranks=2)
    steps = loss_steps(output)  # the dead run's points after its checkpoint were replaced, not doubled
    assert steps == list(range(1, report["training"]["batches"] + 1))
    Tiny().load_state_dict(parameters(output / "model.pt"))  # the final model loads, from model.pt
    final = latest_valid(output / "checkpoints")  # and from the final checkpoint
    assert final is not None and final.manifest["batch"] == report["training"]["batches"]
    Tiny().load_state_dict(loads(final.read(0, "dense.pt"))["module"])
    assert processes_mentioning(str(tmp_path)) == [], "a process of the study outlived the supervisor"


def test_a_server_that_fails_the_same_way_after_a_restart_is_reported_once_with_its_cause(
    tmp_path: Path, output: Path
) -> None:
    """The user's ``training_step`` raises at the first batch of every run: the supervisor restarts the server
    once (a failure may be transient), then gives up in one line naming the error and the line that raised it,
    instead of restarting it into the same error up to ``max_server_restarts``."""
    config = paced_config(output, max_server_restarts=3)
    config["training"]["options"] = {"fail_rank": 0, "fail_after": 0}
    supervisor = [sys.executable, "-m", "melissa_dl.supervisor", server_command(tmp_path, config, 1)[-1]]
    done = subprocess.run(supervisor, env=clean_environment(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 1, done.stderr
    launcher = [line for line in done.stderr.splitlines() if " melissa-launcher " in line]
    assert len(launcher) == 2, done.stderr
    assert launcher[0].endswith("server died (exit code 1); restarting it from its checkpoints (restart 1 of 3)")
    assert re.search(
        r" melissa-launcher ERROR server failed again \(exit code 1\) with the error of the run before, not "
        r"restarting it: ValueError: boom from the user's training_step \(\S+/tiny_module\.py:\d+, in "
        r"training_step\)\. Fix its cause, then run the same command to resume, or add --fresh to start over "
        rf"\(tracebacks in {re.escape(str(output / 'logs'))}\)$",
        launcher[1],
    ), launcher[1]
    assert (output / "logs" / "rank0.log").read_text().count("fatal error, aborting the MPI job") == 2


SAMPLERS = {
    "uniform": {},
    "sobol": {},
    "halton": {},
    "lhs": {},
    "list": {"parameter_values": [[0.25, 0.5], [0.75, 0.5]]},
    "adaptive": {},
    "custom": {"custom_sampler": {"module": str(HERE / "custom_sampler.py"), "class_name": "Diagonal"}},
}
HELD_OUT = 4  # run first, one at a time: the study draws its own simulations only when the third one ends


def newest_version(output: Path) -> int:
    version = latest_valid(output / "checkpoints")
    return 0 if version is None else version.number


@pytest.mark.parametrize("kind", SAMPLERS)
def test_every_sampler_resumes_from_checkpoints_taken_before_its_first_draw(
    tmp_path: Path, output: Path, kind: str
) -> None:
    """2 simulations of the study's own and 4 held-out ones, which run first, one at a time, each once its file
    ``go<id>`` exists. Killed -9 once the first held-out simulation's end is committed; resumed, and stopped with
    SIGTERM once the second's is; resumed to the end. Both stops leave a checkpoint whose sampler has drawn
    nothing (Sobol's restore at 0 once failed every resume), and the study completes, every step once."""
    own = SIMULATIONS - HELD_OUT
    config = paced_config(output)
    config["study"].update(simulations=own, sampler=kind, validation={"simulations": HELD_OUT}, **SAMPLERS[kind])
    config["launcher"].update(job_limit=1, command=[sys.executable, TOY_SIM, "--steps", str(STEPS)])
    config["launcher"]["command"] += ["--go", str(tmp_path / "go{simulation}")]
    config["training"]["class_name"] = "Hardness"  # a loss per sample, as the adaptive sampler learns from
    config["checkpoint"] = {"interval": 0, "seconds": 0}  # a snapshot at each simulation's end
    (tmp_path / f"go{own}").touch()
    process = start(server_command(tmp_path, config, 1))
    wait_for(lambda: committed(output), process)
    for pid in processes_mentioning(str(tmp_path)):  # mpirun, the rank, the waiting held-out simulation
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=30)
    assert process.returncode != 0
    assert drawn_in_checkpoint(output) == 0
    first = newest_version(output)
    process = start(server_command(tmp_path, config, 1))
    (tmp_path / f"go{own + 1}").touch()
    wait_for(lambda: newest_version(output) > first, process)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=60)
    assert process.returncode == EXIT_STOPPED, log
    assert "resuming from checkpoint" in log and drawn_in_checkpoint(output) == 0
    for simulation in range(SIMULATIONS):
        (tmp_path / f"go{simulation}").touch()
    run = run_server(tmp_path, config, 1)
    assert run.code == 0 and run.report is not None, run.log
    assert run.report["simulations"]["done"] == SIMULATIONS
    assert run.report["held_out"] == {"simulations": HELD_OUT, "samples": HELD_OUT * STEPS}
    assert run.report["samples_received"] == SIMULATIONS * STEPS == run.report["samples_expected"]
    assert_every_step_once(output, ranks=1)


def test_a_simulation_done_just_before_a_kill_9_is_not_run_again(tmp_path: Path, output: Path) -> None:
    """No batch-counted checkpoints (interval 0): the first commit is the snapshot that records simulation 0's
    end, taken while no rank holds a batch (the other simulations wait for a file). The server is killed -9 as
    soon as it is committed."""
    go = tmp_path / "go"
    config = paced_config(output)
    config["launcher"]["command"] += ["--go", str(go), "--go-now", "0"]
    config["checkpoint"] = {"interval": 0, "seconds": 0}
    process = start(server_command(tmp_path, config, 2))
    wait_for(lambda: committed(output), process)
    assert "simulation 0 done" in (output / "logs" / "rank0.log").read_text()
    for pid in processes_mentioning(str(tmp_path)):  # mpirun, both ranks, the waiting simulations
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=30)
    assert process.returncode != 0
    go.touch()
    run = run_server(tmp_path, config, 2)
    assert run.code == 0 and run.report is not None, run.log
    assert "resuming from checkpoint" in (output / "logs" / "rank0.log").read_text()
    first = run.report["per_simulation"][0]
    assert (first["state"], first["attempts"], first["samples"]) == ("done", 1, STEPS)
    assert not (output / "simulations" / "simulation0.attempt1.log").exists()
    assert run.report["simulations"]["done"] == SIMULATIONS and run.report["samples_received"] == SIMULATIONS * STEPS
    assert_every_step_once(output, ranks=2)


def test_the_heartbeat_goes_on_while_the_buffers_drain_after_the_study(tmp_path: Path, output: Path) -> None:
    """Simulations done in a second, training of their 72 samples (18 batches of 2.5 s) ~45 s: longer than
    server_timeout, which must also exceed the server's start-up before its first beat (2.5-3 s on an idle 2-core
    Xeon; in a fresh clone's make test, under the suite's load, twice more than 12 s)."""
    config = paced_config(output, server_timeout=30.0, max_server_restarts=1)
    config["launcher"]["command"] = [sys.executable, TOY_SIM, "--steps", str(STEPS)]
    config["training"]["options"] = {"step_delay": 2.5}
    command = server_command(tmp_path, config, 1)
    done = subprocess.run(
        [sys.executable, "-m", "melissa_dl.supervisor", command[-1]],
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no heartbeat" not in done.stderr and "restarting" not in done.stderr
    rank0 = (output / "logs" / "rank0.log").read_text()
    assert rank0[rank0.index("simulation 5 done") :].count(" committed ") >= 2  # during the drain, and the last


def test_refusals_counted_before_a_restart_are_in_the_final_report(tmp_path: Path, output: Path) -> None:
    port = free_port()
    config = paced_config(output)
    config["server"]["handshake_port"] = port
    process = start(server_command(tmp_path, config, 2))
    wait_for(lambda: committed(output), process)
    intruder = zmq.Context.instance().socket(zmq.REQ)
    intruder.plain_username, intruder.plain_password = b"melissa", b"not the study's token"
    intruder.connect(f"tcp://127.0.0.1:{port}")
    intruder.send(b"hello")
    wait_for(lambda: "refused (handshake_auth)" in (output / "logs" / "rank0.log").read_text(), process)
    intruder.close(linger=0)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=60)
    assert process.returncode == EXIT_STOPPED, log
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert "resuming from checkpoint" in run.log and "refused (handshake_auth)" not in run.log
    assert run.report is not None and run.report["rejected"].get("handshake_auth", 0) >= 1, run.report["rejected"]


def test_a_changed_training_module_is_refused_on_resume(tmp_path: Path, output: Path) -> None:
    """Two changes in turn, each refused: a comment and a layer's size (the checkpoint holds the file's digest)."""
    module = tmp_path / "tiny_module.py"
    source = (HERE / "tiny_module.py").read_text()
    module.write_text(source)
    config = paced_config(output)
    config["training"]["module"] = str(module)
    stop_after_first_checkpoint(tmp_path, config, ranks=2)
    layers = "nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 32)"
    for changed in ("# a comment\n" + source, source.replace(layers, layers.replace("hidden", "hidden + 8"))):
        assert changed != source
        module.write_text(changed)
        run = run_server(tmp_path, config, ranks=2)
        assert run.code == EXIT_CONFIG, run.log
        assert "training.module:" in run.log and "changed since checkpoint" in run.log and "--fresh" in run.log
        assert "Traceback" not in run.log
        assert not (output / "model.pt").exists() and not (output / "report.json").exists()
    module.write_text(source)  # put back, it resumes
    assert run_server(tmp_path, config, ranks=2).code == 0


def test_a_finished_study_run_again_says_so_and_changes_nothing(tmp_path: Path, output: Path) -> None:
    config = paced_config(output)
    first = run_server(tmp_path, config, ranks=2)
    assert first.code == 0, first.log
    results = [output / "model.pt", output / "report.json"]
    before = [(path.read_bytes(), path.stat().st_mtime_ns) for path in results]
    again = run_server(tmp_path, config, ranks=2)
    assert again.code == 0, again.log
    assert "is complete (checkpoint" in again.log and "nothing to do" in again.log
    assert [(path.read_bytes(), path.stat().st_mtime_ns) for path in results] == before
    assert "resuming from checkpoint" in again.log and "simulation 0 attempt" not in again.log  # nothing launched

    # the end was cut short after the last checkpoint (a full disk while writing the report): the report is written
    results[1].unlink()
    (output / ".report.json.tmp").write_text('{"half": ')
    completed = run_server(tmp_path, config, ranks=2)
    assert completed.code == 0, completed.log
    assert "nothing to do" not in completed.log and "simulation 0 attempt" not in completed.log
    report = json.loads(results[1].read_text())
    assert (report["simulations"], report["samples_received"]) == (
        {"queued": 0, "running": 0, "done": SIMULATIONS, "failed": 0},
        SIMULATIONS * STEPS,
    )
    assert list(output.glob(".*.tmp")) == []


def rename_a_path_key(checkpoints: Path, newest: int) -> None:
    manifest = json.loads((checkpoints / f"v{newest}" / "manifest.json").read_text())
    manifest["files"][0]["file"] = manifest["files"][0].pop("path")
    (checkpoints / f"v{newest}" / "manifest.json").write_text(json.dumps(manifest))


def edit_the_ranks(checkpoints: Path, newest: int) -> None:
    manifest = json.loads((checkpoints / f"v{newest}" / "manifest.json").read_text())
    manifest["ranks"] = 3
    (checkpoints / f"v{newest}" / "manifest.json").write_text(json.dumps(manifest))


def make_latest_a_directory(checkpoints: Path, newest: int) -> None:
    (checkpoints / "LATEST").unlink()
    (checkpoints / "LATEST").mkdir()


@pytest.mark.parametrize(
    ("damage", "warning"),
    [
        (rename_a_path_key, "manifest checksum mismatch"),
        (edit_the_ranks, "manifest checksum mismatch"),
        (make_latest_a_directory, "is unreadable; trying every version"),
    ],
)
def test_a_damaged_manifest_or_pointer_falls_back_to_the_newest_intact_version(
    tmp_path: Path, output: Path, stopped: Path, damage: Callable[[Path, int], None], warning: str
) -> None:
    config = resume_a_copy(stopped, output)
    versions = sorted(int(p.name[1:]) for p in (output / "checkpoints").glob("v*"))
    assert len(versions) >= 2, versions  # the first checkpoint and the one written on the stop
    damage(output / "checkpoints", versions[-1])
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert "Traceback" not in run.log and warning in run.log
    resumed = versions[-1] if damage is make_latest_a_directory else versions[-2]
    assert re.search(rf"resuming from checkpoint \S*v{resumed} ", run.log), run.log
    assert run.report is not None and run.report["simulations"]["done"] == SIMULATIONS
    assert_every_step_once(output, ranks=2)


def test_with_every_version_damaged_and_no_pointer_the_server_refuses_to_start_over(
    tmp_path: Path, output: Path, stopped: Path
) -> None:
    config = resume_a_copy(stopped, output)
    checkpoints = output / "checkpoints"
    (checkpoints / "LATEST").unlink()
    for stream in checkpoints.glob("v*/rank1/stream.pt"):
        stream.write_bytes(stream.read_bytes()[:-1])
    before = sorted(str(p.relative_to(output)) for p in output.rglob("*") if "tensorboard" not in p.parts)
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == EXIT_CONFIG, run.log
    assert f"no checkpoint in {checkpoints} is intact" in run.log and "--fresh" in run.log
    assert "simulation 0 attempt" not in run.log and "Traceback" not in run.log
    assert sorted(str(p.relative_to(output)) for p in output.rglob("*") if "tensorboard" not in p.parts) == before


def test_an_output_folder_that_fills_up_ends_the_job_in_one_line_without_restarts(tmp_path: Path, output: Path) -> None:
    """A file-size limit on rank 0, set once it runs (MPI's start needs large shared-memory files), stands for a
    full disk: the first checkpoint's dense.pt (~13 MB) cannot be written.

    Exit 2 (the supervisor does not restart on it), one line naming the file
    and the errno, no temporary file left; once there is room, the same
    command runs the study to its end with every step once.
    """
    import resource

    config = paced_config(output, max_server_restarts=2)
    config["training"]["options"] = {"hidden": 30_000}
    supervisor = [sys.executable, "-m", "melissa_dl.supervisor", server_command(tmp_path, config, 2)[-1], "-n", "2"]
    process = start(supervisor)
    log = output / "logs" / "rank0.log"
    wait_for(lambda: log.exists() and "server rank 0 of 2, pid" in log.read_text(), process)
    pid = int(re.search(r"server rank 0 of 2, pid (\d+)", log.read_text()).group(1))
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
    assert not committed(output), "the limit came too late"
    stdout, _ = process.communicate(timeout=180)
    assert process.returncode == EXIT_CONFIG, stdout
    failures = [line for line in stdout.splitlines() if "CRITICAL" in line]
    assert len(failures) == 1, stdout
    assert re.search(
        r"cannot write \S+/checkpoints/v1/rank0/dense\.pt: EFBIG \(File too large\); free space or fix "
        r"the output folder, then run the same command to resume$",
        failures[0],
    ), failures[0]
    assert "Traceback" not in stdout and "restarting" not in stdout
    assert [str(p) for p in output.rglob("*.tmp")] == []
    assert not committed(output)

    again = subprocess.run(supervisor, env=clean_environment(), capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    report = json.loads((output / "report.json").read_text())
    assert report["simulations"]["done"] == SIMULATIONS and report["samples_received"] == SIMULATIONS * STEPS
    assert_every_step_once(output, ranks=2)
