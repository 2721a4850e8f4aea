"""Exceptions of the converter (the CLI maps them to exit codes)."""

from __future__ import annotations

__all__ = ["ConversionError", "VerificationError"]


class ConversionError(ValueError):
    """Bad input: the source, its config or the destination cannot be converted (exit code 2)."""


class VerificationError(RuntimeError):
    """``--verify`` found tokens that differ from the reference where they must be identical (exit code 1)."""

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result
