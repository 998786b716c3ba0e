"""``melissa-server --serve OUTPUT_DIR``: a study's final model answering predictions, on any number of ranks.

Each rank rebuilds the model the study wrote (``load_model``; on the rank's GPU where its node has one) and
answers on a prediction service of its own, as the training ranks do with ``serving.online``
(:mod:`melissa_dl.serving.online`: batching, refusals, credentials), every answer carrying the batches the model
was trained to. Its ``serving`` limits and ``server.security`` level and interface are the study's (its resolved
``config.json``). Rank 0 writes ``OUTPUT_DIR/serving.json``, readable by its owner only: each rank's endpoint, the
inputs, the limits and the credentials, which ``melissa_dl.Predictor`` reads. A later serve of the same folder
keeps those credentials, and a predictor that gets no answer reads the file again, so a client that keeps asking
across a restart is answered by the new ranks once they are up. SIGTERM or SIGINT stops every rank, exit 0.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from melissa_dl.config.sections import ServingConfig
from melissa_dl.errors import ConfigError
from melissa_dl.ingest.connections import raise_open_file_limit
from melissa_dl.runtime.files import write_atomic
from melissa_dl.runtime.logs import setup_logging
from melissa_dl.runtime.mpi import GracefulStop, first_of_launch, install_abort_on_error
from melissa_dl.runtime.network import addresses
from melissa_dl.runtime.status import EXIT_CONFIG
from melissa_dl.serving.online import PredictionServer, clients_guide, predict_numpy
from melissa_dl.serving.saved import load_model
from melissa_dl.train.module import TrainingModule
from melissa_dl.wire.predictions import SERVING_FILE
from melissa_dl.wire.rejections import RejectionLog
from melissa_dl.wire.security import Security

logger = logging.getLogger(__name__)

WAKE = 0.2  # seconds between two looks of a rank at a stop request and at its service


class FinalModel:
    """A study's trained module, answering as a replica does, at the one version it has."""

    def __init__(self, module: TrainingModule, version: int, device: torch.device) -> None:
        self.module, self.version, self._device = module, version, device
        self.inputs = dict(module.prediction_inputs)

    def trained(self) -> int:
        return self.version

    def answer(self, inputs: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        return self.version, predict_numpy(self.module, inputs, self._device)


def serve_model(output_dir: Path, port: int = 0) -> int:
    """Serve the model in ``output_dir`` from this rank until a stop; rank ``r`` binds ``port + r`` (0: a free
    port)."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        study, model = _study_settings(output_dir), _final_model(output_dir, _device(comm))
    except ConfigError as error:
        if first_of_launch():  # one line, not K
            sys.stderr.write(f"melissa-server: --serve: {error}\n")
        return EXIT_CONFIG
    os.umask(0o077)  # serving.json holds the credentials
    logs = output_dir / "logs" / "serve"
    setup_logging(rank, logs)
    install_abort_on_error(comm, logs)  # the study's own failure record stays the study's
    raise_open_file_limit()
    security = Security.from_json(comm.bcast(_credentials(output_dir, study["security"]) if rank == 0 else None))
    bind, host = addresses(study["interface"])
    server = PredictionServer(model, study["serving"], rank, RejectionLog(), bind, security, port + rank if port else 0)
    endpoints = comm.gather(f"tcp://{host}:{server.start_and_bind()}")
    stop = GracefulStop("serving: the questions not answered yet get none")
    stop.install()
    try:
        if rank == 0:
            assert endpoints is not None
            _publish(output_dir, model, study["serving"], endpoints, security)
        while not stop.requested:
            time.sleep(WAKE)
            server.check()
    finally:
        server.stop()
    logger.info("stopped; %s refused", server.rejections.counts() or "nothing")
    return 0


def _final_model(output_dir: Path, device: torch.device) -> FinalModel:
    """The model the study wrote, at the batches it was trained to."""
    model = load_model(output_dir, device)
    if not model.prediction_inputs:
        raise ConfigError(f"{model.__class__.__name__} declares no prediction_inputs: nothing can be asked of it")
    saved = json.loads((output_dir / "model.json").read_text())
    return FinalModel(model, int(saved["batches"]), device)


def _study_settings(output_dir: Path) -> dict[str, Any]:
    """The study's ``serving`` limits, security level and interface, from its resolved ``config.json``."""
    path = output_dir / "config.json"
    try:
        resolved = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (a study writes it at its end: is this a study's output folder?)") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: unreadable ({error})") from None
    serving = resolved.get("serving", {})
    limits = {key: serving[key] for key in ("max_batch", "max_wait", "deadline") if key in serving}
    server = resolved.get("server", {})
    return {
        "serving": ServingConfig(online=True, **limits),
        "security": server.get("security", "token"),
        "interface": server.get("interface", "127.0.0.1"),
    }


def _device(comm: Any) -> torch.device:
    """The rank's GPU where its node has one (in turn over them), the CPU otherwise."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    device = torch.device("cuda", node.Get_rank() % torch.cuda.device_count())
    node.Free()
    torch.cuda.set_device(device)
    return device


def _credentials(output_dir: Path, level: str) -> dict[str, str]:
    """Those of an earlier serve of this folder, so that its clients are still admitted; new ones otherwise."""
    try:
        kept = json.loads((output_dir / SERVING_FILE).read_text())["credentials"]
        if kept["level"] == level:
            return dict(kept)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return Security.generate(level, secrets.token_bytes(32)).to_json()


def _publish(
    output_dir: Path, model: FinalModel, serving: ServingConfig, endpoints: list[str], security: Security
) -> None:
    """``serving.json``: what a predictor needs to ask every rank."""
    published = {
        **clients_guide(serving, model.inputs, list(endpoints)),
        "version": model.version,
        "credentials": security.to_json(),
    }
    write_atomic(output_dir / SERVING_FILE, (json.dumps(published, indent=2) + "\n").encode())
    logger.info(
        "serving the model of %s (trained to %d batches) on %d ranks: %s; clients read %s",
        output_dir,
        model.version,
        len(endpoints),
        ", ".join(endpoints),
        output_dir / SERVING_FILE,
    )
