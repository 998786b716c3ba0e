"""The server side of the stream: handshakes, data sockets and their guard, reassembly of steps, the exactly-once
ledger, and the acknowledgements of finalize.
"""
