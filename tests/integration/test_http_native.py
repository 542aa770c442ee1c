"""The native HTTP/1.1 transport (``--http-server native``, pdserve.frontends.http.native)
against a real pdserve: tritonclient with compressed requests and responses, raw
pipelined requests, the SSE stream of ``generate_stream`` (chunked), a graceful
shutdown with a request in flight, and the ``--http-server`` flag and its environment
variable."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import ROOT, ServerProcess, copy_models, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("http_native")
    repo = copy_models(root / "repo", "tiny")
    for name in ("decoupled_repeat", "sleepy"):
        shutil.copytree(DATA / name, repo / name)
    proc = start_server(repo, root / "pdserve.log", "--http-server", "native")
    yield proc
    proc.stop()


def _row() -> np.ndarray:
    return np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)


def _tiny_body(rows: int = 1, request_id: str = "") -> bytes:
    x = np.repeat(_row(), rows, axis=0)
    doc = {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [rows, 64], "data": x.ravel().tolist()}
        ]
    }
    if request_id:
        doc["id"] = request_id  # type: ignore[assignment]
    return json.dumps(doc).encode()


def _post(body: bytes, path: str = "/v2/models/tiny/infer", extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


class _Reader:
    """Responses read off a raw socket, one at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def _until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            if not self._fill():
                raise EOFError(self.buf)
        head, _, self.buf = self.buf.partition(sep)
        return head

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise EOFError(self.buf)
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def response(self) -> tuple[int, dict[str, str], bytes]:
        lines = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            return status, headers, self._exactly(int(headers["content-length"]))
        assert headers.get("transfer-encoding") == "chunked", headers
        body = b""
        while True:
            size = int(self._until(b"\r\n"), 16)
            chunk = self._exactly(size + 2)[:-2]
            if not size:
                return status, headers, body
            body += chunk

    def closed(self) -> bool:
        try:
            return not self.buf and not self._fill()
        except ConnectionResetError:
            return True


def _expected(rows: int = 1) -> np.ndarray:
    """tiny's output for ``rows`` copies of :func:`_row`, asked through tritonclient."""
    return np.repeat(_row(), rows, axis=0)


