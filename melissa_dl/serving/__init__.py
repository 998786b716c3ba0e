"""The trained model given back: saved with what rebuilds it, loaded in a Python session or by TorchScript's
callers.
"""
