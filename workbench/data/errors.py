"""Errors raised by workbench.data, and how a cause is put on one line of a message."""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "DataUnavailableError",
    "IntegrityError",
    "ManifestError",
    "UnsafeArchiveError",
    "one_line",
]


class ManifestError(ValueError):
    """A manifest is malformed, or no manifest declares the requested dataset."""

    def __init__(self, message: str, path: Path | None = None) -> None:
        super().__init__(message)
        self.path = path


class IntegrityError(ValueError):
    """A file's size or sha256 differs from its manifest; the file was not used.

    `actual`: the digest of the first copy rejected, when it was downloaded or generated; None when
    it was a local file (a mirror's, a package's, a file:// URL's), whose digest is not disclosed.
    """

    def __init__(
        self, message: str, *, expected: str | None, actual: str | None, location: str
    ) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual
        self.location = location


class DataUnavailableError(RuntimeError):
    """No cache entry, mirror, package, or URL could provide a dataset file."""


class UnsafeArchiveError(ValueError):
    """An archive member would land outside the dataset directory."""


def one_line(e: BaseException | str) -> str:
    """An exception (or text) as one line, to quote as the cause inside a longer message.

    Multi-line causes (YAML parser errors, nested URLErrors) would break the
    ``Tried:`` lists and bullet lists the data errors are made of.
    """
    text = e if isinstance(e, str) else (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    return " ".join(text.split())
