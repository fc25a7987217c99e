"""Exception types shared by every layer of flamia_pack.

All user-facing errors derive from :class:`FlamiaError` (itself a ``ValueError``), so the CLI can
print one clear line and exit non-zero, and library callers can catch one type.
"""
from __future__ import annotations


class FlamiaError(ValueError):
    """Base class of every input/validation error raised by flamia_pack."""


class SourceError(FlamiaError):
    """A data source is missing, unreadable, corrupt, or has the wrong columns/values."""


class FormatError(FlamiaError):
    """A packed output directory is malformed: bad manifest, missing shard, checksum mismatch."""


class MetadataError(FlamiaError):
    """Invalid varlen metadata: cu_seqlens not int32/int64, not starting at 0, not monotone,
    not ending at T, wrong device, or lengths out of range."""
