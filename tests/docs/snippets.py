"""Docs that run: every ```sh / ```bash / ```python fence of README.md and docs/**/*.md
(CONTRIBUTING.md, "Docs that run", is the authors' guide).

Markers on the lines right above a fence: ``<!-- skip: why -->`` (not run), ``<!-- expect:
TEXT -->`` (output must contain TEXT; several may stack), ``<!-- serve -->`` (a server in the
foreground: run in the background in its own process group until /v2/health/ready is 200, or
a TLS listener logs its initial load; stopped at the page's end or the next serve fence on its
HTTP port). Other fences run in order, exit 0 within SNIPPET_SECS. Before a page's first serve
fence, snippets talk to the default server on examples/model_repository. A page runs in a
scratch folder mirroring the repository root (symlinks; /tmp/ rewritten to its tmp/); its
shell fences share variables like one terminal, each python fence is a whole program, and
background processes end with their fence. Loopback ports (``127.0.0.1:N``, ``--port N``...)
become free ports; the ``pdserve`` / ``tritonserver`` wrappers first on PATH put servers on
them and on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(sh|bash|python)\s*$")
MARKER = re.compile(r"^<!--\s*(skip|expect|serve)\s*(?::\s*(.*?))?\s*-->$")
LOOPBACK = re.compile(
    r"(\b(?:127\.0\.0\.1|localhost|0\.0\.0\.0):|(?<![\w-])--port[= ]|(?<![\w-])port=)(\d{4,5})\b"
)
PYTHON_M = re.compile(r"(?<![\w/.-])(?:\S*/)?python3? -m pdserve(?![\w.])")
TMP = re.compile(r"(?<![\w./])/tmp/")
PORT_FLAG = re.compile(r"--(http|grpc|metrics)-port[= ](\d+)")
DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
SNIPPET_SECS = 60
READY_SECS = 120
SHIMS = ("pdserve", "tritonserver")


@dataclass
class Snippet:
    """One fence: its page, 1-based line, language, code and marker."""

    page: str
    line: int
    lang: str
    code: str
    marker: str | None = None
    text: str | None = None
    expects: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.marker != "skip"


def pages() -> list[str]:
    """README.md and every page under docs/, as paths relative to the repository root."""
    found = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    return ["README.md", *found]


def snippets(page: str) -> list[Snippet]:
    """The sh / bash / python fences of ``page`` (indented ones in lists too, dedented)
    with their markers, in page order."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        indent = len(lines[i]) - len(lines[i].lstrip())
        m = FENCE.match(lines[i].strip())
        if not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        start, i = i, i + 1
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            i += 1
        if m:
            body = "\n".join(line[indent:] for line in lines[start + 1 : i]) + "\n"
            s = Snippet(page, start + 1, m.group(1), body)
            above = start - 1  # the markers: the lines right above the fence
            while above >= 0 and (marker := MARKER.match(lines[above].strip())):
                kind, text = marker.group(1), marker.group(2)
                if kind == "expect":
                    s.expects.insert(0, text or "")
                if s.marker in (None, "expect"):  # skip or serve decides over expect
                    s.marker, s.text = kind, text
                above -= 1
            out.append(s)
        i += 1
    return out


def weight(page: str) -> int:
    """A rough cost of running ``page``: servers dominate."""
    ss = [s for s in snippets(page) if s.runs]
    return sum(8 if s.marker == "serve" else 1 for s in ss)


def shard(index: int, count: int = 2) -> list[str]:
    """The pages of shard ``index`` of ``count``, balanced by :func:`weight` (heaviest
    first onto the lightest shard), so each test file runs on its own pytest-xdist worker."""
    loads = [0] * count
    members: list[list[str]] = [[] for _ in range(count)]
    for page in sorted(pages(), key=lambda p: (-weight(p), p)):
        k = loads.index(min(loads))
        loads[k] += weight(page)
        members[k].append(page)
    return sorted(p for p in members[index] if any(s.runs for s in snippets(p)))


