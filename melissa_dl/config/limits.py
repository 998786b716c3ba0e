"""What a field's layout and a client's environment may be: the bounds that the wire carries and the clients
accept, which the configuration states and checks (plain data, so that the configuration imports no wing).

The numbers a client reads from the environment the launcher sets: the Python client checks these, and
native/src/client.c's ``env_number`` calls name the same bounds; the configuration refuses at ``--check`` what
would make every simulation fail.
"""

from __future__ import annotations

DTYPES: tuple[str, ...] = ("float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8")
"""The element types a field may have, in the order of their codes on the wire."""
MAX_NDIM = 6  # dimensions of a field, at most

CLIENT_TIMEOUT_RANGE = (1e-3, 1e6)  # MELISSA_CLIENT_TIMEOUT (launcher.client_timeout), seconds
SEND_QUEUE_BYTES_RANGE = (1, 10**18)  # MELISSA_SEND_QUEUE_BYTES (launcher.send_queue_bytes)
MAX_SIMULATION_ID = 2**31 - 1  # MELISSA_SIMULATION_ID and MELISSA_ATTEMPT: the C client's INT32_MAX
