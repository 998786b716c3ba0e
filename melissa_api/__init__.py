"""Melissa's Python client API (INRIA Melissa's ``melissa_api``) on melissa_dl's client.

A simulation written for Melissa streams into a melissa_dl study unchanged::

    from melissa_api import melissa_finalize, melissa_init, melissa_send

    melissa_init("temperature", local_size, comm)  # once per field; comm: the mpi4py communicator
    for t in range(steps):
        melissa_send("temperature", u)  # local_size values: the field's next step
    melissa_finalize()

The step is implicit: each ``melissa_send`` of a field sends that field's next
step, 0, 1, 2, ... Values go as float64, Melissa's only type (converted and
flattened as Melissa does). Declare every field before the first send, which
connects to the server (:class:`melissa_dl.Client`, reading the launcher's
environment). A mistake of the program raises ``ClientError``, which the study
does not relaunch; the client's other errors pass unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from melissa_dl.errors import ClientError
from melissa_dl.runtime.mpi import Comm
from melissa_dl.wire.client import Client

__all__ = ["melissa_finalize", "melissa_init", "melissa_send"]


class _Session:
    """What Melissa's calls share until ``melissa_finalize``: the fields declared, their next steps, the client."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.comm: Comm | None = None
        self.client: Client | None = None

    def connect(self) -> Client:
        if self.client is None:
            self.client = Client({name: ("float64", (size,)) for name, size in self.sizes.items()}, self.comm)
        return self.client


_session = _Session()


def melissa_init(field_name: str, vect_size: int, comm: Comm | None) -> None:
    """Declare a field of ``study.fields``: the values this rank sends per step, and the simulation's
    communicator (the same for every field; ``None`` for a serial simulation)."""
    if _session.client is not None:
        raise ClientError(f"melissa_init('{field_name}'): declare every field before the first melissa_send")
    if field_name in _session.sizes:
        raise ClientError(f"melissa_init('{field_name}'): the field is declared twice")
    if vect_size < 0:
        raise ClientError(f"melissa_init('{field_name}'): negative size {vect_size}")
    if _session.sizes and comm != _session.comm:
        raise ClientError(f"melissa_init('{field_name}'): another communicator than the first field's")
    _session.sizes[field_name] = vect_size
    _session.steps[field_name] = 0
    _session.comm = comm


def melissa_send(field_name: str, send_vect: Any) -> None:
    """Send this rank's values of the field as its next step; they are copied, so they may change at once."""
    if field_name not in _session.sizes:
        raise ClientError(
            f"melissa_send('{field_name}'): the field was not declared by melissa_init "
            f"(declared: {sorted(_session.sizes)})"
        )
    values = np.asarray(send_vect, dtype=np.float64).reshape(-1)
    _session.connect().send(field_name, _session.steps[field_name], values)
    _session.steps[field_name] += 1


def melissa_finalize() -> None:
    """Wait until the server holds every step sent, and release everything (``melissa_init`` may start again)."""
    global _session
    if not _session.sizes:
        raise ClientError("melissa_finalize(): no field was declared by melissa_init")
    client, _session = _session.connect(), _Session()
    client.finalize()