SHIM = """#!{python}
import json, os, sys
ports = {{int(k): v for k, v in json.loads(os.environ["DOCS_PORTS"]).items()}}
args, prog = sys.argv[1:], {prog!r}
flags = {{"--http-port": 8000, "--grpc-port": 8001, "--metrics-port": 8002}}
if prog == "pdserve" and args[:1] == ["tritonserver"]:
    prog, args = "tritonserver", args[1:]
serving = prog == "tritonserver" or args[:1] == ["serve"]
def port(p):
    return str(ports.get(int(p), p)) if p.isdigit() else p
out, seen = [], set()
for a in args:
    name, eq, value = a.partition("=")
    if serving and eq and name in flags:
        a, seen = name + "=" + port(value), seen | {{name}}
    elif serving and out and out[-1] in flags and "=" not in out[-1]:
        seen.add(out[-1])
        a = port(a)
    if serving and a in ("0.0.0.0", "::"):
        a = "127.0.0.1"
    out.append(a.replace("=0.0.0.0", "=127.0.0.1"))
if serving:
    out += [f"{{f}}={{ports[d]}}" for f, d in flags.items() if f not in seen]
    out += ["--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"]
    out += [] if prog == "tritonserver" else ["--host=127.0.0.1"]
elif args[:1] == ["perf"] and not {{"-u", "--url"}} & set(args):
    out += ["-u", f"127.0.0.1:{{ports[8001 if 'grpc' in args else 8000]}}"]
elif args[:1] in (["top"], ["rollback"]) and "--url" not in args:
    out += ["--url", f"127.0.0.1:{{ports[8002 if args[0] == 'top' else 8000]}}"]
os.execv({real!r} + "/" + prog, [prog, *out])
"""

# Shell snippets of a page share variables: each starts from the state file and saves the
# variables it set (not the ones bash or the environment gave it) when it exits.
BASH_PRELUDE = """__docs_base=" $(compgen -v | tr '\\n' ' ') "
__docs_save() {
  for __docs_v in $(compgen -v); do
    case "$__docs_base" in *" $__docs_v "*) continue ;; esac
    case "$__docs_v" in __docs_*) continue ;; esac
    declare -p "$__docs_v"
  done > "$DOCS_STATE" 2>/dev/null
}
[ -f "$DOCS_STATE" ] && . "$DOCS_STATE"
trap __docs_save EXIT
set -e -o pipefail
"""


