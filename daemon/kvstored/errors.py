"""Core errors -> gRPC status codes: the one place where that mapping lives.

Every servicer method is wrapped with :func:`grpc_errors`. A :class:`StoreError`
becomes its status code with the error's own message (the core and the edge
validation name the field and the value); anything else is a bug: it is logged with
its traceback and answered INTERNAL without internals in the message. The client maps
the codes back to its own exception classes.

A request whose bytes do not decode is not a bug but bad input: the method handlers
are registered with :func:`tolerant` deserializers, which hand the method an
:class:`Undecodable` in place of the message, and :func:`grpc_errors` answers it
INVALID_ARGUMENT before the method runs (grpc's own handling would log a traceback and
answer a status that says nothing about the request).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from kvstore.errors import (
    InvalidArgument,
    LayoutMismatch,
    LeaseError,
    OutOfSpace,
    StoreClosed,
    StoreError,
    Unauthenticated,
    UnknownNamespace,
)
from kvstored.auth import BAD_TOKENS
from kvstored.log_limits import LIMITED

log = logging.getLogger("kvstored.service")


STATUS_BY_ERROR: tuple[tuple[type[StoreError], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownNamespace, grpc.StatusCode.NOT_FOUND),
    (LayoutMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (LeaseError, grpc.StatusCode.FAILED_PRECONDITION),
    (OutOfSpace, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StoreClosed, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code of an exception (INTERNAL for anything that is not a StoreError)."""
    for cls, code in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, rpc: str, exc: Exception) -> NoReturn:
    """Answer ``exc`` on ``context`` with its status code (raises grpc's AbortError)."""
    if isinstance(exc, grpc.aio.AbortError):  # the method aborted on purpose
        raise exc
    code = status_for(exc)
    if isinstance(exc, Unauthenticated):  # logged (rate-limited), a flood held back
        delay = BAD_TOKENS.note(context.peer())
        if delay:
            await asyncio.sleep(delay)
    if code is grpc.StatusCode.INTERNAL:
        LIMITED.error(log, f"internal:{rpc}", "%s failed", rpc, exc_info=exc)
        message = f"internal error in {rpc}: {type(exc).__name__} (see the daemon log)"
    else:
        log.debug("%s -> %s: %s", rpc, code.name, exc)
        message = str(exc) or type(exc).__name__
    # clients tell errors that share a status code apart by this (e.g. LeaseError and
    # LayoutMismatch are both FAILED_PRECONDITION)
    await context.abort(code, message, trailing_metadata=(("kvstore-error", type(exc).__name__),))
    raise AssertionError("context.abort() returned")  # it always raises


class Undecodable:
    """A request whose bytes are not a valid message of its method's request type."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


def tolerant(deserialize: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    """``deserialize``, answering :class:`Undecodable` where it raises."""

    def decode(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception:  # DecodeError, or whatever a malformed message makes it raise
            return Undecodable(type_name)

    return decode


def _check_decoded(request: Any) -> None:
    if isinstance(request, Undecodable):
        raise InvalidArgument(f"the request is not a valid {request.type_name}")


F = TypeVar("F", bound=Callable[..., Any])


def grpc_errors(method: F) -> F:
    """Wrap an async servicer method (unary result or async generator) with the mapping."""
    rpc = method.__name__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            try:
                _check_decoded(request)
                async for item in method(self, request, context):
                    yield item
            except Exception as exc:
                await abort_with(context, rpc, exc)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _check_decoded(request)
            return await method(self, request, context)
        except Exception as exc:
            await abort_with(context, rpc, exc)

    return unary  # type: ignore[return-value]
