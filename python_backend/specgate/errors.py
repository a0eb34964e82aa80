"""Errors shared across layers (no heavy imports, so the gate can use them without torch)."""


class InvalidInput(ValueError):
    """A request problem the client must fix (maps to INVALID_ARG)."""
