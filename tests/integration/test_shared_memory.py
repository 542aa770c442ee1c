"""Triton's system shared-memory extension against a real pdserve, with tritonclient's
own ``tritonclient.utils.shared_memory`` (unchanged) over HTTP and gRPC.

Inputs and outputs through regions on ``tiny``, ``add_sub`` (two inputs, two
outputs) and ``efficientnet_lite0`` (a 602 KB input); bad keys, sizes and offsets;
overlapping outputs; unregister while a request uses the region; off by default;
CUDA shared memory answered as Triton without GPUs. The server stays up through all of
it.
"""

from __future__ import annotations

import base64
import os
import shutil
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, copy_models, start_server

PY_MODELS = Path(__file__).resolve().parents[1] / "data" / "python_models"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """pdserve with --allow-client-shm serving tiny, efficientnet_lite0, add_sub, sleepy."""
    repo = copy_models(tmp_path_factory.mktemp("repo"), "tiny", "efficientnet_lite0")
    for name in ("add_sub", "sleepy"):
        shutil.copytree(PY_MODELS / name, repo / name)
    srv = start_server(
        repo, tmp_path_factory.mktemp("log") / "pdserve.log", "--allow-client-shm=true"
    )
    yield srv
    srv.stop()


class Regions:
    """Creates POSIX shared-memory objects with tritonclient and destroys them after."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.tag = uuid.uuid4().hex[:8]

    def create(self, name: str, size: int) -> tuple[Any, str]:
        key = f"/pdtest_{self.tag}_{name}"
        handle = shm.create_shared_memory_region(name, key, size)
        self.handles.append(handle)
        return handle, key

    def close(self) -> None:
        for h in self.handles:
            shm.destroy_shared_memory_region(h)


@pytest.fixture()
def regions(server: ServerProcess) -> Iterator[Regions]:
    r = Regions()
    yield r
    httpclient.InferenceServerClient(server.http_url).unregister_system_shared_memory()
    r.close()


def http(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url)


def grpc(server: ServerProcess) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(server.grpc_url)


def _err(fn: Any, *args: Any, **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        fn(*args, **kwargs)
    return e.value


def _ready(server: ServerProcess) -> bool:
    url = f"http://{server.http_url}/v2/health/ready"
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status == 200


# ------------------------------------------------------------------------ data path


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_tiny_inputs_and_outputs_through_regions(
    server: ServerProcess, regions: Regions, proto: str
) -> None:
    mod: Any = httpclient if proto == "http" else grpcclient
    client = http(server) if proto == "http" else grpc(server)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    plain = mod.InferInput("INPUT0", [2, 64], "FP32")
    plain.set_data_from_numpy(x)
    expected = client.infer("tiny", [plain]).as_numpy("OUTPUT0")

    h_in, key_in = regions.create("in", x.nbytes)
    h_out, key_out = regions.create("out", 1024 + x.nbytes)
    shm.set_shared_memory_region(h_in, [x])
    client.register_system_shared_memory("in", key_in, x.nbytes)
    client.register_system_shared_memory("out", key_out, x.nbytes, offset=1024)
    inp = mod.InferInput("INPUT0", [2, 64], "FP32")
    inp.set_shared_memory("in", x.nbytes)
    out = mod.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("out", x.nbytes)
    result = client.infer("tiny", [inp], outputs=[out])
    meta = result.get_output("OUTPUT0")
    if proto == "http":
        assert meta["datatype"] == "FP32" and meta["shape"] == [2, 64]
        assert "data" not in meta and "binary_data_size" not in meta.get("parameters", {})
    else:
        assert meta.datatype == "FP32" and list(meta.shape) == [2, 64]
    got = shm.get_contents_as_numpy(h_out, np.float32, [2, 64], offset=1024)
    np.testing.assert_array_equal(got, expected)

    if proto == "http":
        status = client.get_system_shared_memory_status()
        by_name = {r["name"]: r for r in status}
        assert by_name["out"] == {
            "name": "out",
            "key": key_out,
            "offset": 1024,
            "byte_size": x.nbytes,
        }
        assert client.get_system_shared_memory_status("in") == [
            {"name": "in", "key": key_in, "offset": 0, "byte_size": x.nbytes}
        ]
    else:
        status = client.get_system_shared_memory_status()
        assert set(status.regions) == {"in", "out"}
        assert status.regions["out"].key == key_out and status.regions["out"].offset == 1024
    client.unregister_system_shared_memory("in")
    names = (
        [r["name"] for r in client.get_system_shared_memory_status()]
        if proto == "http"
        else list(client.get_system_shared_memory_status().regions)
    )
    assert names == ["out"]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_add_sub_mixes_shared_memory_and_request_data(
    server: ServerProcess, regions: Regions, proto: str
) -> None:
    """Triton's simple_*_shm_client, with one input and one output in the request."""
    mod: Any = httpclient if proto == "http" else grpcclient
    client = http(server) if proto == "http" else grpc(server)
    a = np.arange(4, dtype=np.float32)
    b = np.full(4, 10, dtype=np.float32)
    h_io, key = regions.create("io", 64)
    shm.set_shared_memory_region(h_io, [a])
    client.register_system_shared_memory("io", key, 64)
    in0 = mod.InferInput("INPUT0", [4], "FP32")
    in0.set_shared_memory("io", 16)
    in1 = mod.InferInput("INPUT1", [4], "FP32")
    in1.set_data_from_numpy(b)
    out0 = mod.InferRequestedOutput("OUTPUT0")
    out0.set_shared_memory("io", 16, offset=32)
    out1 = mod.InferRequestedOutput("OUTPUT1")
    result = client.infer("add_sub", [in0, in1], outputs=[out0, out1])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    # as Triton, the shared-memory output is listed with no data (tritonclient's HTTP
    # as_numpy would raise KeyError('data') on it, against Triton too)
    meta = result.get_output("OUTPUT0")
    assert (meta["datatype"] if proto == "http" else meta.datatype) == "FP32"
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(h_io, np.float32, [4], offset=32), a + b
    )


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_efficientnet_602kb_input_through_a_region_matches_binary(
    server: ServerProcess, regions: Regions, proto: str
) -> None:
    mod: Any = httpclient if proto == "http" else grpcclient
    client = http(server) if proto == "http" else grpc(server)
    x = np.random.default_rng(1).random((1, 3, 224, 224), dtype=np.float32)
    assert x.nbytes == 602112
    plain = mod.InferInput("input", list(x.shape), "FP32")
    plain.set_data_from_numpy(x)
    expected = client.infer("efficientnet_lite0", [plain]).as_numpy("logits")
    h_in, key_in = regions.create("img", x.nbytes)
    h_out, key_out = regions.create("logits", 4000)
    shm.set_shared_memory_region(h_in, [x])
    client.register_system_shared_memory("img", key_in, x.nbytes)
    client.register_system_shared_memory("logits", key_out, 4000)
    inp = mod.InferInput("input", list(x.shape), "FP32")
    inp.set_shared_memory("img", x.nbytes)
    out = mod.InferRequestedOutput("logits")
    out.set_shared_memory("logits", 4000)
    client.infer("efficientnet_lite0", [inp], outputs=[out])
    got = shm.get_contents_as_numpy(h_out, np.float32, [1, 1000])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # the input through a region, the output in the response
    result = client.infer("efficientnet_lite0", [inp])
    np.testing.assert_allclose(result.as_numpy("logits"), expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ bad input


def test_bad_keys_are_refused(server: ServerProcess, regions: Regions, tmp_path: Path) -> None:
    client = http(server)
    _, good = regions.create("good", 64)
    for key, words in [
        ("no_slash", "invalid key"),
        ("/a/b", "invalid key"),
        ("/../etc/passwd", "invalid key"),
        ("/..", "invalid key"),
        ("/", "invalid key"),
        ("/triton_python_backend_shm_region_x", "reserved prefix"),
        (f"/pdtest_missing_{uuid.uuid4().hex}", "no such shared-memory object"),
    ]:
        e = _err(client.register_system_shared_memory, "r", key, 16)
        assert words in e.message(), (key, e.message())
        assert e.status() == "400", key
    # a symlink in /dev/shm to a file outside it
    outside = tmp_path / "secret"
    outside.write_bytes(b"x" * 64)
    link = Path(f"/dev/shm/pdtest_{regions.tag}_link")
    link.symlink_to(outside)
    try:
        e = _err(client.register_system_shared_memory, "r", "/" + link.name, 16)
        assert "symbolic link" in e.message()
    finally:
        link.unlink()
    # a directory
    d = Path(f"/dev/shm/pdtest_{regions.tag}_dir")
    d.mkdir()
    try:
        e = _err(client.register_system_shared_memory, "r", "/" + d.name, 16)
        assert "directory" in e.message() or "not a regular file" in e.message()
    finally:
        d.rmdir()
    if os.geteuid() == 0:  # an object owned by another user
        other = Path(f"/dev/shm/pdtest_{regions.tag}_other")
        other.write_bytes(b"\0" * 64)
        os.chown(other, 65534, 65534)
        try:
            e = _err(client.register_system_shared_memory, "r", "/" + other.name, 16)
            assert "not owned by the server's user" in e.message()
        finally:
            other.unlink()
    assert client.get_system_shared_memory_status() == []
    client.register_system_shared_memory("r", good, 64)
    e = _err(client.register_system_shared_memory, "r", good, 64)
    assert "already in manager" in e.message() and e.status() == "400"
    g = grpc(server)
    with pytest.raises(InferenceServerException) as ge:
        g.register_system_shared_memory("r", good, 64)
    assert ge.value.status() == "StatusCode.ALREADY_EXISTS"
    with pytest.raises(InferenceServerException) as ge:
        g.register_system_shared_memory("r2", "/a/../b", 64)
    assert ge.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert _ready(server)


def test_bad_sizes_and_offsets_at_registration(server: ServerProcess, regions: Regions) -> None:
    client = http(server)
    _, key = regions.create("small", 64)
    for offset, size, words in [
        (0, 65, "past the end"),
        (60, 8, "past the end"),
        (0, 0, "'byte_size' must be an integer > 0"),
        (-1, 8, "'offset' must be an integer >= 0"),
    ]:
        e = _err(client.register_system_shared_memory, "r", key, size, offset=offset)
        assert words in e.message(), (offset, size, e.message())
    # wrong JSON types, straight to the endpoint
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/systemsharedmemory/region/r/register",
        data=b'{"key": 5, "byte_size": "8"}',
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=10)
    assert he.value.code == 400 and b"'key' must be a string" in he.value.read()
    e = _err(client.get_system_shared_memory_status, "nope")
    assert e.status() == "404" and "Unable to find system shared memory region" in e.message()
    client.unregister_system_shared_memory("nope")  # as Triton: nothing to do, no error


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_bad_use_in_requests(server: ServerProcess, regions: Regions, proto: str) -> None:
    mod: Any = httpclient if proto == "http" else grpcclient
    client = http(server) if proto == "http" else grpc(server)
    h, key = regions.create("r", 256)
    shm.set_shared_memory_region(h, [np.ones(64, dtype=np.float32)])
    client.register_system_shared_memory("r", key, 256)

    def infer_input(region: str, size: int, offset: int = 0) -> str:
        inp = mod.InferInput("INPUT0", [1, 64], "FP32")
        inp.set_shared_memory(region, size, offset)
        return _err(client.infer, "tiny", [inp]).message()

    assert "does not match the 256 bytes" in infer_input("r", 128)
    assert "past the end of region 'r'" in infer_input("r", 256, offset=4)
    # as Triton: an unknown region is NOT_FOUND (HTTP 404), "Unable to find shared memory
    # region: 'nope'"
    inp = mod.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_shared_memory("nope", 256)
    e = _err(client.infer, "tiny", [inp])
    assert e.status() == ("404" if proto == "http" else "StatusCode.NOT_FOUND")
    assert "Unable to find shared memory region: 'nope'" in e.message()

    inp = mod.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.ones((1, 64), dtype=np.float32))
    out = mod.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("r", 128)
    assert (
        "should be at least 256 bytes" in _err(client.infer, "tiny", [inp], outputs=[out]).message()
    )
    out.set_shared_memory("r", 256, offset=128)
    assert (
        "past the end of region 'r'" in _err(client.infer, "tiny", [inp], outputs=[out]).message()
    )

    # two outputs overlapping in one file (add_sub: OUTPUT0 and OUTPUT1, 16 bytes each)
    a = mod.InferInput("INPUT0", [4], "FP32")
    a.set_data_from_numpy(np.ones(4, dtype=np.float32))
    b = mod.InferInput("INPUT1", [4], "FP32")
    b.set_data_from_numpy(np.ones(4, dtype=np.float32))
    o0 = mod.InferRequestedOutput("OUTPUT0")
    o0.set_shared_memory("r", 16)
    o1 = mod.InferRequestedOutput("OUTPUT1")
    o1.set_shared_memory("r", 16, offset=8)
    assert (
        "overlap in shared memory"
        in _err(client.infer, "add_sub", [a, b], outputs=[o0, o1]).message()
    )
    o1.set_shared_memory("r", 16, offset=16)  # adjacent, not overlapping: fine
    client.infer("add_sub", [a, b], outputs=[o0, o1])
    np.testing.assert_array_equal(
        shm.get_contents_as_numpy(h, np.float32, [8]), [2, 2, 2, 2, 0, 0, 0, 0]
    )
    assert _ready(server)


