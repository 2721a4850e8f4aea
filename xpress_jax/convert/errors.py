"""The converter's exceptions (the CLI maps them to exit codes 2 and 1)."""

from __future__ import annotations


class ConversionError(ValueError):
    """Bad input: the source, its config or the destination cannot be converted."""


class VerificationError(RuntimeError):
    """``--verify`` found tokens that differ from the reference where they must be identical."""

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result
