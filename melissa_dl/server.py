"""``melissa-server config.json``: one rank of the online-learning server, in phases.

Run as ``mpirun -n K melissa-server config.json``. Every rank binds a data
socket and receives into its buffer in a thread; the main thread trains on the
buffer (or only drains it) in lockstep with the other ranks (``loop.py``)
and, every ``control_interval`` seconds, joins the bookkeeping round: each
rank reports what it received, rank 0 advances the study (handshakes,
launches, relaunches) and broadcasts whether it is over, which ends
reception. MPI is called from the main thread only. This module builds the
parts, restores them, and reports.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from launcher import Launcher, Sampler
from melissa_dl.buffers.kinds import Buffer
from melissa_dl.buffers.windows import Windowing
from melissa_dl.checkpoint.manager import CheckpointManager
from melissa_dl.checkpoint.recovery import (
    DENSE,
    STREAM,
    STUDY,
    TRAINER,
    Group,
    Part,
)
from melissa_dl.checkpoint.versions import Version
from melissa_dl.config.registry import SCHEDULERS, load
from melissa_dl.config.sections import Config
from melissa_dl.errors import ConfigError
from melissa_dl.ingest.assembly import StreamSpec
from melissa_dl.ingest.connections import raise_open_file_limit
from melissa_dl.ingest.handshake import HandshakeServer
from melissa_dl.ingest.receiver import Receiver
from melissa_dl.runtime.files import remove_temporaries, write_atomic
from melissa_dl.runtime.logs import setup_logging
from melissa_dl.runtime.metrics import Metrics
from melissa_dl.runtime.mpi import (
    Comm,
    GracefulStop,
    end_every_rank,
    first_of_launch,
    ignore_stops,
    install_abort_on_error,
    launch_problem,
)
from melissa_dl.runtime.network import addresses
from melissa_dl.runtime.status import EXIT_CONFIG, EXIT_FAILED_SIMULATIONS, EXIT_STOPPED, HEARTBEAT, lock_output
from melissa_dl.serving.online import PredictionServer, check_servable, clients_guide
from melissa_dl.serving.saved import save
from melissa_dl.study.jobs import launcher_from_config
from melissa_dl.study.progress import StatusBoard, after_data, earlier_runs_seconds
from melissa_dl.study.report import final_report, write_report
from melissa_dl.study.sampling import sampler_from_config
from melissa_dl.study.study import Study, simulation_environment
from melissa_dl.train.dataset import StreamDataset
from melissa_dl.train.loop import Bookkeeping, Consumer, Drain, Loop, Outcome
from melissa_dl.train.trainer import Trainer
from melissa_dl.wire.security import Security

logger = logging.getLogger(__name__)


class Server:
    """One rank's receiver, buffer and consumer; on rank 0 also the study."""

    def __init__(self, config: Config, comm: Comm, fresh: bool = False, export_model: bool = False) -> None:
        self.config = config
        self.comm = comm
        self.fresh = fresh
        self.export_model = export_model
        self.stop = GracefulStop()
        self.lock: Any = None  # rank 0's lock of the output folder, held until the process ends
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        study = config.study
        # each simulation's parameters, drawn by rank 0's sampler as the study goes (``Receiver.follow``); the
        # held-out simulations' follow the study's
        self.parameters = np.full((study.all_simulations, len(study.parameters)), np.nan)
        self.token: bytes = comm.bcast(secrets.token_bytes(32) if self.rank == 0 else None)
        self.security: Security = comm.bcast(  # CURVE keys drawn once, by rank 0
            Security.generate(
                config.server.security,
                self.token,
                config.launcher.client_timeout,
                config.launcher.job_limit * config.launcher.client_ranks,
            )
            if self.rank == 0
            else None
        )
        passes = config.training.epochs_after_data if config.training is not None else None
        window = config.training.window if config.training is not None else None
        spec = StreamSpec.from_config(config.server, study, self.parameters, self.token, self.rank, self.size, window)
        windowing = Windowing(window.length, window.stride, spec.route.owner, self.rank) if window else None
        self.buffer = Buffer.from_config(config.buffer, self.rank, passes, windowing)
        self.bind_address, self.host = addresses(config.server.interface)
        self.receiver = Receiver.from_config(config.server, spec, self.buffer, self.bind_address, self.security)
        # the rank's TensorBoard writer (none without training), which the trainer, the study and the stream write
        # through; closed when the run ends, whichever way
        tensorboard = config.output_path / "tensorboard" / f"rank{self.rank}" if config.training is not None else None
        about = (json.dumps(config.to_dict(), indent=2), hyperparameters(config)) if self.rank == 0 else None
        self.metrics = Metrics(tensorboard, [self.receiver.scalars], about)
        self.checkpoints = CheckpointManager(config, comm)
        self.predictions: PredictionServer | None = None  # with serving.online, once the trainer is restored

    def run(self) -> int:
        """Run the study to its end; every rank returns the same exit code. The phases, in order:
        claim the output folder and find the checkpoint, restore, open the study, consume, report."""
        start = time.monotonic()
        logger.info("server rank %d of %d, pid %d", self.rank, self.size, os.getpid())
        refused = self._claim_output() if self.rank == 0 else None
        try:  # before any simulation starts: a wrong module or class is a configuration error
            version = self.checkpoints.open(self.fresh, refused)
            if self.export_model and version is None:
                raise ConfigError(f"--export-model: no checkpoint in {self.checkpoints.root}")
            # every rank: a sampler that learns makes every trainer record its losses per sample
            sampler = sampler_from_config(self.config.study, self.config.launcher.job_limit, self.config.base_dir)
            trainer = self._make_trainer(sampler.learns)
            if version is not None:
                assert trainer is not None
                if self.export_model:
                    return self._export_model(version, trainer)
                if self._already_complete(version):
                    return 0
            self.checkpoints.add(Part(STREAM, self.receiver))
        except ConfigError as error:
            if self.rank == 0:
                logger.error("%s", error)
            return EXIT_CONFIG
        freeze_startup()
        endpoints = self.comm.gather(self._start_receiving(trainer))
        handshake = launcher = study = None
        try:
            if self.rank == 0:
                assert endpoints is not None
                handshake, launcher, study = self._open_study(endpoints, sampler, trainer)
            return self._consume(start, trainer, self._bookkeeping(start, handshake, study))
        finally:
            if self.predictions is not None:
                self.predictions.stop()
            self.metrics.close()  # the curves so far, whatever ended the run
            if launcher is not None:
                launcher.shutdown()
            if handshake is not None:
                handshake.stop()

    def _bookkeeping(self, start: float, handshake: HandshakeServer | None, study: Study | None) -> Bookkeeping:
        """The ranks' rounds, with rank 0's study and status board."""
        return Bookkeeping(
            self.comm,
            self.receiver,
            self.config.server.control_interval,
            self.config.output_path / HEARTBEAT,
            study,
            handshake,
            self._status_board(start, handshake) if self.rank == 0 else None,
            self.metrics,
            [self.predictions] if self.predictions is not None else [],
        )

    def _consume(self, start: float, trainer: Trainer | None, bookkeeping: Bookkeeping) -> int:
        """Train (or only drain the buffers, without a training module) until the study ends, then report."""
        bookkeeping.beat()  # the restore and the start of the study may have taken a while
        consumer: Consumer
        if trainer is not None:
            if not self._train(trainer, bookkeeping):
                return EXIT_STOPPED
            consumer = trainer
        else:
            consumer = Drain()
            Loop(self.comm, bookkeeping, self.stop).drain(consumer)
        return self._report(trainer, bookkeeping, consumer, time.monotonic() - start)

    def _already_complete(self, version: Version) -> bool:
        """Whether ``version`` is of a study that ran to its end and wrote its report: nothing is left to do."""
        if not (version.meta.get("complete") and (self.config.output_path / "report.json").is_file()):
            return False
        if self.rank == 0:
            logger.info(
                "the study in %s is complete (checkpoint %s): nothing to do; --fresh starts it over",
                self.config.output_path,
                version.path,
            )
        return True

    def _claim_output(self) -> str | None:
        """Rank 0, before anything is written: whether this output folder is ours (None), else why not."""
        self.config.output_path.mkdir(parents=True, exist_ok=True)
        try:
            self.lock = lock_output(self.config.output_path)
        except ConfigError as error:
            return str(error)
        remove_temporaries(self.config.output_path)  # of a server killed while writing
        return None

    def _make_trainer(self, learning: bool) -> Trainer | None:
        """The trainer of the ``training`` section (none without one), restored from the checkpoint opened."""
        if self.config.training is None:
            return None
        launcher = self.config.launcher
        here = load(SCHEDULERS, launcher.scheduler, "launcher.scheduler").runs_here  # its simulations share our cores
        trainer = Trainer(
            self.config.training,
            self.config.base_dir,
            self.comm,
            self.checkpoints.copies,
            self.metrics,
            learning,
            simulations=launcher.job_limit * launcher.client_ranks if here else 0,
        )
        self.checkpoints.add(Part(DENSE, trainer.dense, shared=True), Part(TRAINER, trainer))
        if self.config.serving.online:
            check_servable(trainer.module)
        return trainer

    def _export_model(self, version: Version, trainer: Trainer) -> int:
        """``--export-model``: model.pt of the checkpoint just restored, and nothing else."""
        model = self._save_model(trainer)
        if self.rank == 0:
            logger.info("model of checkpoint %s written to %s", version.path, model)
        return 0

    def _save_model(self, trainer: Trainer) -> Path:
        """Collective (the tables are gathered): ``model.pt`` with what rebuilds it (``serving.saved``), written
        by rank 0; its path, on every rank."""
        state, training = trainer.model_state(), trainer.training
        if state is not None:
            save(
                self.config.output_path,
                state,
                training,
                self.config.base_dir / training.module,
                trainer.summary.batches,
                trainer.module.prediction_inputs,
            )
        return self.config.output_path / "model.pt"

    def _start_receiving(self, trainer: Trainer | None) -> tuple[str, str, str | None]:
        """Bind and start the receiver, and with ``serving.online`` the prediction service; their endpoints, also
        logged (what a firewall must let through)."""
        self.receiver.start_and_bind()
        data, delivery = self.receiver.endpoints(self.host)
        logger.info("data at %s, delivery service at %s", data, delivery)
        if not self.config.serving.online:
            return data, delivery, None
        assert trainer is not None
        self.predictions = PredictionServer.for_trainer(
            trainer, self.config.serving, self.receiver.rejections, self.bind_address, self.security
        )
        predict = f"tcp://{self.host}:{self.predictions.start_and_bind()}"
        logger.info("predictions at %s", predict)
        return data, delivery, predict

    def _open_study(
        self, endpoints: list[tuple[str, str, str | None]], sampler: Sampler, trainer: Trainer | None
    ) -> tuple[HandshakeServer, Launcher, Study]:
        """Rank 0: the handshake socket, the launcher and the study, restored from the checkpoint opened."""
        config = self.config
        launcher, next_work = launcher_from_config(config)
        handshake = self._handshake(endpoints, next_work, trainer)
        server_endpoint = f"tcp://{self.host}:{handshake.start_and_bind()}"
        held_out = config.study.validation.count  # counted as the status lines and the report count them
        logger.info(
            "study of %d simulations%s, handshake at %s, %d server ranks",
            config.study.all_simulations,
            f" ({held_out} held out)" if held_out else "",
            server_endpoint,
            self.size,
        )
        study = Study.from_config(
            self.config.study,
            self.config.launcher,
            self.size,
            launcher,
            sampler,
            lambda sim, attempt, parameters: simulation_environment(
                self.config.launcher,
                server_endpoint,
                self.token,
                self.security,
                sim,
                attempt,
                parameters,
                self.config.study.parameter_names,
            ),
            handshake.expect,
        )
        self.checkpoints.add(
            Part(STUDY, Group(simulations=study, handshake_rejected=handshake.rejections), shared=True)
        )
        launcher.start_thread()
        study.start()  # what a restored study left unfinished
        return handshake, launcher, study

    def _handshake(
        self,
        endpoints: list[tuple[str, str, str | None]],
        next_work: Callable[[str, str | None], dict[str, Any]] | None,
        trainer: Trainer | None,
    ) -> HandshakeServer:
        """Rank 0's handshake socket, sending clients to every rank's data, delivery and prediction services."""
        config = self.config
        return HandshakeServer.from_config(
            config.server,
            config.study,
            config.launcher,
            self.token,
            [(data, delivery) for data, delivery, _ in endpoints],
            self.bind_address,
            self.security,
            next_work,
            config.training.window if config.training is not None else None,
            clients_guide(config.serving, trainer.module.prediction_inputs, [predict for _, _, predict in endpoints])
            if config.serving.online and trainer is not None
            else None,
        )

    def _train(self, trainer: Trainer, bookkeeping: Bookkeeping) -> bool:
        """Train until the study and the buffers are done (True), or until a stop request (False)."""
        assert self.config.training is not None
        loop = Loop(self.comm, bookkeeping, self.stop, self.checkpoints)
        dataset = StreamDataset(
            self.buffer,
            trainer.module.process,
            self.config.training.batch_size,
            trainer.module.deterministic_process,
            pin_memory=trainer.device.type == "cuda",
        )
        if loop.train(trainer, dataset.next_batch, self.config.training.stall_timeout) is Outcome.ENDED:
            return True
        self.stop.done()
        self.receiver.stop()
        if bookkeeping.status is not None:  # rank 0
            bookkeeping.status.stopped()
            logger.warning("stopped on request; run the same command again to resume from %s", self.checkpoints.root)
        return False

    def _status_board(self, start: float, handshake: HandshakeServer | None) -> StatusBoard:
        study = self.config.study
        expected = study.all_simulations * study.time_steps if study.time_steps is not None else None
        assert handshake is not None
        buffer = self.config.buffer
        return StatusBoard(
            self.config.output_path,
            self.config.server.status_interval,
            start,
            expected,
            handshake.rejections.counts,
            {"capacity_samples": buffer.capacity_samples, "watermark": buffer.per_server_watermark},
        )

    def _report(self, trainer: Trainer | None, bookkeeping: Bookkeeping, consumer: Consumer, duration: float) -> int:
        """The final model, config and report; the exit code, the same on every rank. Rank 0 beats the heart
        between its steps: the final validation, checkpoint and plots are the server at work, not hung."""
        study, handshake, status = bookkeeping.study, bookkeeping.handshake, bookkeeping.status
        bookkeeping.beat()
        reports = bookkeeping.gather(consumer)
        total = self.comm.reduce(consumer.consumed())  # rank 0's, which writes the report; None elsewhere
        extra: dict[str, Any] = {}
        succeeded = self.comm.bcast(study.counts()["done"] > 0 if study is not None else None)
        if trainer is not None:  # a model trained on no whole simulation is not worth a file that looks like one
            model = self._save_model(trainer) if succeeded else None
            extra["training"] = {
                **trainer.summary.to_dict(),
                "samples_trained": total,
                "model": str(model) if model else None,
            }
            if self.rank == 0:
                resolved = json.dumps(self.config.to_dict(), indent=2).encode()
                write_atomic(self.config.output_path / "config.json", resolved)
        code = 0
        if self.rank == 0:
            assert study is not None and handshake is not None and status is not None and total is not None
            study.conclude()
            if trainer is not None:  # training ended when the data ran out, after its passes over the buffers if any
                extra["training"]["after_data"] = after_data(reports)
            duration += earlier_runs_seconds(self.config.output_path, time.time() - duration)  # before restarts
            report = final_report(
                study, reports, handshake.rejections.counts(), total, duration, self.config.study.time_steps, extra
            )
            report_path = self.config.output_path / "report.json"
            write_report(report, report_path)
            status.finish(study, reports, total, consumer.status(), (report, report_path))
            bookkeeping.beat()
            if self.config.plots:
                from melissa_dl.study.plots import draw  # matplotlib: rank 0 only, once, not in every rank's start

                logger.info("plots: %s", ", ".join(str(path) for path in draw(self.config.output_path)))
                bookkeeping.beat()
            code = EXIT_FAILED_SIMULATIONS if report["simulations"]["failed"] else 0
        return self.comm.bcast(code)


