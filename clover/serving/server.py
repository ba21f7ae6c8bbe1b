"""Launch the real Triton Inference Server on a model repository (docs/serving.md#triton-without-an-nvidia-container).

:func:`find_tritonserver` prefers a ``tritonserver`` on ``PATH`` (an NVIDIA
container) and otherwise uses the binary of the ``nvidia-pytriton`` wheel
(Triton 2.51 with the Python backend). For the wheel, :class:`TritonServer`
puts the Python-backend stub matching this interpreter into a private backend
directory, puts the wheel's bundled libraries (and this Python's shared
``libpython``) on ``LD_LIBRARY_PATH`` and this environment's ``bin/`` first on
``PATH``, so the stub runs this Python with these packages.

:meth:`TritonServer.wait_ready` polls ``/v2/health/ready`` against a deadline
(a stub that cannot start makes the load hang forever). :meth:`TritonServer.stop`
sends SIGINT for Triton's clean shutdown, and kills by PID what is still
running after the timeout, then removes its stubs' shared-memory regions.

Fault handling (docs/serving.md#shutdown-faults-and-security): before the SIGINT,
:meth:`TritonServer.stop` writes the drain file the model watches
(``CLOVER_DRAIN_FILE``), so in-flight requests end within ``drain_s``, inside
Triton's ``--exit-timeout-secs``; after tritonserver exits, whatever happened,
stubs still alive are killed and their ``/dev/shm`` regions removed.
:meth:`TritonServer.dead_stubs` tells a supervisor that a stub died. Triton's
admin APIs (shared memory, model repository, config, statistics, trace,
logging) are restricted to clients that send the ``clover-admin-key`` header; the key never goes on
tritonserver's command line, which every local user can read (:mod:`clover.serving.hidden_args`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from clover.demo import cache_root, package_parent
from clover.serving import hidden_args
from clover.serving.protocol import DRAIN_FILE_ENV

SHM_PREFIX = "triton_python_backend_shm_region_"
# Triton's restricted-API groups that only clients with the admin header may use; health, metadata and
# inference stay open (CVE-2025-23319/23320/23334 class: shared-memory register, repository control)
ADMIN_APIS = ("shared-memory", "model-config", "model-repository", "statistics", "trace", "logging")
ADMIN_HEADER = "clover-admin-key"
ADMIN_KEY_ENV = "CLOVER_ADMIN_KEY"
# seconds between the model's drain deadline and Triton's exit timeout: cancelled requests send their final
# responses and the model unloads in that time, so Triton never hits "Exit timeout expired"
DRAIN_MARGIN_S = 5.0
# seconds Triton's Python backend waits for a stub to start (its default, 30, is short for a stub that starts on a
# busy machine: issue 62)
STUB_TIMEOUT_S = 120
# how long stop() waits for the kernel to remove tritonserver after SIGKILL, and how often it looks
KILL_WAIT_S = 10.0
REAP_POLL_S = 0.05


class ServerError(RuntimeError):
    """tritonserver is missing, failed, or did not become ready in time."""


@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """Where the server binary and (for the wheel) its Python backend pieces are."""

    binary: Path
    source: str  # "PATH" or "nvidia-pytriton"
    python_backend: Path | None = None  # directory with libtriton_python.so
    stub: Path | None = None  # triton_python_backend_stub for this Python version
    libs: Path | None = None  # the wheel's bundled shared libraries


def find_tritonserver() -> TritonInstall:
    """A ``tritonserver`` on PATH, else the ``nvidia-pytriton`` wheel's. Raises ServerError if neither."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path), "PATH")
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("no tritonserver on PATH and the nvidia-pytriton wheel is not installed; "
                          "install it with: pip install nvidia-pytriton (or pip install -e '.[serve]')")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    binary = root / "bin" / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    backend = root / "backends" / "python"
    if not binary.exists() or not (backend / "libtriton_python.so").exists():
        raise ServerError(f"the nvidia-pytriton wheel at {root.parent} has no tritonserver binary or Python backend")
    if not stub.exists():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir()) if (root / "python_backend_stubs").exists() else []
        raise ServerError(f"nvidia-pytriton has no Python backend stub for Python {version} (it has: {', '.join(have)})")
    return TritonInstall(binary, "nvidia-pytriton", backend, stub, root.parent.parent / "nvidia_pytriton.libs")


