"""Refusing a gRPC call without a valid token before its request is read.

On a daemon with tokens (kvstored.auth) every kvstore.v1 call names its caller in its
``authorization`` metadata. :class:`TokenGate` looks at that metadata when the call
starts, before grpc reads the request: a call without a valid token gets a handler
that never reads its request stream and answers UNAUTHENTICATED (the message its
handler would have given, through the handlers' own kvstored.errors.abort_with: logged
and held back as kvstored.auth.BadTokens says). So nobody without a token makes the
daemon receive, decode or hold a request body: at most the transport's flow-control
window of it. The handlers still ask
``Access.caller``, which the local-call server's connections answer for themselves.
Health and reflection stay open (probes carry no token).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvstore.errors import Unauthenticated
from kvstored.auth import Tokens
from kvstored.errors import abort_with

GATED_PREFIX = "/kvstore.v1."  # KVStore and KVGpu; not grpc.health.v1, not reflection


class TokenGate(grpc.aio.ServerInterceptor):
    """See the module docstring."""

    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if self._tokens.enabled and handler_call_details.method.startswith(GATED_PREFIX):
            try:
                self._tokens.caller_of(handler_call_details.invocation_metadata)
            except Unauthenticated as exc:
                return grpc.stream_unary_rpc_method_handler(
                    _refusal(handler_call_details.method, exc)
                )
        return await continuation(handler_call_details)


def _refusal(
    method: str, exc: Unauthenticated
) -> Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], Any]:
    """A behavior that never reads the request and answers ``exc`` as a handler's
    refusal is answered (kvstored.errors.abort_with: logged, held back, status)."""

    async def refuse(_requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
        await abort_with(context, method.rsplit("/", 1)[-1], exc)

    return refuse
