"""Exceptions raised by the Tarn clients.

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