def free_ports(count: int, host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> list[int]:
    """``count`` distinct ports free now, none of ``avoid``. Their sockets stay bound until all are chosen: ports
    asked for one at a time can repeat (the system may hand a just-released port out again), and tritonserver then
    refused to start ("cannot listen to HTTP requests and metrics requests at the same address and port")."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            if sock.getsockname()[1] not in (*avoid, *ports):
                ports.append(sock.getsockname()[1])
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def shm_regions() -> set[str]:
    """Names of the Python backend's shared-memory regions now in /dev/shm."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


class TritonServer:
    """One tritonserver process on a model repository.

    Args:
        model_repository: the repository directory.
        http_port, grpc_port, metrics_port: 0 picks a free port.
        host: address the three endpoints bind to (loopback by default: closed unless asked).
        log_file: where the server's stdout/stderr go (None: inherited).
        extra_args: more tritonserver options.
        drain_s: at :meth:`stop`, seconds in-flight requests may still run before the model cancels them;
            Triton's ``--exit-timeout-secs`` is this plus :data:`DRAIN_MARGIN_S`.
        admin_key: value of the ``clover-admin-key`` header that unlocks Triton's admin APIs; None:
            ``$CLOVER_ADMIN_KEY``, else a random key nobody is told (admin APIs closed). "" leaves them open.
    """

    def __init__(self, model_repository: str | Path, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, host: str = "127.0.0.1", log_file: str | Path | None = None,
                 extra_args: tuple[str, ...] = (), drain_s: float = 10.0, admin_key: str | None = None,
                 install: TritonInstall | None = None) -> None:
        self.install = install or find_tritonserver()
        self.model_repository = Path(model_repository).resolve()
        bind = "127.0.0.1" if host in ("127.0.0.1", "localhost") else host
        self.host = bind
        given = (http_port, grpc_port, metrics_port)
        spare = iter(free_ports(sum(not p for p in given), avoid=tuple(p for p in given if p)))  # for each 0
        self.http_port, self.grpc_port, self.metrics_port = (port or next(spare) for port in given)
        self.log_file = Path(log_file) if log_file is not None else None
        self.extra_args = tuple(extra_args)
        if drain_s < 0:
            raise ServerError(f"the drain time must be >= 0 seconds, got {drain_s}")
        self.drain_s = float(drain_s)
        self.exit_timeout_s = int(math.ceil(self.drain_s + DRAIN_MARGIN_S))
        self.admin_key = (os.environ.get(ADMIN_KEY_ENV) or secrets.token_urlsafe(24)) if admin_key is None else admin_key
        self.process: subprocess.Popen | None = None
        self._workdir: Path | None = None
        self._log_handle = None
        self._stub_regions: set[str] = set()
        self._stubs: dict[int, str] = {}  # pid -> its /proc start time, to tell a reused pid apart
        self._hidden_file: Path | None = None  # the admin key's file, until tritonserver has read it
        self.forced = False  # stop() was cut short by a second Ctrl-C

    # -- endpoints --------------------------------------------------------

    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host

    @property
    def http_url(self) -> str:
        return f"{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    # -- lifecycle --------------------------------------------------------

    def command(self, backend_directory: Path | None) -> list[str]:
        cmd = [str(self.install.binary), f"--model-repository={self.model_repository}",
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
               f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
               "--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0",
               f"--exit-timeout-secs={self.exit_timeout_s}",
               f"--backend-config=python,stub-timeout-seconds={STUB_TIMEOUT_S}"]
        if backend_directory is not None:
            cmd.append(f"--backend-directory={backend_directory}")
        return cmd + list(self.extra_args)

    def admin_args(self) -> list[str]:
        """The options that restrict the admin APIs to the key: tritonserver gets them off its command line."""
        if not self.admin_key:
            return []
        apis = ",".join(ADMIN_APIS)  # Triton's syntax is <apis>:<header>=<value> (its --help shows a comma)
        return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={self.admin_key}",
                f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={self.admin_key}"]

    @property
    def admin_headers(self) -> dict[str, str]:
        """HTTP headers that unlock the admin APIs."""
        return {ADMIN_HEADER: self.admin_key} if self.admin_key else {}

    @property
    def grpc_admin_headers(self) -> dict[str, str]:
        """gRPC metadata that unlocks the admin APIs (tritonclient.grpc's ``headers=``): Triton 2.51 expects
        the header name with a ``triton-grpc-protocol-`` prefix."""
        return {f"triton-grpc-protocol-{ADMIN_HEADER}": self.admin_key} if self.admin_key else {}

    @property
    def drain_file(self) -> Path | None:
        return self._workdir / "drain" if self._workdir is not None else None

    def environment(self) -> dict[str, str]:
        env = os.environ.copy()
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        libs = []
        if self.install.libs is not None:
            if sysconfig.get_config_var("Py_ENABLE_SHARED") and sysconfig.get_config_var("LIBDIR"):
                libs.append(sysconfig.get_config_var("LIBDIR"))  # the stub then embeds this Python's libpython
            libs.append(str(self.install.libs))
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        if libs:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
        root = str(package_parent())
        env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
        if self.drain_file is not None:
            env[DRAIN_FILE_ENV] = str(self.drain_file)  # the stubs inherit it (clover.serving.triton_model)
        return env

    def _backend_directory(self) -> Path | None:
        self._workdir = Path(tempfile.mkdtemp(prefix="clover-triton-"))
        if self.install.stub is None:
            return None
        python = self._workdir / "backends" / "python"
        python.mkdir(parents=True)
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            if (self.install.python_backend / name).exists():
                (python / name).symlink_to(self.install.python_backend / name)
        shutil.copy2(self.install.stub, python / "triton_python_backend_stub")
        return self._workdir / "backends"

    def start(self) -> "TritonServer":
        if self.process is not None:
            raise ServerError("already started")
        backend_directory = self._backend_directory()
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log_handle = open(self.log_file, "ab")
        out = self._log_handle if self._log_handle is not None else None
        env, command = self.environment(), self.command(backend_directory)
        command += self._admin_args_off_the_command_line(env)
        # a session of its own: a terminal's Ctrl-C reaches us, and we forward it (stop())
        self.process = subprocess.Popen(command, env=env, stdout=out,
                                        stderr=subprocess.STDOUT if out is not None else None,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def _admin_args_off_the_command_line(self, env: dict[str, str]) -> list[str]:
        """Hand the admin options to tritonserver through a private file (``env`` set to preload the library that
        reads it); returns the options that must go on the command line instead: none, unless they cannot be
        hidden here, which is said."""
        args = self.admin_args()
        reason = hidden_args.unavailable_reason(self.install.binary) if args else None
        if args and reason is None:
            try:
                library = hidden_args.build_library(cache_root() / "native")
                self._hidden_file = hidden_args.hide(args, self._workdir, env, library)
                return []
            except hidden_args.HiddenArgsUnavailable as exc:
                reason = str(exc)
        if reason:
            _say(f"{reason}: tritonserver's admin key goes on its command line, where every local user can read it")
            return args
        return []

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_file is None or not self.log_file.exists():
            return ""
        return self.log_file.read_text(errors="replace")[-chars:]

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> "TritonServer":
        """Block until ``/v2/health/ready`` answers 200; raise ServerError if the server exits or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._note_stubs()
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                  + self._tail_note())
            if self.is_ready():
                self._refuse_unread_admin_key()
                self._note_stubs()
                # Triton runs a short-lived stub per model during loading (its config auto-complete step) before
                # the one that serves; only the stubs alive now are the serving ones whose death means a fault.
                self._stubs = {pid: started for pid, started in self._stubs.items() if _start_time(pid) == started}
                return self
            if time.monotonic() > deadline:
                raise ServerError(f"tritonserver was not ready after {timeout_s:.0f} s (a Python backend stub that "
                                  "cannot start hangs the model load)" + self._tail_note())
            time.sleep(0.25)

    def _refuse_unread_admin_key(self) -> None:
        """A tritonserver that answers with the admin key's file still there never read it (a statically linked
        binary ignores the preloaded library): its admin APIs are open, so it is stopped."""
        if self._hidden_file is not None and self._hidden_file.exists():
            self.stop(timeout_s=30)
            raise ServerError(f"{self.install.binary} did not read its admin key (was it linked statically?); "
                              "stopped, as its admin APIs were open")

    def _tail_note(self) -> str:
        tail = self.log_tail()
        return f"; end of its log ({self.log_file}):\n{tail}" if tail else ""

    def _stub_pids(self) -> list[int]:
        """PIDs of this server's Python backend stubs (its children), read from /proc."""
        if self.process is None:
            return []
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == self.process.pid:
                pids.append(int(entry.name))
        return pids

    def _note_stubs(self) -> None:
        """Remember this server's stubs (pid and start time) and the shared-memory regions they use (named on
        their command lines): after tritonserver is gone they are no longer its children."""
        for pid in self._stub_pids():
            started = _start_time(pid)
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if started is not None:
                self._stubs.setdefault(pid, started)
            for arg in args:
                name = arg.decode(errors="replace").lstrip("/")
                if name.startswith(SHM_PREFIX):
                    self._stub_regions.add(name)

    def dead_stubs(self) -> list[int]:
        """PIDs of stubs seen running that are gone now (killed, crashed): the model no longer answers, so a
        supervisor should stop the server (docs/serving.md#worker-health)."""
        self._note_stubs()
        return [pid for pid, started in self._stubs.items() if _start_time(pid) != started]

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once tritonserver has exited, waiting up to ``timeout`` seconds; None while it runs."""
        self._reap(math.inf if timeout is None else timeout)
        return self.process.returncode

    def request_drain(self) -> None:
        """Tell the models to stop admitting requests and to end those in flight within ``drain_s``."""
        if self.drain_file is not None and not self.drain_file.exists():
            tmp = self.drain_file.with_suffix(".tmp")
            tmp.write_text(f"{self.drain_s}\n")
            tmp.replace(self.drain_file)  # atomic: the model never reads a half-written file

    def stop(self, timeout_s: float | None = None) -> int | None:
        """Drain, SIGINT (clean shutdown), then SIGKILL by PID after ``timeout_s``; returns the exit code
        (negative when killed, None when it could not be learnt). Stubs left behind and their shared memory are
        removed whatever happened."""
        if self.process is None:
            return None
        timeout_s = self.exit_timeout_s + 10 if timeout_s is None else timeout_s
        try:
            if not self._reap(0):
                self._note_stubs()
                self.request_drain()
                self.process.send_signal(signal.SIGINT)
                try:
                    exited = self._reap(timeout_s)
                    if not exited:
                        _say(f"tritonserver (pid {self.pid}) did not exit within {timeout_s:g} s of SIGINT; killing it")
                except KeyboardInterrupt:  # a second Ctrl-C: stop now
                    self.forced, exited = True, False
                if not exited:
                    self.kill()
            return self.process.returncode
        finally:
            self._reap_stubs()
            self._cleanup()

    def kill(self) -> None:
        """SIGKILL the server and its stubs by PID, and remove the stubs' shared memory."""
        if self.process is None:
            return
        self._note_stubs()
        if not self._reap(0):
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if not self._reap(KILL_WAIT_S):
                _say(f"tritonserver (pid {self.pid}) was still there {KILL_WAIT_S:g} s after SIGKILL; "
                     "its exit code is unknown")
        self._reap_stubs(grace_s=0.0)
        self._cleanup()

    def _reap(self, timeout_s: float) -> bool:
        return reap(self.process, timeout_s)

    def _reap_stubs(self, grace_s: float = 3.0) -> list[int]:
        """After tritonserver exited: SIGKILL stubs still alive after ``grace_s`` (orphans), unlink their
        ``/dev/shm`` regions; returns the PIDs killed."""
        deadline = time.monotonic() + grace_s
        alive = self._live_stubs()
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = self._live_stubs()
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for region in self._stub_regions:
            try:
                os.unlink(f"/dev/shm/{region}")
            except FileNotFoundError:
                pass
        return alive

    def _live_stubs(self) -> list[int]:
        return [pid for pid, started in self._stubs.items() if _start_time(pid) == started]

    def _cleanup(self) -> None:
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def reap(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a child process to exit; True once it has, its exit code then in
    ``process.returncode`` (None when another waitpid collected it: unknown).

    It calls waitpid itself rather than Popen.wait: a KeyboardInterrupt raised inside an earlier Popen.wait
    or poll (Ctrl-C while clover serve polls its children) can leave Popen's internal lock held, after which
    Popen never reaps the child; tritonserver then stayed <defunct> until the timeouts ran out
    (docs/serving.md#graceful-drain)."""
    deadline = time.monotonic() + timeout_s
    while not _exit_collected(process):
        if time.monotonic() >= deadline:
            return False
        time.sleep(REAP_POLL_S)
    return True


def _exit_collected(process: subprocess.Popen) -> bool:
    """One non-blocking waitpid: True once the child has exited (its exit code in ``process.returncode``, None
    when another waitpid took it)."""
    if process.returncode is not None:
        return True
    # Ctrl-C between waitpid and the assignment would lose the exit status: signals wait until both ran
    with _signals_held():
        try:
            pid, status = os.waitpid(process.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: the exit code is lost, so it stays unknown
            return True
        if pid == process.pid:
            process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode is not None


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM back from this thread (their Python handlers run once this block is left)."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _say(message: str) -> None:
    print(f"[clover] {message}", file=sys.stderr, flush=True)


def _start_time(pid: int) -> str | None:
    """The process's start time from /proc (None when it is gone or a zombie): with the pid, an identity
    that survives pid reuse."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]
