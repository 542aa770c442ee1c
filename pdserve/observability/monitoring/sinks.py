"""Where payload records go: :class:`FileSink` (JSON Lines or Parquet files rolled by
size and age, on a local folder or any fsspec URL such as ``s3://bucket/prefix``) and
:class:`KafkaSink` (one message per event on a topic, through aiokafka, CloudEvents'
Kafka binding in binary mode). Sinks run on the payload logger's thread only; counts are
in requests (the events of one request are written together or lost together).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from typing import Any, Protocol

import orjson

from pdserve.observability.monitoring.events import (
    Entry,
    Event,
    JsonLines,
    Record,
    event_json,
    events_of,
    kafka_headers,
    tensor_row,
)
from pdserve.observability.monitoring.spec import LogSpec

#: s3fs / botocore: give up on an unreachable store quickly (the logger drops and counts).
S3_OPTIONS = {
    "config_kwargs": {"connect_timeout": 3, "read_timeout": 10, "retries": {"max_attempts": 1}}
}


class SinkError(Exception):
    """A write failed; ``lost`` requests' records are gone. ``reason``: ``sink_error``
    (the store or broker failed: the logger backs off) or ``encode_error`` (a record
    could not be encoded)."""

    def __init__(self, message: str, lost: int, reason: str = "sink_error") -> None:
        super().__init__(message)
        self.lost = lost
        self.reason = reason


def encode_error(entries: list[Record], e: Exception) -> SinkError:
    """The SinkError of ``entries`` that could not be encoded (all lost)."""
    return SinkError(
        f"cannot encode a record: {type(e).__name__}: {e}", len(entries), "encode_error"
    )


class Sink(Protocol):
    """What the payload logger writes to (on its own thread)."""

    def write(self, entries: list[Record]) -> int:
        """Take some requests (their events are the sink's to encode, or lines made on
        the request path: only for a sink with ``json_bodies``); return how many
        requests are now written (a buffering sink returns those of the files it closed).

        Raises:
            SinkError: records were lost (``lost`` requests).
        """
        ...

    def tick(self) -> int:
        """Close what is due by age; return the requests written (SinkError as write)."""
        ...

    def close(self) -> int:
        """Write what is buffered and release the sink; return the requests written."""
        ...


def _parquet_schema() -> Any:
    import pyarrow as pa

    tensor = pa.struct(
        [
            ("name", pa.string()),
            ("datatype", pa.string()),
            ("shape", pa.list_(pa.int64())),
            ("data", pa.binary()),
        ]
    )
    fields = [
        (k, pa.string())
        for k in (
            "specversion", "id", "type", "source", "time", "datacontenttype",
            "inferenceservicename", "namespace", "component", "endpoint",
            "modelname", "modelversion", "error",
        )
    ]  # fmt: skip
    return pa.schema([*fields, ("tensors", pa.list_(tensor))])


class FileSink:
    """JSON Lines or Parquet files under ``spec.sink.url``/``model``/, one file per roll:
    a file is closed once ``roll_bytes`` of records are in it or its first record is
    ``roll_secs`` old; a reader never sees a half-written file. Names: ``<UTC time>-<pid>-<seq>.jsonl|.parquet``.
    Local JSON Lines go to ``<name>.tmp`` batch by batch (little memory held) and are
    renamed at the roll; Parquet and object stores are buffered and written whole.

    Raises (constructor):
        ImportError: fsspec, or pyarrow for Parquet, or the store's package is missing.
        OSError: a local folder that cannot be made or written to (a misconfiguration;
            a store's failures are the logger's to count, at run time).
    """

    def __init__(self, spec: LogSpec, model: str, source: str) -> None:
        import fsspec.core

        url = spec.sink.url.rstrip("/")
        options: dict[str, Any] = dict(S3_OPTIONS) if url.startswith(("s3://", "s3a://")) else {}
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root = f"{root.rstrip('/')}/{model}"
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._local = "file" in protocols
        self.format = spec.sink.format
        self.record = spec.record
        self.source = source
        self.encoder = JsonLines(spec.record, source)
        if self.format == "parquet":
            self.schema = _parquet_schema()
        self.roll_bytes = spec.roll_bytes
        self.roll_secs = spec.roll_secs
        self._chunks: list[bytes] = []  #: JSON Lines, in pieces (JsonLines.lines)
        self._rows: list[dict[str, Any]] = []
        self._bytes = 0
        self._requests = 0
        self._since = 0.0
        self._seq = 0
        self.files = 0
        if self._local:  # a folder that cannot be written is a misconfiguration
            os.makedirs(self.root, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(f"{self.root} is not writable")
        #: local JSON Lines are written batch by batch into the file being written
        #: (its descriptor and final path; None: none open)
        self._stream = self._local and self.format == "jsonl"
        self._fd: int | None = None
        self._path = ""

    def _next_path(self) -> str:
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        return f"{self.root}/{stamp}-{os.getpid()}-{self._seq:06d}.{self.format}"

    def _append(self, lines: list[bytes], requests: int) -> None:
        """Local JSON Lines: add ``lines`` to the open ``.tmp`` file (opened first).

        Raises:
            SinkError: the file could not be written: it is removed, and its requests
                are lost with these.
        """
        try:
            if self._fd is None:
                self._path = self._next_path()
                self.fs.makedirs(self.root, exist_ok=True)
                self._fd = os.open(
                    self._path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
                )
            write_all(self._fd, lines)
        except OSError as e:  # full disk, permissions...
            lost = self._requests + requests
            self._drop_file()
            raise SinkError(f"{self._path}: {type(e).__name__}: {e}", lost) from e

    def _drop_file(self) -> None:
        fd, self._fd = self._fd, None
        self._bytes, self._requests = 0, 0
        if fd is not None:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(self._path + ".tmp")

    def write(self, entries: list[Record]) -> int:
        if not entries:
            return 0
        try:
            if self.format == "jsonl":
                lines = self.encoder.lines(entries)
            else:
                rows = [
                    self._row(e)
                    for entry in entries
                    if isinstance(entry, Entry)  # Parquet: never lines (json_bodies False)
                    for e in events_of(entry, self.record, self.source)
                ]
        except Exception as e:  # a tensor that cannot be encoded (should not happen)
            raise encode_error(entries, e) from e
        if not self._requests:
            self._since = time.monotonic()
        if self._stream:
            self._append(lines, len(entries))
            self._bytes += sum(map(len, lines))
        elif self.format == "jsonl":
            self._chunks += lines
            self._bytes += sum(map(len, lines))
        else:
            self._rows += rows
            self._bytes += sum(256 + sum(len(t["data"]) for t in r["tensors"]) for r in rows)
        self._requests += len(entries)
        return self._roll() if self._bytes >= self.roll_bytes else 0

    @staticmethod
    def _row(e: Event) -> dict[str, Any]:
        row: dict[str, Any] = {**e.attributes, "error": e.error}
        row["tensors"] = [tensor_row(n, a) for n, a in (e.tensors or {}).items()]
        return row

    def tick(self) -> int:
        if self._requests and time.monotonic() - self._since >= self.roll_secs:
            return self._roll()
        return 0

    def close(self) -> int:
        return self._roll() if self._requests else 0

    def _close_stream(self) -> int:
        """Local JSON Lines: close the ``.tmp`` file and rename it into place; return its
        requests (SinkError: all lost, the file removed)."""
        n = self._requests
        fd, self._fd = self._fd, None
        self._bytes, self._requests = 0, 0
        if fd is None:
            return 0
        try:
            os.close(fd)
            os.replace(self._path + ".tmp", self._path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(self._path + ".tmp")
            raise SinkError(f"{self._path}: {type(e).__name__}: {e}", n) from e
        self.files += 1
        return n

    def _roll(self) -> int:
        """Close the file (written whole from the buffer, or renamed into place); return
        its requests (SinkError: all lost)."""
        if self._stream:
            return self._close_stream()
        n = self._requests
        chunks, rows = self._chunks, self._rows
        self._chunks, self._rows, self._bytes, self._requests = [], [], 0, 0
        path = self._next_path()
        try:
            if self.format == "jsonl":
                parts = chunks
            else:
                import pyarrow as pa
                import pyarrow.parquet as pq

                buf = io.BytesIO()
                pq.write_table(pa.Table.from_pylist(rows, schema=self.schema), buf)
                parts = [buf.getvalue()]
            self.fs.makedirs(self.root, exist_ok=True)
            if self._local:  # renamed into place: a reader never sees half a file
                fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    write_all(fd, parts)
                finally:
                    os.close(fd)
                self.fs.mv(path + ".tmp", path)
            else:  # an object store takes the whole object at once
                self.fs.pipe_file(path, b"".join(parts))
        except Exception as e:  # full disk, unreachable store, permissions...
            raise SinkError(f"{path}: {type(e).__name__}: {e}", n) from e
        self.files += 1
        return n


#: Buffers one ``writev`` call takes at most (POSIX's IOV_MAX).
IOV_MAX = 1024


def write_all(fd: int, parts: list[bytes]) -> None:
    """Write ``parts`` one after another to the file ``fd`` with ``writev``
    (:data:`IOV_MAX` at a time: the kernel copies each piece once, and the GIL is let go
    during each call).

    Raises:
        OSError: the file cannot be written (a full disk: ``ENOSPC``).
    """
    for i in range(0, len(parts), IOV_MAX):
        batch = parts[i : i + IOV_MAX]
        done = os.writev(fd, batch)
        if done != sum(map(len, batch)):  # short: the rest (or ENOSPC)
            rest = memoryview(b"".join(batch))[done:]
            while rest:
                rest = rest[os.write(fd, rest) :]


class KafkaSink:
    """Each event a message on ``spec.sink.topic`` (key: the request id; value: the V2
    body as JSON; headers: ``ce_*`` attributes), sent by aiokafka on the logger
    thread's own event loop; a send not acknowledged within ``timeout_s`` loses its
    request's records.

    Raises (constructor):
        ImportError: aiokafka is missing.
    """

    def __init__(self, spec: LogSpec, source: str, timeout_s: float = 5.0) -> None:
        import aiokafka

        self._aiokafka = aiokafka
        self.servers = spec.sink.url
        self.topic = spec.sink.topic
        self.record = spec.record
        self.source = source
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._producer: Any = None

    async def _producer_started(self) -> Any:
        if self._producer is None:
            producer = self._aiokafka.AIOKafkaProducer(
                bootstrap_servers=self.servers,
                request_timeout_ms=int(self.timeout_s * 1000),
                acks=1,
                linger_ms=5,
            )
            try:
                await asyncio.wait_for(producer.start(), self.timeout_s)
            except BaseException:
                await producer.stop()
                raise
            self._producer = producer
        return self._producer

    def _messages(
        self, entries: list[Record]
    ) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
        """(key, value, headers) of each event of ``entries`` (never lines: this sink has
        no ``json_bodies``)."""
        out = []
        for entry in entries:
            if not isinstance(entry, Entry):
                continue
            for e in events_of(entry, self.record, self.source):
                value = orjson.dumps(event_json(e)["data"], option=orjson.OPT_SERIALIZE_NUMPY)
                out.append((e.attributes["id"].encode(), value, kafka_headers(e)))
        return out

    async def _send(self, messages: list[tuple[bytes, bytes, list[tuple[str, bytes]]]]) -> None:
        producer = await self._producer_started()
        futures = [
            await producer.send(self.topic, value, key=key, headers=headers)
            for key, value, headers in messages
        ]
        await asyncio.wait_for(asyncio.gather(*futures), self.timeout_s)

    def write(self, entries: list[Record]) -> int:
        if not entries:
            return 0
        try:  # connected first: a broker that is down costs no encoding
            self._loop.run_until_complete(self._producer_started())
            try:
                messages = self._messages(entries)
            except Exception as e:  # a tensor that cannot be encoded (should not happen)
                raise encode_error(entries, e) from e
            self._loop.run_until_complete(self._send(messages))
        except SinkError:
            raise
        except Exception as e:  # broker gone, timeout, topic refused
            self._reset()
            raise SinkError(
                f"kafka {self.servers}/{self.topic}: {type(e).__name__}: {e}", len(entries)
            ) from e
        return len(entries)

    def _reset(self) -> None:
        """Drop the producer after a failure: the next write connects afresh."""
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                self._loop.run_until_complete(asyncio.wait_for(producer.stop(), self.timeout_s))
            except Exception:  # already broken: nothing more to release
                pass

    def tick(self) -> int:
        return 0

    def close(self) -> int:
        self._reset()
        self._loop.close()
        return 0


def make_sink(spec: LogSpec, model: str, source: str) -> Sink:
    """The sink ``spec`` names, for ``model``'s records (events with ``source``).

    Raises:
        ImportError: its package is missing (fsspec / s3fs, pyarrow, aiokafka).
    """
    if spec.sink.kind == "kafka":
        return KafkaSink(spec, source)
    return FileSink(spec, model, source)
