"""The P4Runtime gRPC service over any ``SwitchControl``, and ``serve()`` to run it.

Implements StreamChannel (arbitration; packet I/O and digests are answered with a StreamError),
Set/GetForwardingPipelineConfig, Write (per-update ``p4.v1.Error`` details in ``grpc-status-details-bin``
under status UNKNOWN, as the spec requires), Read (streamed in batches) and Capabilities. With a token
(``serve(..., token=...)``) every call must carry it (``innet.p4runtime.auth``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from concurrent import futures
from importlib import metadata
from pathlib import Path

import grpc

from innet.control import SwitchControl

from .arbitration import Arbitrator, election_id_of
from .auth import TokenInterceptor
from .entities import EntityStore
from .errors import P4RuntimeError, invalid_argument, not_found
from .protos import code_pb2, p4runtime_pb2, p4runtime_pb2_grpc, status_pb2
from .schema import AtpSchema, load_p4info, with_packet_values

logger = logging.getLogger(__name__)

_READ_BATCH = 1000                    # entities per ReadResponse
_END = object()


def _api_version() -> str:
    try:
        return metadata.version("p4runtime")
    except metadata.PackageNotFoundError:  # pragma: no cover - protos come from that package
        return "1.4.1"


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")),
              grpc.Status):
    """A grpc.Status with rich details (what grpcio-status builds, without the extra dependency)."""


class _Abort:
    def __init__(self, error: P4RuntimeError) -> None:
        self.error = error


class P4RuntimeService(p4runtime_pb2_grpc.P4RuntimeServicer):
    """P4Runtime service for one device (the ATP switch) backed by a SwitchControl."""

    def __init__(self, switch: SwitchControl, schema: AtpSchema, device_id: int = 1) -> None:
        if device_id <= 0:
            raise ValueError("device_id must be a positive integer (0 is invalid in P4Runtime)")
        self.device_id = device_id
        self.arbitrator = Arbitrator(device_id)
        schema = AtpSchema.from_p4info(with_packet_values(schema.p4info, int(switch.value_count)))
        self.store = EntityStore(switch, schema)
        self._config = p4runtime_pb2.ForwardingPipelineConfig()
        self._config.p4info.CopyFrom(schema.p4info)
        self._saved: tuple[p4runtime_pb2.ForwardingPipelineConfig, AtpSchema] | None = None
        self._config_lock = threading.RLock()
        self._stream_ids = itertools.count(1)

    # ------------------------------------------------------------- helpers
    def _check_device(self, device_id: int) -> None:
        if device_id != self.device_id:
            raise not_found(f"unknown device_id {device_id} (this switch is device {self.device_id})")

    def _device_p4info(self, p4info):
        """``p4info`` with this switch's packet width (``agg_values`` cells per slot): a software switch's
        width is fixed when it starts (``--values``), and controllers read it from the P4Info served
        (``innet.p4runtime.schema.packet_values``)."""
        return with_packet_values(p4info, int(self.store.switch.value_count))

    @staticmethod
    def _abort(context: grpc.ServicerContext, err: P4RuntimeError) -> None:
        context.abort(err.grpc_code, err.message)

    # ------------------------------------------------------------- Write
    def Write(self, request: p4runtime_pb2.WriteRequest, context: grpc.ServicerContext):
        try:
            self.arbitrator.check_primary(request.device_id, request.role, election_id_of(request))
            if request.atomicity != p4runtime_pb2.WriteRequest.CONTINUE_ON_ERROR:
                raise P4RuntimeError(code_pb2.UNIMPLEMENTED,
                                     "only CONTINUE_ON_ERROR atomicity is supported")
        except P4RuntimeError as err:
            self._abort(context, err)
        errors: list[p4runtime_pb2.Error] = []
        failed = 0
        with self._config_lock:
            for update in request.updates:
                err_msg = p4runtime_pb2.Error()
                try:
                    self.store.write(update)
                    err_msg.canonical_code = code_pb2.OK
                except P4RuntimeError as err:
                    failed += 1
                    err_msg.canonical_code = err.code
                    err_msg.message = err.message
                    logger.info("write update failed: %s", err)
                except Exception as exc:  # a bug must not kill the batch silently
                    failed += 1
                    logger.exception("write update raised")
                    err_msg.canonical_code = code_pb2.INTERNAL
                    err_msg.message = f"{type(exc).__name__}: {exc}"
                errors.append(err_msg)
        if failed:
            message = f"{failed} of {len(errors)} update(s) failed"
            status = status_pb2.Status(code=code_pb2.UNKNOWN, message=message)
            for err_msg in errors:
                status.details.add().Pack(err_msg)
            context.abort_with_status(_Status(
                grpc.StatusCode.UNKNOWN, message,
                (("grpc-status-details-bin", status.SerializeToString()),)))
        return p4runtime_pb2.WriteResponse()

    # ------------------------------------------------------------- Read
    def Read(self, request: p4runtime_pb2.ReadRequest, context: grpc.ServicerContext):
        try:
            self._check_device(request.device_id)
            batch = p4runtime_pb2.ReadResponse()
            for entity in request.entities:
                for found in self.store.read(entity):
                    batch.entities.append(found)
                    if len(batch.entities) >= _READ_BATCH:
                        yield batch
                        batch = p4runtime_pb2.ReadResponse()
            yield batch
        except P4RuntimeError as err:
            self._abort(context, err)

    # ------------------------------------------------------------- pipeline config
    def SetForwardingPipelineConfig(self, request, context: grpc.ServicerContext):
        Action = p4runtime_pb2.SetForwardingPipelineConfigRequest
        try:
            self.arbitrator.check_primary(request.device_id, request.role, election_id_of(request))
            with self._config_lock:
                if request.action == Action.COMMIT:
                    if request.HasField("config"):
                        raise invalid_argument("COMMIT takes no config")
                    if self._saved is None:
                        raise not_found("no saved config to commit (use VERIFY_AND_SAVE first)")
                    config, schema = self._saved
                    self._saved = None
                    self._install(config, schema, clear=False)
                    return p4runtime_pb2.SetForwardingPipelineConfigResponse()
                if request.action == Action.UNSPECIFIED:
                    raise invalid_argument("action is UNSPECIFIED")
                if not request.HasField("config") or not request.config.HasField("p4info"):
                    raise invalid_argument("config with a P4Info is required")
                schema = AtpSchema.from_p4info(request.config.p4info)
                if request.action == Action.VERIFY:
                    pass
                elif request.action == Action.VERIFY_AND_SAVE:
                    self._saved = (p4runtime_pb2.ForwardingPipelineConfig(), schema)
                    self._saved[0].CopyFrom(request.config)
                elif request.action == Action.VERIFY_AND_COMMIT:
                    self._install(request.config, schema, clear=True)
                elif request.action == Action.RECONCILE_AND_COMMIT:
                    self._install(request.config, schema, clear=False)
                else:
                    raise invalid_argument(f"unknown action {request.action}")
        except P4RuntimeError as err:
            self._abort(context, err)
        return p4runtime_pb2.SetForwardingPipelineConfigResponse()

    def _install(self, config, schema: AtpSchema, clear: bool) -> None:
        if clear:
            self.store.clear_forwarding_state()
        schema = AtpSchema.from_p4info(self._device_p4info(schema.p4info))
        self.store.schema = schema
        self._config = p4runtime_pb2.ForwardingPipelineConfig()
        self._config.CopyFrom(config)
        self._config.p4info.CopyFrom(schema.p4info)
        logger.info("forwarding pipeline '%s' installed (%s)", schema.p4info.pkg_info.name or "?",
                    "state cleared" if clear else "state kept")

    def GetForwardingPipelineConfig(self, request, context: grpc.ServicerContext):
        RT = p4runtime_pb2.GetForwardingPipelineConfigRequest
        try:
            self._check_device(request.device_id)
        except P4RuntimeError as err:
            self._abort(context, err)
        with self._config_lock:
            cfg = self._config
            resp = p4runtime_pb2.GetForwardingPipelineConfigResponse()
            out = resp.config
            if cfg.HasField("cookie"):
                out.cookie.CopyFrom(cfg.cookie)
            if request.response_type in (RT.ALL, RT.P4INFO_AND_COOKIE):
                out.p4info.CopyFrom(cfg.p4info)
            if request.response_type in (RT.ALL, RT.DEVICE_CONFIG_AND_COOKIE):
                out.p4_device_config = cfg.p4_device_config
        return resp

    # ------------------------------------------------------------- capabilities
    def Capabilities(self, request, context: grpc.ServicerContext):
        return p4runtime_pb2.CapabilitiesResponse(p4runtime_api_version=_api_version())

    # ------------------------------------------------------------- stream
    def StreamChannel(self, request_iterator, context: grpc.ServicerContext):
        stream_id = next(self._stream_ids)
        outbox: queue.Queue = queue.Queue()

        def reader() -> None:
            try:
                for req in request_iterator:
                    kind = req.WhichOneof("update")
                    if kind == "arbitration":
                        try:
                            self.arbitrator.update(stream_id, req.arbitration, outbox.put)
                        except P4RuntimeError as err:
                            logger.info("stream %d: arbitration refused: %s", stream_id, err)
                            outbox.put(_Abort(err))
                            return
                    else:
                        outbox.put(self._stream_error(stream_id, req, kind))
            except grpc.RpcError:
                pass                          # client went away / cancelled
            except Exception:
                logger.exception("stream %d: reader failed", stream_id)
            finally:
                outbox.put(_END)

        context.add_callback(lambda: outbox.put(_END))
        threading.Thread(target=reader, name=f"p4rt-stream-{stream_id}", daemon=True).start()
        try:
            while True:
                item = outbox.get()
                if item is _END:
                    return
                if isinstance(item, _Abort):
                    self.arbitrator.remove(stream_id)
                    self._abort(context, item.error)
                yield item
        finally:
            self.arbitrator.remove(stream_id)

    def _stream_error(self, stream_id: int, req, kind: str | None):
        resp = p4runtime_pb2.StreamMessageResponse()
        err = resp.error
        if kind == "packet":
            if self.arbitrator.is_primary(stream_id):
                err.canonical_code = code_pb2.UNIMPLEMENTED
                err.message = "the ATP switch has no CPU port: packet-out is not supported"
            else:
                err.canonical_code = code_pb2.PERMISSION_DENIED
                err.message = "only the primary controller may send packet-out"
            err.packet_out.packet_out.CopyFrom(req.packet)
        elif kind == "digest_ack":
            err.canonical_code = code_pb2.UNIMPLEMENTED
            err.message = "the ATP pipeline has no digests"
            err.digest_list_ack.digest_list_ack.CopyFrom(req.digest_ack)
        else:
            err.canonical_code = code_pb2.UNIMPLEMENTED
            err.message = f"unsupported stream message {kind or '(empty)'}"
            if kind == "other":
                err.other.other.CopyFrom(req.other)
        return resp


class Server:
    """A running P4Runtime server: ``port`` is the bound TCP port; ``stop()`` shuts it down."""

    def __init__(self, grpc_server: grpc.Server, service: P4RuntimeService, host: str, port: int) -> None:
        self._server = grpc_server
        self.service = service
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving; open streams are cancelled after ``grace`` seconds."""
        self._server.stop(grace).wait()
        logger.info("P4Runtime server on %s stopped", self.address)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server terminates (or ``timeout``); True if it did."""
        return self._server.wait_for_termination(timeout)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(switch: SwitchControl, port: int, host: str = "127.0.0.1",
          p4info_path: str | Path | None = None, *, device_id: int = 1,
          max_workers: int = 32, token: str | None = None) -> Server:
    """Serve P4Runtime for ``switch`` on ``host:port`` (port 0 picks a free one), with the ATP P4Info.

    ``p4info_path`` defaults to ``innet/p4/atp.p4info.txtpb``; it must satisfy the binding table.
    Each open StreamChannel holds one of ``max_workers`` threads. ``token``: every call must carry it
    (``innet.p4runtime.auth``; others get UNAUTHENTICATED). None serves without authentication, for a
    switch that only its owner can reach (tests); a shared switch always has a token.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    try:
        schema = AtpSchema.from_p4info(load_p4info(p4info_path))
    except P4RuntimeError as err:
        raise ValueError(str(err)) from err
    service = P4RuntimeService(switch, schema, device_id=device_id)
    # no SO_REUSEPORT: a second server on a busy port must fail, not silently share it
    interceptors = []
    if token is not None:
        interceptors.append(TokenInterceptor(token))
    else:
        logger.warning("P4Runtime server on %s:%d without a token: any local client can control the switch",
                       host, port)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                         thread_name_prefix="p4rt"),
                              options=[("grpc.so_reuseport", 0)], interceptors=interceptors)
    p4runtime_pb2_grpc.add_P4RuntimeServicer_to_server(service, grpc_server)
    try:
        bound = grpc_server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:
        raise OSError(f"cannot bind the P4Runtime server to {host}:{port}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot bind the P4Runtime server to {host}:{port}")
    grpc_server.start()
    logger.info("P4Runtime server for device %d listening on %s:%d", device_id, host, bound)
    return Server(grpc_server, service, host, bound)
