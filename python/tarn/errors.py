"""Exceptions raised by the Tarn clients (tarn.checkpoint adds its own, under TarnError).

A miss is never an exception: ``get_into`` answers ``None`` for it. These are
for calls that could not be made or answered at all.
"""

import builtins


class TarnError(Exception):
    """Base of every Tarn error."""


class KvConnectionError(TarnError, builtins.ConnectionError):
    """The KV server could not be reached, or the connection failed mid-call."""


class KvServerError(TarnError):
    """The KV server refused the request (limits, bad frame, version)."""


class KvProtocolError(TarnError):
    """The KV server's response did not parse; the connection was dropped."""


class KvPermissionError(KvServerError, builtins.PermissionError):
    """The KV server refused the credentials (wrong access key or secret), or
    the namespace is not granted to the credentials' tenant."""


class ObjectError(TarnError):
    """A read or write of an object failed (after its retries). The message
    names the object and the bytes; ``bucket``, ``key``, ``range`` (``(start,
    end)`` of the failed request, end exclusive, or None), ``attempts`` and
    ``status`` (the HTTP status, or None for a network failure) say the same
    as attributes."""

    bucket = None
    key = None
    range = None
    attempts = None
    status = None


class ObjectNotFoundError(ObjectError, builtins.FileNotFoundError):
    """No such object (or bucket)."""


class ObjectPermissionError(ObjectError, builtins.PermissionError):
    """The credentials may not read or write the object."""


class ObjectConnectionError(ObjectError, builtins.ConnectionError):
    """The server could not be reached, or the connection failed, on every
    attempt."""
