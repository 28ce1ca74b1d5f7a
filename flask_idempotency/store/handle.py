"""What every request's handle on a store keeps, whichever store holds the records.

A handle (``PostgresRequest`` and its two claim modes, ``MemoryRequest``) takes
one request from its claim to completion or release. The Flask layer, the lease
keeper and the completer read the same few facts off any of them; those facts
and their defaults live here once, so the stores cannot drift apart on what a
fresh handle says. The defaults are class attributes, not an ``__init__`` of
this class: a handle is made for every request on the PostgreSQL hot path, and
a shared base must not add a call to that (the first assignment of a flag
makes it the instance's own).
"""

from __future__ import annotations

from .base import ClaimResult


class RequestHandle:
    """One request's hold on its record: the claim, the recovery points, and whether
    a transaction of the view's is open."""

    #: Whether the claim is a processing row whose lease the keeper must renew
    #: (row mode); a transaction-mode claim lives and dies with its session.
    holds_lease = True
    #: The record holds committed recovery points (claimed with them, or one
    #: committed since): a release keeps it for the next attempt to resume.
    has_progress: bool = False
    #: This request's transaction is open; never, for a store without one.
    _in_transaction: bool = False

    @property
    def in_transaction(self) -> bool:
        """Whether this request's transaction is open (a claim in transaction mode,
        or the view's first use of its connection)."""
        return self._in_transaction

    def claim(
        self,
        record_key: bytes,
        fingerprint: bytes,
        *,
        lease: float,
        ttl: float,
        recovery: bytes | None = None,
    ) -> ClaimResult:
        """Claim ``record_key`` for this request, or read who has it."""
        raise NotImplementedError
