"""No simulation fails for a lost control message: delivery answers lost with their connection, in whole studies.

Each simulation runs behind ``delivery_relay.py``, which closes the connection
to a server rank's delivery service instead of passing on the first answer to a
blocked send's ping and the first answer to a finalize's ``wait`` question, then
drops the second answer to a ``wait`` question on a connection it keeps (as a
rank whose queue to the client is full does). Training is held until every
simulation has had its lost ping asked again and answered, so that every client
is blocked by back-pressure while its answer is lost; the clients must ask
again (on the new connection; after 1.5 keepalives of silence on the kept one),
and the study must end with every simulation done in one attempt and every
step received once.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from support import HERE, TOY_SIM, run_server, study_config, wait_until

pytestmark = pytest.mark.timeout(300)

SIMULATIONS, STEPS = 2, 24
VALUES = 1 << 18  # float32 values per step: 1 MiB, so that a few steps fill the queues and block the client
RELAY = [sys.executable, str(HERE / "delivery_relay.py"), "--lose", "ping=close", "--lose", "wait=close,swallow"]
LOSSES = {
    "ping": ["lost (its connection closed)"],
    "wait": ["lost (its connection closed)", "lost (its connection kept)"],
}


def relayed_config(output: Path, record: Path, command: list[str]) -> dict:
    """Two simulations at once of 24 1-MiB steps each, buffers of 2 samples, training held until ``record/go``
    exists; a client gives up on a server silent for 8 s (so a ping is asked every 2 s)."""
    return study_config(
        output,
        [*RELAY, "--record", str(record), "--", *command],
        study={"simulations": SIMULATIONS, "time_steps": STEPS},
        buffer={"kind": "fifo", "capacity_samples": 2, "per_server_watermark": 1},
        server={"receive_queue_bytes": 2 << 20},
        launcher={"job_limit": SIMULATIONS, "client_timeout": 8, "send_queue_bytes": 2 << 20},
        training={
            "module": str(HERE / "tiny_module.py"),
            "class_name": "Tiny",
            "options": {"hold_until": str(record / "go")},
            "batch_size": 2,
            "device": "cpu",
            "seed": 3,
        },
    )


def run_with_lost_answers(tmp_path: Path, command: list[str]) -> None:
    """Run the relayed study on 1 rank; release training once every simulation's lost ping was answered again."""
    record, output = tmp_path / "record", tmp_path / "output"
    record.mkdir()
    config = relayed_config(output, record, command)
    asked_again = [record / f"{simulation}.ping.answered" for simulation in range(SIMULATIONS)]

    answered_again: list[bool] = []

    def release() -> None:  # whatever happens: a client that gave up must not leave training held for ever
        answered_again.append(wait_until(lambda: all(path.exists() for path in asked_again), timeout=120))
        (record / "go").touch()

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    run = run_server(tmp_path, config, 1, 240)
    assert answered_again == [True], f"a lost ping was not asked again\n{run.log}"
    assert run.code == 0, run.log
    assert run.report is not None
    assert run.report["simulations"]["done"] == SIMULATIONS, run.report["simulations"]
    assert [s["attempts"] for s in run.report["per_simulation"]] == [1] * SIMULATIONS
    assert run.report["samples_received"] == SIMULATIONS * STEPS and run.report["duplicate_frames_dropped"] == 0
    for simulation in range(SIMULATIONS):
        log = (output / "simulations" / f"simulation{simulation}.attempt0.log").read_text()
        for kind, losses in LOSSES.items():
            said = [f"simulation {simulation}: a {kind} question's answer {words}" for words in losses]
            said.append(f"simulation {simulation}: a {kind} question's answer asked again and answered")
            where = [log.find(words) for words in said]
            assert -1 < where[0] and where == sorted(where), log


def test_a_python_client_asks_again_a_question_whose_answer_was_lost(tmp_path: Path) -> None:
    run_with_lost_answers(tmp_path, [sys.executable, TOY_SIM, "--steps", str(STEPS), "--shape", str(VALUES)])


def test_a_c_client_asks_again_a_question_whose_answer_was_lost(tmp_path: Path, native: Path) -> None:
    run_with_lost_answers(tmp_path, [str(native / "c_client"), "--steps", str(STEPS), "--count", str(VALUES)])
