"""pdserve.observability.monitoring.sinks: the file sink rolls whole files by size and
age (JSON Lines and Parquet read back equal), a failed write is a SinkError counting the
lost requests, and the Kafka sink fails the same way when no broker answers."""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pdserve.observability.monitoring.events import Entry, tensor_from_row
from pdserve.observability.monitoring.sinks import FileSink, KafkaSink, SinkError, make_sink
from pdserve.observability.monitoring.spec import LogSpec


def _spec(text: str) -> LogSpec:
    spec = LogSpec.parse(text)
    assert spec is not None
    return spec


def _requests(n: int) -> list[Entry]:
    out = []
    for i in range(n):
        x = np.full((1, 4), i, dtype=np.float32)
        out.append(Entry(f"r{i}", "m", "1", time.time_ns(), {"IN": x}, {"OUT": x * 2}, None, {}))
    return out


def test_jsonl_rolls_by_size(tmp_path: Path) -> None:
    sink = FileSink(_spec(f"sink=jsonl:{tmp_path},roll_mb=0.001"), "m", "s")  # ~1 KB files
    written = sum(sink.write([r]) for r in _requests(10)) + sink.close()
    assert written == 10
    files = sorted((tmp_path / "m").iterdir())
    assert len(files) > 1 and all(f.suffix == ".jsonl" for f in files)
    lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    assert len(lines) == 20  # request + response per request
    assert [x["id"] for x in lines[::2]] == [f"r{i}" for i in range(10)]
    assert lines[3]["data"]["outputs"][0]["data"] == [2.0, 2.0, 2.0, 2.0]


def test_parquet_rolls_by_age(tmp_path: Path) -> None:
    sink = make_sink(_spec(f"sink=parquet:{tmp_path},roll_secs=0.05"), "m", "s")
    assert sink.write(_requests(3)) == 0 and sink.tick() == 0  # buffered, young
    time.sleep(0.06)
    assert sink.tick() == 3
    rows = pq.read_table(next((tmp_path / "m").glob("*.parquet"))).to_pylist()
    assert len(rows) == 6 and rows[5]["id"] == "r2"
    np.testing.assert_array_equal(tensor_from_row(rows[5]["tensors"][0]), np.full((1, 4), 4.0))
    assert not list((tmp_path / "m").glob("*.tmp"))


def test_failed_write_loses_its_requests(tmp_path: Path) -> None:
    """A folder that cannot be made fails the sink at once (a misconfiguration: the load
    fails); one that goes away later loses the requests of the write, counted."""
    blocker = tmp_path / "file"
    blocker.write_text("a file where the sink wants a folder")
    with pytest.raises(NotADirectoryError):
        FileSink(_spec(f"sink=jsonl:{blocker},roll_mb=0.000001"), "m", "s")
    sink = FileSink(_spec(f"sink=jsonl:{tmp_path / 'logs'},roll_mb=0.000001"), "m", "s")
    shutil.rmtree(tmp_path / "logs")
    (tmp_path / "logs").write_text("the folder is a file now")
    with pytest.raises(SinkError) as e:
        sink.write(_requests(2))
    assert e.value.lost == 2 and "logs" in str(e.value) and e.value.reason == "sink_error"


def test_an_entry_that_cannot_be_encoded_is_an_encode_error(tmp_path: Path) -> None:
    sink = FileSink(_spec(f"sink=jsonl:{tmp_path}"), "m", "s")
    bad = Entry("r", "m", "1", 0, {"IN": np.zeros(2, dtype=np.complex64)}, None, None, {})
    with pytest.raises(SinkError) as e:
        sink.write([*_requests(2), bad])
    assert (e.value.lost, e.value.reason) == (3, "encode_error")
    assert sink.write(_requests(1)) == 0 and sink.close() == 1  # the sink goes on


def test_kafka_sink_without_a_broker() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens
    sink = KafkaSink(_spec(f"sink=kafka://127.0.0.1:{port}/t"), "s", timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(SinkError) as e:
        sink.write(_requests(3))
    assert e.value.lost == 3 and time.monotonic() - start < 10
    sink.close()
