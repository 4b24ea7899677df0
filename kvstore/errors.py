"""Typed errors of the core store.

Expected shortage is not an error: a miss is an empty result, a put that cannot be
admitted is a refusal in the result. These exceptions mean the request itself was
wrong (InvalidArgument, UnknownNamespace, LayoutMismatch, LeaseError) or that the store
cannot take it now (OutOfSpace). The daemon maps each class to one gRPC status code;
the client maps the codes back to its own exception classes. Every request that raises
one of these has changed nothing in the store.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the core raises on purpose."""


class InvalidArgument(StoreError):
    """The request is malformed: sizes, token ids, offsets, priorities (INVALID_ARGUMENT)."""


class UnknownNamespace(StoreError):
    """The namespace was never opened in this store (NOT_FOUND)."""


class LayoutMismatch(StoreError):
    """A namespace id was re-opened with a different layout (FAILED_PRECONDITION)."""


class LeaseError(StoreError):
    """The lease is unknown, released or expired (FAILED_PRECONDITION)."""


class OutOfSpace(StoreError):
    """No room can be made: every candidate is leased or pending (RESOURCE_EXHAUSTED)."""


class NoRoom(OutOfSpace):
    """A read's window got not one host slot: the host room is held by other reads'
    leases or pending puts (RESOURCE_EXHAUSTED, as OutOfSpace)."""


class StoreClosed(StoreError):
    """The store is shutting down and takes no new work (UNAVAILABLE)."""


class Unauthenticated(StoreError):
    """The call's token is missing or wrong (the daemon has tenants: kvstored.auth)."""