def hyperparameters(config: Config) -> dict[str, Any]:
    """What TensorBoard's HParams tab compares runs by: the training section (its options by name) and the
    buffer's; a value that is not a number, a string or a bool as JSON."""
    sections = config.to_dict()
    training = dict(sections.get("training") or {})
    options = training.pop("options", None) or {}
    flat = {
        **{f"training.{key}": value for key, value in training.items()},
        **{f"options.{key}": value for key, value in options.items()},
        **{f"buffer.{key}": value for key, value in sections["buffer"].items()},
    }
    return {key: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for key, v in flat.items()}


def freeze_startup() -> None:
    """What startup made (torch's ~300,000 objects, the model, the optimizer's ``torch._dynamo``) lives as long as
    the rank: frozen out of the collector's way, its full collections no longer walk it again and again. Collected
    first (0.2 CPU-s), so that no garbage of a restore is frozen with it, never to be freed."""
    gc.collect()
    gc.freeze()


def serve(config: Config, fresh: bool, export_model: bool) -> int:
    """Run this rank of the server on a checked configuration (``melissa_dl.cli`` checks it before MPI starts)."""
    comm = MPI.COMM_WORLD
    if (problem := launch_problem(comm.Get_size())) is not None:
        if first_of_launch():  # one line, not K
            sys.stderr.write(f"melissa-server: {problem}\n")
        return EXIT_CONFIG
    install_abort_on_error(comm, config.output_path)
    setup_logging(comm.Get_rank(), config.output_path / "logs", config.server.log_level)
    raise_open_file_limit()
    try:
        code = Server(config, comm, fresh=fresh, export_model=export_model).run()
    except SystemExit as signalled:  # a stop before training, or an exit asked for, after the finally blocks ran
        end_every_rank(comm, signalled)
    ignore_stops()
    return code