@dataclass
class Server:
    """A serve fence's process (the leader of its own process group)."""

    snippet: Snippet
    proc: subprocess.Popen[bytes]
    http: int
    log: Path

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 30 s."""
        _stop_group(self.proc, 30)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(stat.parent.name))
    return found


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to ``proc``'s process group; SIGKILL to what is left of it after ``grace`` s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        if not group_members(proc.pid):
            break
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(10)


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


@dataclass
class PageRun:
    """Runs one page's snippets in order in ``scratch``."""

    page: str
    scratch: Path
    default: ServerProcess | None
    ports: dict[int, int] = field(default_factory=dict)
    servers: list[Server] = field(default_factory=list)

    def setup(self) -> None:
        """Mirror the repository root into the scratch folder and install the shims."""
        for entry in ROOT.iterdir():
            if entry.name not in (".git", ".venv"):
                (self.scratch / entry.name).symlink_to(entry)
        (self.scratch / "tmp").mkdir()
        venv = Path(sys.prefix)
        (self.scratch / ".venv" / "bin").mkdir(parents=True)
        for entry in venv.iterdir():
            if entry.name != "bin":
                (self.scratch / ".venv" / entry.name).symlink_to(entry)
        for entry in (venv / "bin").iterdir():
            if entry.name not in SHIMS:
                (self.scratch / ".venv" / "bin" / entry.name).symlink_to(entry)
        for prog in SHIMS:
            shim = self.scratch / ".venv" / "bin" / prog
            shim.write_text(SHIM.format(python=sys.executable, prog=prog, real=str(venv / "bin")))
            shim.chmod(0o755)
        if self.default is not None:
            d = self.default
            self.ports.update({8000: d.http_port, 8001: d.grpc_port, 8002: d.metrics_port})

    def env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        env["PATH"] = f"{self.scratch / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.scratch / ".venv")
        env["DOCS_PORTS"] = json.dumps(self.ports)
        env["DOCS_STATE"] = str(self.scratch / ".docs-shell-state")
        return env

    def port(self, n: int) -> int:
        if n not in self.ports:
            self.ports[n] = free_port()
        return self.ports[n]

    def with_ports(self, code: str) -> str:
        """``code`` with every loopback port replaced by this page's free port for it, and
        /tmp/ by the scratch folder's tmp/."""
        code = TMP.sub(f"{self.scratch}/tmp/", code)
        code = PYTHON_M.sub("pdserve", code)
        return LOOPBACK.sub(lambda m: f"{m.group(1)}{self.port(int(m.group(2)))}", code)

    def command(self, s: Snippet) -> list[str]:
        code = self.with_ports(s.code)
        if s.lang == "python":
            return [sys.executable, "-c", code]
        return ["bash", "-c", BASH_PRELUDE + code]

    def run(self, s: Snippet) -> None:
        """Run one non-serve snippet; AssertionError names it with its output."""
        cmd, out = self.command(s), self.scratch / f".docs-out-{s.line}"
        with open(out, "wb") as f:
            proc = subprocess.Popen(
                cmd, cwd=self.scratch, env=self.env(), stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                rc: int | str = proc.wait(SNIPPET_SECS)
            except subprocess.TimeoutExpired:
                rc = f"nothing: still running after {SNIPPET_SECS} s (a server? mark it serve)"
            _stop_group(proc, 5)  # background processes it started end with it
        output = out.read_text(errors="replace")
        shown = self.with_ports(s.code)
        assert rc == 0, f"{s.id} exited {rc}:\n{shown}\n--- output:\n{output[-6000:]}"
        for text in s.expects:
            assert text in output, f"{s.id}: no {text!r} in:\n{output[-6000:]}"

    def serve(self, s: Snippet) -> None:
        """Start a serve fence's server on fresh ports and wait until it is ready."""
        found = {k: int(v) for k, v in PORT_FLAG.findall(s.code)}
        wanted = {k: found.get(k, d) for k, d in DEFAULT_PORTS.items()}
        for old in [x for x in self.servers if x.http == wanted["http"]]:
            old.stop()
            self.servers.remove(old)
        for n in wanted.values():
            self.ports[n] = free_port()
        log = self.scratch / f".docs-serve-{s.line}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                self.command(s), cwd=self.scratch, env=self.env(), stdout=f,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        server = Server(s, proc, wanted["http"], log)
        self.servers.append(server)
        _wait_ready(server, self.ports[wanted["http"]])

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        self.servers.clear()


def _answers_ready(port: int) -> bool:
    """/v2/health/ready is 200 over HTTP, or over HTTPS (certificates unchecked)."""
    url = f"127.0.0.1:{port}/v2/health/ready"
    try:
        with urllib.request.urlopen(f"http://{url}", timeout=2) as r:
            return r.status == 200
    except (http.client.BadStatusLine, http.client.RemoteDisconnected, ConnectionResetError):
        pass  # a TLS listener
    except OSError:
        return False
    try:
        ctx = ssl._create_unverified_context()
        with urllib.request.urlopen(f"https://{url}", timeout=2, context=ctx) as r:
            return r.status == 200
    except OSError:
        return False


def _wait_ready(server: Server, port: int) -> None:
    deadline = time.monotonic() + READY_SECS
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(
                f"{server.snippet.id}: the server exited with {server.proc.returncode}:\n"
                f"{_tail(server.log)}"
            )
        if _answers_ready(port) or re.search(
            r"model repository .*: \d+ versions? ready", _tail(server.log)
        ):
            return
        time.sleep(0.2)
    raise AssertionError(
        f"{server.snippet.id}: not ready after {READY_SECS} s:\n{_tail(server.log)}"
    )


def run_page(page: str, scratch: Path, default: ServerProcess | None) -> None:
    """Run every snippet of ``page`` not marked skip, in order; servers stopped at the end."""
    run = PageRun(page, scratch, default)
    run.setup()
    try:
        for s in snippets(page):
            if s.marker == "serve":
                run.serve(s)
            elif s.runs:
                run.run(s)
    finally:
        run.close()


def needs_default(page: str) -> bool:
    """Whether a snippet of ``page`` runs before its first serve fence."""
    for s in snippets(page):
        if s.marker == "serve":
            return False
        if s.runs:
            return True
    return False
