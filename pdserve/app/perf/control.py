"""The control side of ``pdserve perf``: model metadata and configuration, the
statistics extension, and one trial request, over HTTP or gRPC.

Every call is bounded by ``timeout`` seconds. Failures become
:class:`~pdserve.app.perf.options.PerfError` with a message naming the server, the
protocol and what went wrong (connection refused, no answer, the server's own
error text).
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import TYPE_CHECKING
from urllib.parse import quote

from pdserve.app.perf.inputs import HttpRequest
from pdserve.app.perf.options import PerfError

if TYPE_CHECKING:
    from google.protobuf.message import Message


def split_host_port(url: str, default_port: int) -> tuple[str, int]:
    """``[http://]host[:port][/]`` -> (host, port).

    Raises:
        PerfError: the port is not a number.
    """
    rest = url.split("://", 1)[1] if "://" in url else url
    rest = rest.split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or "]" in port:
        return rest.strip("[]") or "localhost", default_port
    try:
        return host.strip("[]") or "localhost", int(port)
    except ValueError:
        raise PerfError(f"'{url}': the port must be a number") from None


def _reason(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (is the server running?)"
    if isinstance(e, TimeoutError | socket.timeout):
        return "no answer in time"
    if isinstance(e, http.client.RemoteDisconnected):
        return "the server closed the connection"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


class HttpControl:
    """Control requests over HTTP/1.1, one keep-alive connection (reopened once on a
    broken connection)."""

    def __init__(self, url: str, model: str, version: str, timeout: float) -> None:
        self.host, self.port = split_host_port(url, 80)
        self.url = f"{self.host}:{self.port}"
        self.model = model
        self.version = version
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _model_path(self) -> str:
        path = f"/v2/models/{quote(self.model, safe='')}"
        return path + (f"/versions/{quote(self.version, safe='')}" if self.version else "")

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """(status, body) of one request.

        Raises:
            PerfError: no connection or no answer within the timeout.
        """
        last: BaseException | None = None
        for _ in range(2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self._conn.request(method, path, body=body, headers=headers or {})
                resp = self._conn.getresponse()
                return resp.status, resp.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as e:
                last = e
                self.close()
                continue
            except (OSError, http.client.HTTPException) as e:
                self.close()
                raise PerfError(f"{method} http://{self.url}{path}: {_reason(e)}") from None
        raise PerfError(f"{method} http://{self.url}{path}: {_reason(last or OSError())}")

    @staticmethod
    def _error_text(body: bytes) -> str:
        text = body.decode(errors="replace").strip()
        try:
            return str(json.loads(text).get("error", text))
        except (ValueError, AttributeError):
            return text[:500]

    def metadata(self) -> dict[str, object]:
        """V2 model metadata.

        Raises:
            PerfError: unreachable, or the model is unknown / not ready.
        """
        status, body = self.request("GET", self._model_path())
        if status != 200:
            raise PerfError(
                f"model '{self.model}' on http://{self.url}: HTTP {status}: {self._error_text(body)}"
            )
        return dict(json.loads(body))

    def config(self) -> dict[str, object] | None:
        """The model configuration (Triton's JSON form), None when the server has no
        such endpoint."""
        try:
            status, body = self.request("GET", self._model_path() + "/config")
        except PerfError:
            return None
        if status != 200:
            return None
        try:
            return dict(json.loads(body))
        except ValueError:
            return None

    def stats(self, all_models: bool = False) -> list[dict[str, object]] | None:
        """``model_stats`` of the statistics extension for the model (every model
        with ``all_models``); None when unsupported or unreachable (a failed reading
        only loses that window's breakdown)."""
        path = "/v2/models/stats" if all_models else self._model_path() + "/stats"
        try:
            status, body = self.request("GET", path)
        except PerfError:
            return None
        if status != 200:
            return None
        try:
            return list(json.loads(body).get("model_stats") or [])
        except (ValueError, AttributeError):
            return None

    def infer(self, request: HttpRequest) -> None:
        """Send one prepared request.

        Raises:
            PerfError: not HTTP 200 (with the server's error text), or unreachable.
        """
        headers = dict(request.headers)
        status, body = self.request("POST", request.path, request.body, headers)
        if status != 200:
            raise PerfError(
                f"the server rejected the request: HTTP {status}: {self._error_text(body)}"
            )

    def close(self) -> None:
        """Close the connection (reopened by the next call)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class GrpcControl:
    """Control requests over gRPC (``inference.GRPCInferenceService``)."""

    def __init__(self, url: str, model: str, version: str, timeout: float) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        host, port = split_host_port(url, 8001)
        self.url = f"{host}:{port}"
        self.model = model
        self.version = version
        self.timeout = timeout
        self._pb = service_pb2
        self._grpc = grpc
        self._channel = grpc.insecure_channel(
            self.url,
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        )
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._infer = self._channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=None,
            response_deserializer=None,
        )

    def _fail(self, what: str, e: Exception) -> PerfError:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        if code == self._grpc.StatusCode.UNAVAILABLE:
            return PerfError(f"{what} on grpc://{self.url}: unavailable ({details})")
        if code == self._grpc.StatusCode.DEADLINE_EXCEEDED:
            return PerfError(f"{what} on grpc://{self.url}: no answer in {self.timeout:g} s")
        name = code.name if code is not None else "error"
        return PerfError(f"{what} on grpc://{self.url}: {name}: {details}")

    def _dict(self, msg: Message) -> dict[str, object]:
        from google.protobuf.json_format import MessageToDict

        return dict(MessageToDict(msg, preserving_proto_field_name=True))

    def metadata(self) -> dict[str, object]:
        """V2 model metadata (JSON form).

        Raises:
            PerfError: unreachable or the model is unknown.
        """
        req = self._pb.ModelMetadataRequest(name=self.model, version=self.version)
        try:
            return self._dict(self._stub.ModelMetadata(req, timeout=self.timeout))
        except self._grpc.RpcError as e:
            raise self._fail(f"model '{self.model}'", e) from None

    def config(self) -> dict[str, object] | None:
        """The model configuration (JSON form), None when unavailable."""
        req = self._pb.ModelConfigRequest(name=self.model, version=self.version)
        try:
            resp = self._stub.ModelConfig(req, timeout=self.timeout)
        except self._grpc.RpcError:
            return None
        return self._dict(resp.config)

    def stats(self, all_models: bool = False) -> list[dict[str, object]] | None:
        """``model_stats`` (JSON form) for the model (every model with
        ``all_models``), None when unsupported or unreachable."""
        if all_models:
            req = self._pb.ModelStatisticsRequest(name="", version="")
        else:
            req = self._pb.ModelStatisticsRequest(name=self.model, version=self.version)
        try:
            resp = self._stub.ModelStatistics(req, timeout=self.timeout)
        except self._grpc.RpcError:
            return None
        rows = self._dict(resp).get("model_stats") or []
        return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []

    def infer(self, request: bytes) -> None:
        """Send one serialized ``ModelInferRequest``.

        Raises:
            PerfError: the call failed (status and details in the message).
        """
        try:
            self._infer(request, timeout=self.timeout)
        except self._grpc.RpcError as e:
            code = e.code()
            if code in (self._grpc.StatusCode.UNAVAILABLE, self._grpc.StatusCode.DEADLINE_EXCEEDED):
                raise self._fail("infer", e) from None
            raise PerfError(
                f"the server rejected the request: {code.name}: {e.details()}"
            ) from None

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()


Control = HttpControl | GrpcControl


def connect(protocol: str, url: str, model: str, version: str, timeout: float) -> Control:
    """A control client for ``protocol`` (``http`` / ``grpc``)."""
    if protocol == "grpc":
        return GrpcControl(url, model, version, timeout)
    return HttpControl(url, model, version, timeout)
