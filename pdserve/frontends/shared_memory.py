"""Triton's system shared-memory extension: the registry of client regions
(:class:`SharedMemoryRegistry`), and the reading of inputs from / writing of outputs
into them; and the CUDA extension's answers without GPU support. Both frontends use it.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from pdserve.core.datatypes import V2_TO_NUMPY, deserialize_bytes_tensor, serialize_bytes_tensor
from pdserve.core.errors import ErrorCode, InferError, internal, unsupported
from pdserve.core.types import InferRequest, InferResponse

__all__ = [
    "MAX_REGIONS",
    "SHM_DIR",
    "SharedMemoryRegistry",
    "ShmInput",
    "infer_with_shm",
    "region_not_found",
    "shm_output_names",
    "shm_params",
    "with_shm_extension",
]

#: Where POSIX shared-memory objects live on Linux (``shm_open("/k")`` is ``SHM_DIR/k``).
SHM_DIR = "/dev/shm"

#: Shared-memory inputs (or outputs) of more bytes than this, in one request, are
#: copied on a worker thread rather than on the event loop.
OFFLOAD_BYTES = 1 << 20

#: The most regions registered at once (each holds an open descriptor).
MAX_REGIONS = 1024

#: Key prefixes (after the ``/``) a client may not register.
RESERVED_PREFIXES = ("triton_", "sem.")

_DISABLED = (
    "system shared memory is disabled on this server; start pdserve with "
    "--allow-client-shm to allow clients to register shared-memory regions"
)


def region_not_found(name: str, where: str) -> InferError:
    """A request names region ``name`` (for the tensor ``where``, e.g. ``"input 'x'"``)
    that is not registered: NOT_FOUND (HTTP 404, gRPC NOT_FOUND) with Triton's message
    (``SharedMemoryManager::GetMemoryInfo``: ``TRITONSERVER_ERROR_NOT_FOUND``, "Unable to
    find shared memory region: 'name'"), the tensor named after it."""
    return InferError(
        f"Unable to find shared memory region: '{name}' (named by {where})", ErrorCode.NOT_FOUND
    )


@dataclass(slots=True)
class ShmInput:
    """An input a request sends through a region: what the codec read, resolved by
    :meth:`SharedMemoryRegistry.read_inputs`.

    Attributes:
        datatype: V2 datatype; shape: the input's shape; count: its element count.
        region / byte_size / offset: the ``shared_memory_*`` parameters.
    """

    datatype: str
    shape: list[int]
    count: int
    region: str
    byte_size: int
    offset: int


@dataclass(slots=True, eq=False)
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    writable: bool
    users: int = 0
    registered: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)


def shm_params(params: Mapping[str, object], where: str) -> tuple[str, int, int]:
    """``(region, byte_size, offset)`` from a tensor's parameters (which hold
    ``shared_memory_region``).

    Raises:
        InferError(INVALID_ARG): the region is not a non-empty string, the byte size is
            missing or not an integer > 0, the offset not an integer >= 0; names
            ``where`` (e.g. ``"input 'x'"``).
    """
    region = params["shared_memory_region"]
    if type(region) is not str or not region:
        raise InferError(f"{where} parameter 'shared_memory_region' must be a non-empty string")
    size = params.get("shared_memory_byte_size")
    if size is None:
        raise InferError(
            f"{where} names shared memory region '{region}' but has no "
            "'shared_memory_byte_size' parameter"
        )
    if type(size) is not int or size <= 0:
        raise InferError(f"{where} parameter 'shared_memory_byte_size' must be an integer > 0")
    offset = params.get("shared_memory_offset", 0)
    if type(offset) is not int or offset < 0:
        raise InferError(f"{where} parameter 'shared_memory_offset' must be an integer >= 0")
    return region, size, offset


def with_shm_extension(meta: Any, registry: SharedMemoryRegistry) -> Any:
    """Server metadata with ``system_shared_memory`` added to its ``extensions`` when
    the registry is enabled (``--allow-client-shm``); unchanged otherwise."""
    if not registry.enabled or not isinstance(meta, dict):
        return meta
    extensions = list(meta.get("extensions", []))
    if "system_shared_memory" not in extensions:
        extensions.append("system_shared_memory")
    return {**meta, "extensions": extensions}


