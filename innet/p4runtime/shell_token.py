"""Connect p4runtime-shell (or any gRPC P4Runtime client) to a switch that requires a token.

This file depends on grpc only, so it also works inside p4runtime-shell's own environment, where the
twisternet package is not installed (p4runtime-shell pins an old protobuf). Two ways to use it:

* as a program: the p4runtime-shell command line, with the token read from a file or the environment::

      python innet/p4runtime/shell_token.py --token-file TOKEN --grpc-addr 127.0.0.1:9559 \\
          --device-id 1 --election-id 0,1

* from a script::

      import sys; sys.path.insert(0, "<repo>/innet/p4runtime")
      import shell_token
      shell_token.install(token)            # every gRPC channel made afterwards carries the token
      import p4runtime_sh.shell as sh
      sh.setup(device_id=1, grpc_addr="127.0.0.1:9559", election_id=(0, 1))

``install`` wraps ``grpc.insecure_channel`` and ``grpc.secure_channel`` of this process so that every
call adds the metadata ``authorization: Bearer <token>`` the switch checks (``innet.p4runtime.auth``).
"""

from __future__ import annotations

import os
import sys

import grpc

__all__ = ["METADATA_KEY", "TOKEN_ENV", "MetadataClientInterceptor", "install", "main"]

#: gRPC metadata key (lower case, as gRPC requires) holding ``Bearer <token>``.
METADATA_KEY = "authorization"
#: environment variable read by ``main`` when no ``--token-file`` is given.
TOKEN_ENV = "TWISTERNET_P4RUNTIME_TOKEN"


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class MetadataClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Add ``authorization: Bearer <token>`` to every call of a channel."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the P4Runtime token must not be empty")
        self._pair = (METADATA_KEY, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != METADATA_KEY]
        metadata.append(self._pair)
        return _ClientCallDetails(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def install(token: str) -> None:
    """Make every gRPC channel this process creates from now on carry ``token`` (idempotent per token)."""
    interceptor = MetadataClientInterceptor(token)
    insecure = getattr(grpc.insecure_channel, "_twisternet_original", grpc.insecure_channel)
    secure = getattr(grpc.secure_channel, "_twisternet_original", grpc.secure_channel)

    def insecure_channel(target, *args, **kwargs):
        return grpc.intercept_channel(insecure(target, *args, **kwargs), interceptor)

    def secure_channel(target, credentials, *args, **kwargs):
        return grpc.intercept_channel(secure(target, credentials, *args, **kwargs), interceptor)

    insecure_channel._twisternet_original = insecure     # type: ignore[attr-defined]
    secure_channel._twisternet_original = secure         # type: ignore[attr-defined]
    grpc.insecure_channel = insecure_channel
    grpc.secure_channel = secure_channel


def _token_from_args(argv: list[str]) -> tuple[str, list[str]]:
    rest, token = [], os.environ.get(TOKEN_ENV, "")
    it = iter(argv)
    for arg in it:
        if arg == "--token-file" or arg.startswith("--token-file="):
            path = arg.split("=", 1)[1] if "=" in arg else next(it, "")
            with open(path, encoding="utf-8") as f:
                token = f.readline().strip()
        else:
            rest.append(arg)
    if not token:
        raise SystemExit(f"shell_token: give the switch's P4Runtime token with --token-file or ${TOKEN_ENV}")
    return token, rest


def main(argv: list[str] | None = None) -> None:
    """Run p4runtime-shell's command line (``p4runtime_sh.shell.main``) with the token installed."""
    token, rest = _token_from_args(list(sys.argv[1:] if argv is None else argv))
    install(token)
    import p4runtime_sh.shell as sh  # imported late: only in p4runtime-shell's environment
    sys.argv = [sys.argv[0], *rest]
    sh.main()


if __name__ == "__main__":  # pragma: no cover - exercised in tests/innet/test_p4runtime_shell.py
    main()
