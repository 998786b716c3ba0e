"""The project's exception hierarchy.

User mistakes (bad config, bad input, refused handshakes) are ``ValueError``
subclasses so that callers can tell them from bugs; internal invariants use
``assert``.
"""

from __future__ import annotations


class MelissaError(Exception):
    """Base of every error raised on purpose by melissa_dl."""


class ConfigError(MelissaError, ValueError):
    """The configuration file is wrong; the message names the JSON path."""


class ProtocolError(MelissaError, ValueError):
    """A frame or handshake is refused; ``kind`` names the reason for counting."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class HandshakeRefused(MelissaError, ValueError):
    """The server refused a client's handshake; the message says why."""


class PredictionRefused(MelissaError, ValueError):
    """A server rank refused a prediction request; the message says why."""


class ServerUnreachable(MelissaError, ConnectionError):
    """The server did not answer within the client's bounded wait."""


class ReceiverDied(MelissaError, RuntimeError):
    """A receiver thread failed; carries its exception as ``__cause__``."""


class TrainingStalled(MelissaError, RuntimeError):
    """Lockstep training cannot progress: a rank has no data while another's buffer is full."""


class ClientError(MelissaError, ValueError):
    """A simulation used the client API wrongly (environment, field, dtype, shape)."""


class CheckpointCorrupt(MelissaError, RuntimeError):
    """A version on disk is torn or damaged; the message says which and why."""


class BufferClosed(MelissaError, RuntimeError):
    """``put`` was called on a buffer whose reception is over."""