def shm_output_names(request: InferRequest) -> frozenset[str] | None:
    """The outputs ``request`` asks to have written into shared memory (their
    ``parameters`` name a ``shared_memory_region``); ``None`` when there are none."""
    if not request.outputs:
        return None
    names = [
        o.name for o in request.outputs if o.parameters and "shared_memory_region" in o.parameters
    ]
    return frozenset(names) if names else None


async def infer_with_shm(
    registry: SharedMemoryRegistry,
    request: InferRequest,
    infer: Callable[[InferRequest], Awaitable[InferResponse]],
    shm_outputs: frozenset[str] | None,
) -> InferResponse:
    """Run ``infer(request)`` for a request that uses shared memory: take hold of its
    regions (an unregister meanwhile closes them only after this returns), copy its
    shared-memory inputs into ``request.inputs``, infer, and write the outputs named
    in ``shm_outputs`` into their regions. The response keeps those outputs (the
    encoders send their datatype and shape only).

    Raises:
        InferError: as :meth:`SharedMemoryRegistry.read_inputs` /
            :meth:`SharedMemoryRegistry.write_outputs`, and whatever ``infer`` raises.
    """
    delegate = registry.delegate_infer
    if delegate is not None:  # an HTTP front-end worker: the main process does it all
        return await delegate(request, shm_outputs)
    wanted: dict[str, tuple[str, int, int]] = {}
    if shm_outputs is not None and request.outputs:
        for o in request.outputs:
            if o.name in shm_outputs:
                wanted[o.name] = shm_params(o.parameters, f"output '{o.name}'")
    refs: dict[str, ShmInput] = request.shm_inputs or {}
    names = [(ref.region, f"input '{n}'") for n, ref in refs.items()]
    names += [(w[0], f"output '{n}'") for n, w in wanted.items()]
    held = registry.acquire(names)
    try:
        if refs:
            if sum(r.byte_size for r in refs.values()) <= OFFLOAD_BYTES:
                arrays = registry.read_inputs(refs, held)
            else:  # a large copy would stall every other call on the event loop
                arrays = await asyncio.to_thread(registry.read_inputs, refs, held)
            request.inputs.update(arrays)
            request.shm_inputs = None
        response = await infer(request)
        if wanted:
            if sum(w[1] for w in wanted.values()) <= OFFLOAD_BYTES:
                registry.write_outputs(response.outputs, wanted, held)
            else:
                await asyncio.to_thread(registry.write_outputs, response.outputs, wanted, held)
        return response
    finally:
        registry.release(held)


def _check_key(name: str, key: object) -> str:
    if type(key) is not str:
        raise InferError(f"shared memory region '{name}': 'key' must be a string")
    base = key[1:]
    if (
        not key.startswith("/")
        or not base
        or "/" in base
        or "\0" in key
        or base in (".", "..")
        or len(key.encode("utf-8", "replace")) > 255
    ):
        raise InferError(
            f"failed to register shared memory region '{name}': invalid key '{key[:80]}': "
            "expected '/name' as shm_open takes it (one leading '/', no other '/')"
        )
    for prefix in RESERVED_PREFIXES:
        if base.startswith(prefix):
            raise InferError(
                f"cannot register shared memory region '{name}' with key '{key}' as the key "
                f"contains the reserved prefix '{prefix}'"
            )
    return key


