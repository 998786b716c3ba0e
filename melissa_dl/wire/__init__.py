"""What travels between a simulation and the server: the message layout (docs/reference/wire-protocol.md),
credentials, refusal counts, and the client that simulations link.

Imported by simulations: nothing here may pull in torch.
"""