def test_tritonclient_with_compressed_requests_and_responses(server: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        x = np.repeat(_row(), 8, axis=0)
        inp = httpclient.InferInput("INPUT0", [8, 64], "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        plain = client.infer("tiny", [inp]).as_numpy("OUTPUT0")
        assert plain.shape == (8, 64) and np.isfinite(plain).all()
        for algorithm in ("gzip", "deflate"):
            for binary in (False, True):
                inp.set_data_from_numpy(x, binary_data=binary)
                out = client.infer(
                    "tiny",
                    [inp],
                    request_compression_algorithm=algorithm,
                    response_compression_algorithm="gzip",
                ).as_numpy("OUTPUT0")
                np.testing.assert_array_equal(out, plain)
    finally:
        client.close()


def test_gzip_response_and_pipelined_requests_on_one_connection(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        reader = _Reader(sock)
        sock.sendall(_post(_tiny_body(8), extra="accept-encoding: gzip\r\n"))
        status, headers, body = reader.response()
        assert status == 200 and headers["content-encoding"] == "gzip"
        assert headers["vary"] == "accept-encoding"
        first = json.loads(gzip.decompress(body))["outputs"][0]["data"]
        assert len(first) == 8 * 64
        # five pipelined inferences, a bad request, one more: five answers in order,
        # then the 400, then the connection closes
        good = b"".join(_post(_tiny_body(1, f"req-{i}")) for i in range(5))
        sock.sendall(good + b"GET /v2 HTTP/1.1\r\nbad header\r\n\r\n" + _post(_tiny_body()))
        for i in range(5):
            status, headers, body = reader.response()
            doc = json.loads(body)
            assert status == 200 and doc["id"] == f"req-{i}"
            assert doc["outputs"][0]["data"] == first[:64]
        status, headers, body = reader.response()
        assert status == 400 and headers["connection"] == "close"
        assert "Invalid HTTP request" in json.loads(body)["error"]
        assert reader.closed()


def test_generate_stream_is_chunked_server_sent_events(server: ServerProcess) -> None:
    body = json.dumps({"IN": [3, 4, 5]}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        reader = _Reader(sock)
        for _ in range(2):  # and the connection stays usable after the stream
            sock.sendall(_post(body, "/v2/models/decoupled_repeat/generate_stream"))
            status, headers, raw = reader.response()
            assert status == 200 and headers["transfer-encoding"] == "chunked"
            assert headers["content-type"].startswith("text/event-stream")
            events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e]
            assert [(e["OUT"], e["IDX"]) for e in events] == [(3, 0), (4, 1), (5, 2)]
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\n\r\n")
        assert reader.response()[0] == 200


def test_shutdown_finishes_the_request_in_flight(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(DATA / "sleepy", repo / "sleepy")
    proc = start_server(repo, tmp_path / "pdserve.log", "--http-server", "native")
    result: dict[str, object] = {}

    def slow_call() -> None:
        with socket.create_connection(("127.0.0.1", proc.http_port), timeout=60) as sock:
            body = json.dumps(
                {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1], "data": [1.5]}]}
            ).encode()
            sock.sendall(_post(body, "/v2/models/sleepy/infer"))
            result["reply"] = _Reader(sock).response()

    try:
        caller = threading.Thread(target=slow_call)
        caller.start()
        time.sleep(0.5)  # the request is in the model
        proc.proc.send_signal(signal.SIGTERM)
        caller.join(60)
        status, headers, body = result["reply"]  # type: ignore[misc]
        assert status == 200, body
        assert headers["connection"] == "close"  # sent after SIGTERM
        assert json.loads(body)["outputs"][0]["data"] == [1.5]
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop(signal.SIGKILL)


def test_http_server_flag_and_environment_variable(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--http-server {native,asgi}" in out and "PDSERVE_HTTP_SERVER" in out
    env = dict(os.environ, PDSERVE_HTTP_SERVER="bogus")
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--model-repository", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "--http-server" in bad.stderr, bad.stderr
    repo = copy_models(tmp_path / "repo", "tiny")
    for choice, words in (("asgi", "asgi transport"), ("native", "native transport")):
        proc = start_server(repo, tmp_path / f"{choice}.log", "--http-server", choice)
        try:
            client = httpclient.InferenceServerClient(proc.http_url)
            inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
            inp.set_data_from_numpy(_row())
            assert client.infer("tiny", [inp]).as_numpy("OUTPUT0").shape == (1, 64)
            client.close()
        finally:
            proc.stop()
        log = proc.log()
        assert words in log
        assert ("native transport" in log) == (choice == "native")


def _chunked_head(path: str = "/v2/models/tiny/infer") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode()


def test_chunked_trailers_are_not_request_headers(server: ServerProcess) -> None:
    # A trailer field is not a header: a "content-encoding: gzip" trailer must not
    # make the (plain JSON) body be read as gzip.
    body = _tiny_body()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        reader = _Reader(sock)
        sock.sendall(
            _chunked_head() + b"%x\r\n%s\r\n0\r\ncontent-encoding: gzip\r\n\r\n" % (len(body), body)
        )
        status, _, answer = reader.response()
        assert status == 200, answer
        assert len(json.loads(answer)["outputs"][0]["data"]) == 64


def test_huge_trailer_or_chunk_extensions_are_refused_not_buffered(
    server: ServerProcess,
) -> None:
    # Trailer bytes (and chunk extensions) are framing, not body: they count against the
    # header size limit (64 KiB by default); before the fix a trailer field was buffered
    # by the parser without bound until the body timeout (60 s): hundreds of MB each.
    body = _tiny_body()
    for tail in (b"0\r\nx-t: ", b"1;" + b"e" * 1000):
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            reader = _Reader(sock)
            sock.sendall(_chunked_head() + b"%x\r\n%s\r\n" % (len(body), body) + tail)
            sent = 0
            try:
                while sent < 8 * 1024 * 1024:
                    sock.sendall(b"e" * 65536)
                    sent += 65536
            except (BrokenPipeError, ConnectionResetError):
                pass
            sock.settimeout(10)  # before the fix: no answer until the 60 s body timeout
            status, headers, answer = reader.response()
            assert status == 431 and headers["connection"] == "close", answer
            assert b"framing" in answer


def test_refused_request_is_answered_while_the_client_still_sends(server: ServerProcess) -> None:
    # A body over the JSON limit (16 MiB) sent whole before reading, as urllib and
    # requests do, and a request line over the header limit: the 413/431 must reach the
    # client. Before the fix the connection was closed with the rest unread, so the
    # kernel answered with a reset and the client saw ECONNRESET instead of the error.
    huge_body = _post(b"{" + b" " * (20 * 1024 * 1024) + b"}")
    long_line = b"GET /v2/" + b"a" * 1_000_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n"
    for request, expected in ((huge_body, 413), (long_line, 431)):
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(request)
            status, headers, answer = _Reader(sock).response()
            assert status == expected and headers["connection"] == "close", answer


def test_transfer_coding_other_than_chunked_is_refused(server: ServerProcess) -> None:
    # "Transfer-Encoding: gzip, chunked": the chunked framing is undone but gzip is a
    # transfer coding pdserve does not decode (RFC 9112 6.1 suggests 501; a client error
    # here, as every malformed request). Before the fix the gzip bytes were read as the
    # JSON body (a misleading JSON parse error, or a wrong body).
    body = _tiny_body()
    packed = gzip.compress(body)
    head = _chunked_head().replace(b"chunked", b"gzip, chunked")
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        reader = _Reader(sock)
        sock.sendall(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed))
        status, headers, answer = reader.response()
        assert status == 400 and headers["connection"] == "close", answer
        assert b"transfer coding 'gzip' is not implemented" in answer


def _server_side_open(port: int, client_port: int) -> bool:
    """The server's end of the loopback connection from ``client_port`` is established."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local = int(fields[1].split(":")[1], 16)
            remote = int(fields[2].split(":")[1], 16)
            if local == port and remote == client_port and fields[3] == "01":
                return True
    return False


def test_client_that_never_reads_is_closed_after_the_write_timeout(tmp_path: Path) -> None:
    """Write timeout: pipelined requests for 1 MiB outputs, never read; once the write
    buffer is above its high-water mark and does not shrink for the write timeout (2 s),
    the server aborts the connection; another client is served meanwhile."""
    repo = copy_models(tmp_path / "repo", "tiny")
    shutil.copytree(DATA / "identity", repo / "identity")
    srv = start_server(
        repo,
        tmp_path / "pdserve.log",
        "--http-server",
        "native",
        "--http-write-timeout-secs",
        "2",
    )
    try:
        x = np.arange(256 * 1024, dtype=np.float32).reshape(1, -1)  # 1 MiB
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "INPUT0",
                        "datatype": "FP32",
                        "shape": list(x.shape),
                        "parameters": {"binary_data_size": x.nbytes},
                    }
                ],
                "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
            }
        ).encode()
        body = header + x.tobytes()
        one = (
            f"POST /v2/models/identity/infer HTTP/1.1\r\nhost: x\r\n"
            f"content-type: application/octet-stream\r\n"
            f"inference-header-content-length: {len(header)}\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # no autotuning
        sock.settimeout(60)
        sock.connect(("127.0.0.1", srv.http_port))
        client_port = sock.getsockname()[1]

        def send_all() -> None:  # blocks once the server stops reading; ends with the abort
            try:
                sock.sendall(one * 12)  # 12 MiB of responses: more than every buffer
            except OSError:
                pass

        sender = threading.Thread(target=send_all, daemon=True)
        sender.start()
        try:
            # the stall begins within a few seconds (12 responses of the identity model)
            start = time.monotonic()
            closed_after = None
            served = 0
            while time.monotonic() - start < 30:
                if not _server_side_open(srv.http_port, client_port):
                    closed_after = time.monotonic() - start
                    break
                # another client is served meanwhile
                with socket.create_connection(("127.0.0.1", srv.http_port), timeout=10) as s2:
                    s2.sendall(_post(_tiny_body()))
                    status, _, _ = _Reader(s2).response()
                    assert status == 200
                served += 1
                time.sleep(0.5)
            assert closed_after is not None, "the server kept the connection open"
            assert closed_after < 20 and served >= 1, (closed_after, served)
            assert "read none of its" in srv.log()
        finally:
            sock.close()
            sender.join(10)
    finally:
        srv.stop()
