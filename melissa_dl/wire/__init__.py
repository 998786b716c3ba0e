"""What travels between a simulation and the server: the message layout (DESIGN.md §3), credentials, refusal counts,
and the client that simulations link.

Imported by simulations: nothing here may pull in torch.
"""