def test_bad_parameter_types(server: ServerProcess) -> None:
    body = (
        b'{"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 64], '
        b'"parameters": {"shared_memory_region": "r", "shared_memory_byte_size": -4}}]}'
    )
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/tiny/infer", data=body, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=10)
    assert he.value.code == 400
    assert b"'shared_memory_byte_size' must be an integer > 0" in he.value.read()


def test_truncated_region_is_an_error_not_a_crash(server: ServerProcess, regions: Regions) -> None:
    client = http(server)
    h, key = regions.create("t", 256)
    client.register_system_shared_memory("t", key, 256)
    os.truncate("/dev/shm/" + key[1:], 16)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_shared_memory("t", 256)
    assert "was truncated" in _err(client.infer, "tiny", [inp]).message()
    out = httpclient.InferRequestedOutput("OUTPUT0")
    out.set_shared_memory("t", 256)
    plain = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    plain.set_data_from_numpy(np.ones((1, 64), dtype=np.float32))
    assert "was truncated" in _err(client.infer, "tiny", [plain], outputs=[out]).message()
    assert _ready(server)


def test_unregister_while_in_use_finishes_the_request(
    server: ServerProcess, regions: Regions
) -> None:
    """The name goes at once; the running request still reads and writes its region."""
    client = http(server)
    h, key = regions.create("slow", 8)
    shm.set_shared_memory_region(h, [np.array([1.5], dtype=np.float32)])
    client.register_system_shared_memory("slow", key, 8)
    inp = httpclient.InferInput("X", [1], "FP32")
    inp.set_shared_memory("slow", 4)
    out = httpclient.InferRequestedOutput("Y")
    out.set_shared_memory("slow", 4, offset=4)
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["result"] = http(server).infer("sleepy", [inp], outputs=[out])
        except Exception as exc:  # noqa: BLE001 - reported below
            done["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    client.unregister_system_shared_memory("slow")
    assert client.get_system_shared_memory_status() == []
    inp2 = httpclient.InferInput("X", [1], "FP32")
    inp2.set_shared_memory("slow", 4)
    assert "Unable to find shared memory region" in _err(client.infer, "sleepy", [inp2]).message()
    t.join(60)
    assert "error" not in done, done.get("error")
    np.testing.assert_array_equal(shm.get_contents_as_numpy(h, np.float32, [2]), [1.5, 1.5])


def test_metadata_lists_the_extension_when_on(server: ServerProcess) -> None:
    assert "system_shared_memory" in http(server).get_server_metadata()["extensions"]
    assert "system_shared_memory" in grpc(server).get_server_metadata().extensions


def test_cuda_shared_memory_answers_as_triton_without_gpus(server: ServerProcess) -> None:
    """No CUDA region can be registered here; status and unregister answer as Triton's
    do then (a client's start-up ``unregister_cuda_shared_memory()`` works), register is
    a clear 400 / INVALID_ARGUMENT."""
    h, g = http(server), grpc(server)
    h.unregister_cuda_shared_memory()
    h.unregister_cuda_shared_memory("never_registered")
    assert h.get_cuda_shared_memory_status() == []
    g.unregister_cuda_shared_memory()
    g.unregister_cuda_shared_memory("never_registered")
    assert len(g.get_cuda_shared_memory_status().regions) == 0
    e = _err(h.get_cuda_shared_memory_status, "c")
    assert e.status() == "404" and "Unable to find cuda shared memory region: 'c'" in e.message()
    with pytest.raises(InferenceServerException) as ge:
        g.get_cuda_shared_memory_status("c")
    assert ge.value.status() == "StatusCode.NOT_FOUND"
    handle = base64.b64encode(bytes(64)).decode()  # a cudaIpcMemHandle_t's size, zeros
    e = _err(h.register_cuda_shared_memory, "c", handle, 0, 64)
    assert e.status() == "400"
    assert "failed to register CUDA shared memory region: 'c', GPUs not supported" in e.message()
    with pytest.raises(InferenceServerException) as ge:
        g.register_cuda_shared_memory("c", handle, 0, 64)
    assert ge.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "GPUs not supported" in ge.value.message()
    assert _ready(server)


# ------------------------------------------------------------------------ off by default


def test_off_by_default(tmp_path: Path) -> None:
    srv = start_server(copy_models(tmp_path / "repo", "tiny"), tmp_path / "log")
    regions = Regions()
    try:
        h, key = regions.create("r", 256)
        client = http(srv)
        e = _err(client.register_system_shared_memory, "r", key, 256)
        assert e.status() == "501" and "--allow-client-shm" in e.message()
        e = _err(client.get_system_shared_memory_status)
        assert "--allow-client-shm" in e.message()
        inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
        inp.set_shared_memory("r", 256)
        assert "--allow-client-shm" in _err(client.infer, "tiny", [inp]).message()
        with pytest.raises(InferenceServerException) as ge:
            grpc(srv).register_system_shared_memory("r", key, 256)
        assert ge.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "system_shared_memory" not in client.get_server_metadata()["extensions"]
        e = _err(client.unregister_cuda_shared_memory)  # off: CUDA calls as system ones
        assert e.status() == "501" and "--allow-client-shm" in e.message()
        assert _ready(srv)
    finally:
        srv.stop()
        regions.close()
