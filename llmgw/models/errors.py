"""
Why a model could not be had. Each exception carries C{failure_class}, the
short string a shard's failure is reported under (like a crash class), so
a caller can tell a cache too small from a wrong checksum without parsing
the message. Messages name the model and what was wrong, never a token.
"""

from __future__ import annotations


class ModelError(Exception):
    """
    A model could not be fetched or used. C{failure_class} says which kind
    of failure it was; the message says what, for a person.
    """

    failure_class = "fetch"


class SourceInvalid(ModelError, ValueError):
    """
    A source string (or its C{file}/C{sha256}) is malformed. Retrying cannot help.
    """

    failure_class = "config"


class SourceNotFound(ModelError):
    """
    The repository, revision, file, URL or path does not exist.
    """

    failure_class = "not_found"


class SourceDenied(ModelError):
    """
    The source refused access (a gated or private repository without a
    token that may read it, or an HTTP 401/403).
    """

    failure_class = "denied"


class DiskFull(ModelError):
    """
    The model cannot fit: in the cache's size bound once every model that
    no shard uses is evicted, or on the filesystem holding the cache. Raised
    before a byte of the model is written when its size is known up front.
    """

    failure_class = "disk_full"


class ChecksumMismatch(ModelError):
    """
    A file's bytes do not match the source's checksum (the hub's sha256 for
    an LFS file, its git blob id for another, the catalog's sha256 for an
    https file). The bad file is deleted.
    """

    failure_class = "checksum"


class FetchCancelled(ModelError):
    """
    Every caller waiting on a fetch cancelled it. What was fetched so far is
    kept, and a later fetch resumes from it.
    """

    failure_class = "cancelled"