class SharedMemoryRegistry:
    """The system shared-memory regions clients registered.

    Protocol source: Triton's ``docs/protocol/extension_shared_memory.md`` and
    ``src/shared_memory_manager.cc``. A client creates a POSIX shared-memory object
    (``shm_open("/name")``, i.e. the file ``/dev/shm/name``), registers a window of it
    under a region name (``key``, ``offset``, ``byte_size``), and then names the region in
    an input's or an output's parameters: ``shared_memory_region``,
    ``shared_memory_byte_size`` and optionally ``shared_memory_offset`` (bytes from the
    start of the registered window). An input is then read from the region instead of
    the request; an output is written into it and the response carries its name,
    datatype and shape but no data.

    Rules (where Triton is silent or looser, pdserve's choice, documented in docs/user-guide/shared-memory.md):

    - Off unless the server runs with ``--allow-client-shm`` (Triton's flag, off by
      default since 26.04). Off: every endpoint and every request naming a region is
      answered UNSUPPORTED ("start pdserve with --allow-client-shm").
    - Keys: ``/name`` exactly as ``shm_open`` takes it: one leading ``/``, no other
      ``/``, not ``/.`` or ``/..``, no NUL, at most 255 bytes; not starting with
      ``triton_`` (reserved by Triton) or ``sem.`` (POSIX named semaphores). The file is
      ``/dev/shm/name``, opened with ``O_NOFOLLOW`` (a symlink is refused), it must be a
      regular file owned by the server's user (another user's object is refused even
      when its mode would let the server read it).
    - Bounds: ``offset >= 0``, ``byte_size > 0``, ``offset + byte_size`` within the file
      at registration; each use checks ``shared_memory_offset + shared_memory_byte_size``
      within the registered window, and the file's size again (a client may shrink it).
    - Reading and writing use ``pread``/``pwrite`` on a descriptor held open while the
      region is registered, not ``mmap``: a client that truncates the file under an
      ``mmap`` makes the server's next access die of SIGBUS (Triton maps the region and
      has that failure); a short ``pread`` is an error answer instead.
    - Inputs are **copied** out of the region before the request is queued (Triton reads
      in place): a client that rewrites the region while the request runs cannot change
      the tensor a model sees half-way.
    - Outputs are written after the model has answered, with ``pwrite``; an output
      larger than its ``shared_memory_byte_size`` is an error (Triton's message). Two
      outputs of one request whose byte ranges in the same file overlap are refused
      (the result would depend on write order); an output overlapping an input of the
      same request is allowed (inputs were copied first).
    - Unregistering a region that a request is using does not wait and is not refused:
      the name is gone at once (new requests naming it get an error), and the
      descriptor is closed when the last request using it finishes, as Triton keeps a
      region's mapping alive (a ``shared_ptr``) until its users are done.
    - A region opened read-only (the file is not writable by the server's user) serves
      inputs; an output into it is refused.
    - At most :data:`MAX_REGIONS` regions at once (each holds a descriptor).

    Thread-safe: the frontends call it from the event loop and from codec threads.

    Args:
        enabled: ``--allow-client-shm``; False: every call raises UNSUPPORTED.
        shm_dir: where keys are looked up (tests may point elsewhere; default
            :data:`SHM_DIR`).
    """

    def __init__(self, enabled: bool = False, shm_dir: str = SHM_DIR) -> None:
        self.enabled = enabled
        self.shm_dir = shm_dir
        #: Set in an HTTP front-end worker (``--http-workers``): requests that name
        #: regions are run by ``delegate_infer(request, shm_outputs)`` in the main
        #: process, where the regions are registered
        #: (:class:`pdserve.frontends.workers.proxy.ProxySharedMemory`); None here.
        self.delegate_infer: (
            Callable[[InferRequest, frozenset[str] | None], Awaitable[InferResponse]] | None
        ) = None
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise unsupported(_DISABLED)

    # -------------------------------------------------------------- control API

    def register(self, name: str, key: object, offset: object, byte_size: object) -> None:
        """Register ``byte_size`` bytes at ``offset`` of the object ``key`` as ``name``.

        Raises:
            InferError(UNSUPPORTED): the extension is off.
            InferError(ALREADY_EXISTS): ``name`` is registered.
            InferError(INVALID_ARG): empty name; bad key (see the module docstring); an
                offset or byte size that is not an integer (offset >= 0, size > 0) or
                runs past the file's end; the file is missing, not a regular file, a
                symlink, not owned by the server's user, or cannot be opened; too many
                regions.
        """
        self._check_enabled()
        if type(name) is not str or not name:
            raise InferError("shared memory region name must be a non-empty string")
        key = _check_key(name, key)
        if type(offset) is not int or offset < 0:
            raise InferError(
                f"failed to register shared memory region '{name}': 'offset' must be an "
                "integer >= 0"
            )
        if type(byte_size) is not int or byte_size <= 0:
            raise InferError(
                f"failed to register shared memory region '{name}': 'byte_size' must be an "
                "integer > 0"
            )
        with self._lock:
            if name in self._regions:
                raise InferError(
                    f"shared memory region '{name}' already in manager", ErrorCode.ALREADY_EXISTS
                )
            if len(self._regions) >= MAX_REGIONS:
                raise InferError(
                    f"failed to register shared memory region '{name}': {MAX_REGIONS} regions "
                    "are registered already; unregister some first"
                )
        fd, writable = self._open(name, key)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InferError(
                    f"failed to register shared memory region '{name}': key '{key}' is not a "
                    "regular file"
                )
            if st.st_uid != os.geteuid():
                raise InferError(
                    f"failed to register shared memory region '{name}': key '{key}' is not "
                    "owned by the server's user"
                )
            if offset + byte_size > st.st_size:
                raise InferError(
                    f"failed to register shared memory region '{name}': invalid args: offset "
                    f"{offset} + byte_size {byte_size} is past the end of '{key}' "
                    f"({st.st_size} bytes)"
                )
            region = _Region(name, key, offset, byte_size, fd, writable)
            with self._lock:
                if name in self._regions:
                    raise InferError(
                        f"shared memory region '{name}' already in manager",
                        ErrorCode.ALREADY_EXISTS,
                    )
                self._regions[name] = region
        except BaseException:
            os.close(fd)
            raise

    def _open(self, name: str, key: str) -> tuple[int, bool]:
        path = os.path.join(self.shm_dir, key[1:])
        flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            return os.open(path, os.O_RDWR | flags), True
        except PermissionError:
            pass
        except OSError as exc:
            raise self._open_error(name, key, exc) from None
        try:
            return os.open(path, os.O_RDONLY | flags), False
        except OSError as exc:
            raise self._open_error(name, key, exc) from None

    @staticmethod
    def _open_error(name: str, key: str, exc: OSError) -> InferError:
        import errno

        why = {
            errno.ENOENT: "no such shared-memory object",
            errno.ELOOP: "the key is a symbolic link",
            errno.EACCES: "permission denied",
            errno.EISDIR: "the key is a directory",
        }.get(exc.errno or 0, exc.strerror or "cannot open")
        return InferError(f"Unable to open shared memory region: '{key}' ({why}) for '{name}'")

    def unregister(self, name: str = "") -> None:
        """Unregister ``name``, or every region when ``name`` is empty (Triton's
        unregister-all). A region in use is closed when its last request finishes.

        Raises:
            InferError(UNSUPPORTED): the extension is off. (As Triton, unregistering a
                name that is not registered succeeds: there is nothing to do.)
        """
        self._check_enabled()
        with self._lock:
            if name:
                gone = [self._regions.pop(name)] if name in self._regions else []
            else:
                gone = list(self._regions.values())
                self._regions.clear()
        for region in gone:
            with region.lock:
                region.registered = False
                close = region.users == 0
            if close:
                os.close(region.fd)

    def status(self, name: str = "") -> list[dict[str, object]]:
        """``[{name, key, offset, byte_size}]`` of ``name`` or of every region [the
        extension's status JSON].

        Raises:
            InferError(UNSUPPORTED): the extension is off.
            InferError(NOT_FOUND): ``name`` is not registered (Triton: "Unable to find
                system shared memory region: 'name'").
        """
        self._check_enabled()
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None:
                    raise InferError(
                        f"Unable to find system shared memory region: '{name}'",
                        ErrorCode.NOT_FOUND,
                    )
                regions = [region]
            else:
                regions = list(self._regions.values())
        return [
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for r in regions
        ]

    # ------------------------------------------------ CUDA shared memory (none)
    # pdserve maps no CUDA IPC handles (it serves tensors from host memory), so no CUDA
    # region is ever registered; these answer as Triton does then (``http_server.cc``
    # ``HandleCudaSharedMemory``, ``grpc_server.cc``, ``SharedMemoryManager``), and with
    # --allow-client-shm off they are UNSUPPORTED as the system extension's calls are.

    def cuda_status(self, name: str = "") -> list[dict[str, object]]:
        """CUDA regions: ``[]`` for all (``GetStatus`` of no region of that kind).

        Raises:
            InferError(UNSUPPORTED): the extension is off.
            InferError(NOT_FOUND): ``name`` given: "Unable to find cuda shared memory
                region: 'name'" (Triton's message).
        """
        self._check_enabled()
        if name:
            raise InferError(
                f"Unable to find cuda shared memory region: '{name}'", ErrorCode.NOT_FOUND
            )
        return []

    def cuda_unregister(self, name: str = "") -> None:
        """Unregister CUDA region ``name`` (empty: all): nothing to do, success, as
        Triton's ``UnregisterHelper`` skips a name it does not hold (a client's usual
        start-up ``unregister_cuda_shared_memory()`` works).

        Raises:
            InferError(UNSUPPORTED): the extension is off.
        """
        self._check_enabled()

    def cuda_register(self, name: str) -> NoReturn:
        """Refuse to register CUDA region ``name``, with the message of a Triton built
        without GPU support, and what to use instead.

        Raises:
            InferError(UNSUPPORTED): the extension is off.
            InferError(INVALID_ARG): otherwise, always.
        """
        self._check_enabled()
        raise InferError(
            f"failed to register CUDA shared memory region: '{name}', GPUs not supported: "
            "pdserve serves tensors from host memory; use system shared memory "
            "(/v2/systemsharedmemory) instead"
        )

    def close(self) -> None:
        """Close every descriptor (server shutdown)."""
        if self.enabled:
            self.unregister("")

    # -------------------------------------------------------------- data path

    def acquire(self, names: list[tuple[str, str]]) -> dict[str, _Region]:
        """Take hold of the regions ``names`` (``(region, where)`` pairs; ``where``
        names the tensor in an error) until :meth:`release`: unregistering one
        meanwhile defers closing it.

        Returns:
            region name -> the held region (pass it to the read and write methods).

        Raises:
            InferError(UNSUPPORTED): the extension is off.
            InferError(NOT_FOUND): a region that is not registered (nothing is held;
                :func:`region_not_found`).
        """
        self._check_enabled()
        held: dict[str, _Region] = {}
        with self._lock:
            for name, where in names:
                if name in held:
                    continue
                region = self._regions.get(name)
                if region is None:
                    raise region_not_found(name, where)
                held[name] = region
            for region in held.values():
                with region.lock:
                    region.users += 1
        return held

    def release(self, held: dict[str, _Region]) -> None:
        """Let go of the regions :meth:`acquire` returned."""
        for region in held.values():
            self._release(region)

    def _held(self, held: dict[str, _Region] | None, name: str, where: str) -> _Region:
        if held is not None and name in held:
            region: _Region = held[name]
            return region
        raise region_not_found(name, where)

    def _release(self, region: _Region) -> None:
        with region.lock:
            region.users -= 1
            close = region.users == 0 and not region.registered
        if close:
            os.close(region.fd)

    def _window(self, region: _Region, size: int, offset: int, where: str) -> int:
        """The file position of ``size`` bytes at ``offset`` of the region, checked
        against the registered window and the file's present size."""
        if offset + size > region.byte_size:
            raise InferError(
                f"{where}: shared_memory_offset {offset} + shared_memory_byte_size {size} is "
                f"past the end of region '{region.name}' ({region.byte_size} bytes)"
            )
        pos = region.offset + offset
        if pos + size > os.fstat(region.fd).st_size:
            raise InferError(
                f"{where}: region '{region.name}' is shorter than registered: its key "
                f"'{region.key}' was truncated"
            )
        return pos

    def read_inputs(
        self, refs: dict[str, ShmInput], held: dict[str, _Region] | None = None
    ) -> dict[str, np.ndarray]:
        """Copy each input out of its region (``held``: from :meth:`acquire`; None:
        take hold of them for this call).

        Returns:
            input name -> a new, writable numpy array (little-endian, C order) of the
            input's datatype and shape; BYTES inputs as object arrays of ``bytes``.

        Raises:
            InferError(UNSUPPORTED): the extension is off.
            InferError(INVALID_ARG): an unknown region; a byte size that is not the
                shape's (fixed-size datatypes); a window past the region's end; a file
                truncated since registration; BYTES data that does not parse.
        """
        own = held is None
        if held is None:
            held = self.acquire([(r.region, f"input '{n}'") for n, r in refs.items()])
        out: dict[str, np.ndarray] = {}
        try:
            for name, ref in refs.items():
                out[name] = self._read_one(
                    name, ref, self._held(held, ref.region, f"input '{name}'")
                )
        finally:
            if own:
                self.release(held)
        return out

    def _read_one(self, name: str, ref: ShmInput, region: _Region) -> np.ndarray:
        where = f"input '{name}'"
        pos = self._window(region, ref.byte_size, ref.offset, where)
        if ref.datatype == "BYTES":
            data = os.pread(region.fd, ref.byte_size, pos)
            if len(data) != ref.byte_size:
                raise InferError(f"{where}: region '{ref.region}' was truncated")
            try:
                arr = deserialize_bytes_tensor(data, ref.count).reshape(ref.shape)
            except InferError as exc:
                raise InferError(f"{where}: {exc.message}") from None
        else:
            dtype = V2_TO_NUMPY.get(ref.datatype)
            if dtype is None:
                raise InferError(f"{where} has unknown datatype '{ref.datatype}'")
            dtype = dtype.newbyteorder("<")
            expected = ref.count * dtype.itemsize
            if ref.byte_size != expected:
                raise InferError(
                    f"{where}: shared_memory_byte_size {ref.byte_size} does not match "
                    f"the {expected} bytes of datatype {ref.datatype} and shape "
                    f"{ref.shape}"
                )
            arr = np.empty(ref.shape, dtype=dtype)
            if expected:
                got = os.preadv(region.fd, [arr.reshape(-1).view(np.uint8).data], pos)
                if got != expected:
                    raise InferError(f"{where}: region '{ref.region}' was truncated")
        return arr

    def write_outputs(
        self,
        outputs: dict[str, np.ndarray],
        wanted: dict[str, tuple[str, int, int]],
        held: dict[str, _Region] | None = None,
    ) -> None:
        """Write each output named in ``wanted`` (name -> ``(region, byte_size,
        offset)``) into its region, little-endian, C order (BYTES serialized as in the
        binary extension). ``held``: from :meth:`acquire`; None: take hold of the
        regions for this call.

        Raises:
            InferError(UNSUPPORTED): the extension is off.
            InferError(INVALID_ARG): an unknown or read-only region; an output larger
                than its ``shared_memory_byte_size``; a window past the region's end;
                two outputs overlapping in one file; a requested output the model did
                not produce.
        """
        spans: list[tuple[str, int, int, str]] = []
        own = held is None
        if held is None:
            held = self.acquire([(w[0], f"output '{n}'") for n, w in wanted.items()])
        try:
            plan: list[tuple[_Region, int, Any, str]] = []
            for name, (rname, size, offset) in wanted.items():
                where = f"output '{name}'"
                arr = outputs.get(name)
                if arr is None:
                    raise InferError(f"{where} asked for in shared memory was not produced")
                region = self._held(held, rname, where)
                if not region.writable:
                    raise InferError(
                        f"{where}: region '{rname}' is read-only for the server (its key "
                        f"'{region.key}' is not writable by the server's user)"
                    )
                arr = np.asarray(arr)
                if arr.dtype.kind in "OSU":
                    blob: Any = serialize_bytes_tensor(arr)
                    nbytes = len(blob)
                else:
                    le = arr.dtype.newbyteorder("<")
                    arr = np.ascontiguousarray(arr, dtype=le)
                    blob = arr.reshape(-1).view(np.uint8)
                    nbytes = arr.nbytes
                if nbytes > size:
                    raise InferError(
                        f"shared memory size specified with the request for output '{name}' "
                        f"({size} bytes) should be at least {nbytes} bytes to hold the results"
                    )
                pos = self._window(region, size, offset, where)
                for other, start, end, key in spans:
                    if key == region.key and start < pos + nbytes and pos < end:
                        raise InferError(
                            f"outputs '{other}' and '{name}' overlap in shared memory "
                            f"'{region.key}'; give each output its own bytes"
                        )
                spans.append((name, pos, pos + nbytes, region.key))
                plan.append((region, pos, blob, name))
            for region, pos, blob, name in plan:
                if len(blob):
                    written = os.pwrite(region.fd, blob, pos)
                    if written != len(blob):
                        raise internal(f"output '{name}': short write to shared memory")
        finally:
            if own:
                self.release(held)
