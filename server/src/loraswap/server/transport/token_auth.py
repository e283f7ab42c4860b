"""Bearer tokens on every DiffusionService call: a grpc.aio server interceptor over loraswap.server.access.

Health and reflection stay open, for probes and grpcurl. A refused call ends with the one error table's
status (UNAUTHENTICATED or PERMISSION_DENIED, with its ErrorInfo) before its request is even decoded.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from loraswap.server.access import AccessTokens, Role
from loraswap.server.engine.errors import EngineError
from loraswap.server.observability.calls import UNKNOWN_METHOD, method_name
from loraswap.server.transport.errors import to_rpc_status
from loraswap.server.transport.servicer import DIFFUSION_SERVICE

log = logging.getLogger(__name__)

# The role each DiffusionService RPC needs; an RPC missing here (added later and forgotten) needs admin.
ROLE_FOR_RPC: dict[str, Role] = {
    "Generate": Role.GENERATE,
    "ListAdapters": Role.GENERATE,
    "GetServerInfo": Role.GENERATE,
    "PreloadAdapter": Role.ADMIN,
    "Evict": Role.ADMIN,
}
OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})


def role_needed(method: str) -> Role | None:
    """The role a call to `method` ("/package.Service/Method") needs; None for the open services."""
    service, _, rpc = method.lstrip("/").rpartition("/")
    if service in OPEN_SERVICES:
        return None
    if service == DIFFUSION_SERVICE.full_name:
        return ROLE_FOR_RPC.get(rpc, Role.ADMIN)
    return Role.ADMIN


def _logged_method(method: str) -> str:
    """The RPC's short name, or UNKNOWN_METHOD: the caller writes the path, which may be any length and hold
    anything, a newline included."""
    service, _, rpc = method.lstrip("/").rpartition("/")
    return method_name(rpc) if service == DIFFUSION_SERVICE.full_name else UNKNOWN_METHOD


def _authorization(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


def _refusal(handler: grpc.RpcMethodHandler | None, error: EngineError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `error`'s status, its request unread."""

    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort_with_status(to_rpc_status(error))

    if handler is not None and handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets a DiffusionService call through only with `authorization: Bearer <token>` of a role that permits it."""

    def __init__(self, tokens: AccessTokens) -> None:
        self.tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        needed = role_needed(handler_call_details.method)
        if needed is None:
            return await continuation(handler_call_details)
        try:
            self.tokens.authorize(_authorization(handler_call_details.invocation_metadata), needed)
        except EngineError as error:
            # The reason only: the token itself is never logged.
            log.info("refused %s: %s", _logged_method(handler_call_details.method), error.reason)
            return _refusal(await continuation(handler_call_details), error)
        return await continuation(handler_call_details)
