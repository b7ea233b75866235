"""Token authentication of the P4Runtime server: every call must carry the switch's token as gRPC metadata.

The switch is shared between jobs, and P4Runtime lets any client that reaches the port become primary,
read every aggregator register and rewrite the multicast groups. So the server checks, on every call
(unary, server-streaming and the StreamChannel), the metadata ``authorization: Bearer <token>`` with a
constant-time comparison, and answers anything else with ``UNAUTHENTICATED`` before the service sees it.

The token the switch holds is derived from the job token (:func:`p4runtime_token`), so the switch
process never holds the job token itself, and what a switch leaks cannot open the job's TCP
connections. Controllers in the job derive the same value from their config's token.

Clients: :func:`authenticated_channel` (a gRPC channel that adds the metadata to every call), used by
``innet.controller.P4RuntimeController``; ``innet/p4runtime/shell_token.py`` does the same for
p4runtime-shell (see docs/innet-security.md).
"""

from __future__ import annotations

import hmac
import logging
from typing import Any
from collections.abc import Callable

import grpc

from ..tokens import p4runtime_token, read_token_file
from .shell_token import METADATA_KEY, MetadataClientInterceptor

__all__ = ["METADATA_KEY", "p4runtime_token", "TokenInterceptor", "MetadataClientInterceptor",
           "authenticated_channel", "read_token_file"]

log = logging.getLogger(__name__)

def _bearer(token: str) -> str:
    return f"Bearer {token}"


class TokenInterceptor(grpc.ServerInterceptor):
    """Server side: let a call through only when its metadata carries ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the P4Runtime token must not be empty")
        self._expected = _bearer(token).encode()
        self.refused = 0

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == METADATA_KEY:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        if self._authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        self.refused += 1
        log.warning("P4Runtime call %s without a valid token refused", handler_call_details.method)

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "P4Runtime calls to this switch need the job's token "
                          f"(metadata '{METADATA_KEY}: Bearer <token>')")

        kind = (handler.request_streaming, handler.response_streaming)
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[kind]
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def authenticated_channel(address: str, token: str | None) -> grpc.Channel:
    """An insecure gRPC channel to ``address`` whose every call carries ``token`` (None: no metadata)."""
    channel = grpc.insecure_channel(address)
    if token is None:
        return channel
    return grpc.intercept_channel(channel, MetadataClientInterceptor(token))
