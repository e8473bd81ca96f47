"""The tests' cluster processes, forked from a process that has imported them already.

A worker process spends some 2.3 of its 3 CPU-s of start-up importing torch and the engine, a proxy 1 of its 1.4
importing its web stack, and the suite starts some 170 workers and 90 proxies (``make test`` on 2 cores is as long
as its CPU-seconds: tests/conftest.py). So each test lane keeps a fork server for each command: a process that
imports what that command's process imports (``PRELOAD``) and then forks one child per request; a worker server also
loads a worker's model before forking it, for the child to adopt (``_preload``), where torch computes on one thread
there, so that no thread pool exists to fork. The child becomes what ``python -m common.cli.main COMMAND ARGS``
would be: its own environment and the working directory of the test that asked, its output on the log file's
descriptor, a new session if asked, default signal handlers, ``sys.argv`` and ``__main__`` as under ``-m``, and at
the end the interpreter's exit steps (non-daemon threads joined, ``atexit`` run) before its exit status. The server
reaps its children and reports each one's status, which the test's handle (``ForkedProcess``:
``subprocess.Popen``'s pid, poll, wait, returncode and signals) reads.

A process whose environment differs in a variable that a library reads when it loads (``LOAD_TIME_PREFIXES``:
OpenMP's, torch's, the interpreter's) is forked from a server started under that environment. What stays a fresh
interpreter: commands of another tree or entry module (``LocalCluster``'s ``entry_module`` and ``cwd``), every
process the children start themselves (tensor-parallel ranks, the proxies a ``--processes`` supervisor runs), all
of them with ``TESSERA_TEST_FORK_SERVER=0``, and any where a server did not start or could not fork (each said on
stderr; a server's own output is in a file of its own in the temporary directory). Where a test needs a process's
own command line or initial environment in ``/proc`` (a forked one shows the server's), it starts fresh that way.
"""
from __future__ import annotations

import atexit
import collections
import gc
import io
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from common.engine.malloc import REEXEC_ENV, find_jemalloc, preload_environment

ENV = "TESSERA_TEST_FORK_SERVER"
# What each command's server imports before it forks: what that command's process imports on its way to serving
# (the worker's torch and engine; the proxy's web stack, which imports no torch).
WORKER_PRELOAD = ("torch", "common.cli.main", "decode_worker.worker", "prefill_worker.worker", "kv_transfer.factory")
PROXY_PRELOAD = ("common.cli.main", "proxy.main", "proxy.app", "proxy.server", "proxy.reload", "proxy.edge.listener",
                 "proxy.tenancy.metering", "common.config.tls", "uvicorn", "uvloop")
WORKER_COMMANDS = ("prefill", "decode", "both")
PRELOAD = {"prefill": WORKER_PRELOAD, "decode": WORKER_PRELOAD, "both": WORKER_PRELOAD, "proxy": PROXY_PRELOAD}
# A variable with one of these prefixes is read when its library loads (libgomp's OMP_* and GOMP_*, torch's), or by
# the interpreter at its start: each set of their values has a server of its own.
LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "TORCH", "PYTORCH", "PYTHON", "LD_",
                      "MALLOC_", "CUDA", "TRITON", "UCX_", "NIXL", "LC_", "LANG")
UNCHECKED = ("PYTHONUNBUFFERED",)  # the child sets its own output unbuffered as under this variable
START_TIMEOUT_S = 180.0  # the server's imports, on a loaded 2-core machine
WAIT_SLICE_S = 0.05  # a waiting handle holds the server's socket this long at a time: others poll in between
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where ``-m tests.fork_server`` imports from
MESSAGE_BYTES = 1 << 20


def _load_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES) and k not in UNCHECKED}


class ForkedProcess:
    """A forked child seen as ``subprocess.Popen`` sees its child: its exit status comes from the server."""

    def __init__(self, server: "ForkServer", pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._read(0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._read(0) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(WAIT_SLICE_S if left is None else min(WAIT_SLICE_S, left))
        return self.returncode

    def _read(self, timeout: float) -> int | None:
        if self.returncode is None:  # once known, it stays: another thread may have read it
            code = self.server.exit_code(self.pid, timeout)
            if code is not None:
                self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client side: starts the server on first use and talks to it over a Unix socket pair."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Its own output (a failed import's traceback) in a file of its own: not the capture of whichever test
        # started it.
        self.log_path = os.path.join(tempfile.gettempdir(), f"tessera-fork-server-{os.getpid()}-{len(_servers)}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.fork_server", str(theirs.fileno()), *preload],
                                         pass_fds=[theirs.fileno()], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT)
        theirs.close()
        self.sock, self.lock, self.codes = ours, threading.Lock(), {}
        self.commands: dict[int, str] = {}  # a child's pid -> its command (``args[0]``), until its exit is read
        message = self._receive(START_TIMEOUT_S)
        if message != ("ready",):
            raise RuntimeError(f"the tests' fork server did not start ({message!r}; exit {self.proc.poll()}; "
                               f"log: {self.log_path})")

    def spawn(self, args: list[str], env: dict[str, str], log: IO | None, new_session: bool) -> ForkedProcess | None:
        """A child running ``common.cli.main`` with ``args``, or None where it must start as a fresh interpreter."""
        if self.proc.poll() is not None:
            return None
        out, err = (log.fileno(), log.fileno()) if log is not None else (1, 2)  # as Popen's child inherits them
        with self.lock:
            request = pickle.dumps(("spawn", args, env, new_session, os.getcwd()))
            socket.send_fds(self.sock, [request], [out, err])
            while True:
                message = self._receive(START_TIMEOUT_S)
                if message[0] == "pid":
                    self.codes.pop(message[1], None)  # an unread status of an earlier child with this pid
                    self.commands[message[1]] = args[0]
                    reaped_by_command[args[0]][1] += message[2]  # the server's load of its model (``_preload``)
                    return ForkedProcess(self, message[1], args)
                if message[0] == "error":  # the fork itself failed: a fresh interpreter instead
                    print(f"the tests' fork server could not fork {args[0]}: {message[1]}", file=sys.stderr)
                    return None
                self._record(message)

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """Child ``pid``'s exit status once the server has reported it (waiting up to ``timeout`` for news)."""
        with self.lock:
            if pid not in self.codes:
                deadline = time.monotonic() + timeout
                while pid not in self.codes:
                    message = self._receive(max(0.0, deadline - time.monotonic()), quiet=True)
                    if message is None:
                        break
                    self._record(message)
            return self.codes.get(pid)

    def close(self) -> None:
        self.sock.close()  # the server exits at the end of its socket; its children live on, as Popen's would
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if os.path.exists(self.log_path) and os.path.getsize(self.log_path) == 0:
            os.remove(self.log_path)  # kept where it says something

    def _record(self, message: tuple) -> None:
        if message[0] == "exit":
            self.codes[message[1]] = message[2]
            counts = reaped_by_command[self.commands.pop(message[1], "?")]
            counts[0] += 1
            counts[1] += message[3]

    def _receive(self, timeout: float, quiet: bool = False) -> tuple | None:
        if not select.select([self.sock], [], [], timeout)[0]:
            if quiet:
                return None
            raise TimeoutError(f"the tests' fork server answered nothing in {timeout:.0f} s")
        data = self.sock.recv(MESSAGE_BYTES)
        if not data:
            raise RuntimeError(f"the tests' fork server exited ({self.proc.poll()})")
        return pickle.loads(data)


# The children whose exit this process has read, by command (``prefill``, ``decode``, ``both``, ``proxy``):
# [children, their CPU-seconds], as RUSAGE_CHILDREN counts a Popen's child once it is reaped (tests/cpu_report.py);
# the seconds include what their server spent loading their models for them (``_preload``), counted at the fork.
reaped_by_command: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])


def reaped_cpu_s() -> float:
    """The CPU-seconds of every child whose exit this process has read."""
    return sum(cpu for _, cpu in list(reaped_by_command.values()))
# One for each command's imports and environment of load-time variables: in a lane, one for the workers and one
# for the proxies.
_servers: dict[tuple, ForkServer | None] = {}  # None: it did not start
_servers_lock = threading.Lock()


def _server_env(env: dict[str, str], preload: tuple[str, ...]) -> dict[str, str]:
    """A worker server's environment: jemalloc preloaded where the host has it, as a worker re-executes itself with
    it by default (``engine.cpu.malloc``, common/engine/malloc.py), so a forked worker finds it loaded."""
    library = find_jemalloc() if preload is WORKER_PRELOAD else None
    return preload_environment(env, library) if library is not None else env


def spawn(args: list[str], env: dict[str, str], log: IO | None, new_session: bool) -> ForkedProcess | None:
    """``LocalCluster.launch`` in the tests: the process forked from the server of its command whose libraries
    loaded under the same variables as the process's would (started on the first such process), or None: start it
    fresh."""
    if os.environ.get(ENV, "1") == "0" or args[0] not in PRELOAD:
        return None
    from common.cli.main import GOMP_SPINCOUNT

    env = {"GOMP_SPINCOUNT": GOMP_SPINCOUNT, **env}  # as the command sets it before it imports torch
    key = (PRELOAD[args[0]], frozenset(_load_time(env).items()))
    with _servers_lock:
        if key not in _servers:
            try:
                _servers[key] = ForkServer(_server_env(env, key[0]), key[0])
                atexit.register(_servers[key].close)
            except (OSError, RuntimeError, TimeoutError) as error:  # fresh interpreters from now on
                print(f"the tests' fork server for {args[0]} did not start: {error}", file=sys.stderr)
                _servers[key] = None
        server = _servers[key]
    return server.spawn(args, env, log, new_session) if server is not None else None


# The server process.

def _serve(sock: socket.socket, preload: list[str]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    from common.cli.main import build_parser

    parser = build_parser()  # the entry points' registrars and what they import
    _read_the_embedded_tokenizer()
    # What the children inherit from here is never garbage: out of the collector's sight, a child's collections
    # (a worker's at its model's load: common/runtime/model_swap.py, freeze_heap) skip it, and so do not write to
    # its pages (reference counts still do, where a child touches an object). Thawed at this process's exit, as a
    # worker's is, so that what it holds is finalized.
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    sock.send(pickle.dumps(("ready",)))
    while True:
        readable = select.select([sock, wake_read], [], [])[0]
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(sock)
        if sock in readable:
            data, fds, _, _ = socket.recv_fds(sock, MESSAGE_BYTES, 2)
            if not data:
                return  # the test process closed its end: no more children to start
            try:
                _, args, env, new_session, cwd = pickle.loads(data)
                preload_s = _preload(parser, args, env, cwd)
                started_read, started_write = os.pipe()
                pid = os.fork()
            except Exception as error:  # noqa: BLE001 -- answered: the test starts a fresh interpreter instead
                for fd in fds:
                    os.close(fd)
                sock.send(pickle.dumps(("error", repr(error))))
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)  # before its descriptor closes: no signal is written to a reused one
                for fd in (wake_read, wake_write, started_read):
                    os.close(fd)
                _child(sock, args, env, new_session, cwd, fds, started_write)
            for fd in (*fds, started_write):
                os.close(fd)
            os.read(started_read, 1)  # as Popen returns: the child has its session and its descriptors (or died)
            os.close(started_read)
            sock.send(pickle.dumps(("pid", pid, preload_s)))
            _reap(sock)


def _read_the_embedded_tokenizer() -> None:
    """The embedded model's tokenizer.json parsed and its byte pieces built here, once, for every child to find
    (common/text/tokenizer.py keeps them per file): most of the suite's workers and proxies read that file, the tiny
    models' copies of it included, and each child would spend 0.2-0.3 CPU-s on it. The library's thread pool stays
    unstarted, as a fork needs it (TOKENIZERS_PARALLELISM for the while)."""
    from common.storage.model_store import embedded_model_dir
    from common.text.tokenizer import Tokenizer

    model_dir = embedded_model_dir("float32")
    if not (model_dir / "tokenizer.json").is_file():
        return  # not prepared (yet): each child reads its own
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tokenizer = Tokenizer(model_dir)
        for skip_special_tokens in (True, False):
            tokenizer.byte_pieces(skip_special_tokens)
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _preload(parser, args: list[str], env: dict[str, str], cwd: str) -> float:
    """A worker's model loaded here, before the worker is forked, for it to adopt (common/engine/models/preloaded.py):
    the suite starts many workers of a few models, and each would read the same checkpoint and prepack the same
    weights (float32 on one rank only; the short model on an AVX2 host: about 0.6 of a worker's 1.0-1.5 CPU-s of
    load, nearly all of it faulting in fresh pages). Under the child's environment and working directory, which
    its settings and its model's path may read. Only where torch computes on one thread here (a lane's
    OMP_NUM_THREADS=1, tests/conftest.py): the load's operators then start no OpenMP threads, which a fork would
    leave behind. What fails here is said in this server's log and left to the child, which then loads its model
    itself, as it would have. Returns the CPU-seconds it took."""
    if args[0] not in WORKER_COMMANDS:
        return 0.0
    import torch

    if torch.get_num_threads() != 1:
        return 0.0
    started = time.process_time()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        from common.cli.worker_command import worker_config
        from common.engine.models.preloaded import preload
        from common.runtime.model_swap import engine_config

        config = worker_config(parser.parse_args(args))
        preload(engine_config(config.engine, config.engine.model, config.role))
    except (Exception, SystemExit) as error:  # noqa: BLE001 -- argparse's exit too: the child meets it on its own
        print(f"no model preloaded for {args}: {error!r}", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
    return time.process_time() - started


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        cpu = usage.ru_utime + usage.ru_stime  # the child's and that of the processes it reaped
        sock.send(pickle.dumps(("exit", pid, os.waitstatus_to_exitcode(status), cpu)))


def _child(sock: socket.socket, args: list[str], env: dict[str, str], new_session: bool, cwd: str, fds: list[int],
           started: int) -> None:
    """Never returns: becomes ``python -m common.cli.main ARGS`` and exits as that interpreter would."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        if new_session:
            os.setsid()
        os.chdir(cwd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            os.close(fd)
        sys.stdout, sys.stderr = (_unbuffered(fd) for fd in (1, 2))
        os.environ.clear()
        os.environ.update(env)
        if args[0] in WORKER_COMMANDS:  # never re-executed for its allocator (common/engine/malloc.py): its
            os.environ[REEXEC_ENV] = "1"  # command line is the server's
        os.write(started, b"1")
        os.close(started)
        import common.cli.main as entry

        sys.argv = [entry.__file__, *args]
        sys.modules["__main__"] = entry  # what multiprocessing's spawn imports in a rank as the main module
        code = entry.main(args)
    except SystemExit as stop:
        code = stop.code
    except KeyboardInterrupt:  # as the interpreter: it dies of SIGINT (after its exit steps)
        _finish(None)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # as the interpreter: the traceback on stderr, status 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        os._exit(_finish(code))


def _unbuffered(fd: int) -> io.TextIOWrapper:
    """Text on ``fd`` as under PYTHONUNBUFFERED: each write reaches the descriptor."""
    return io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding="utf-8", errors="backslashreplace",
                            line_buffering=True, write_through=True)


def _finish(code) -> int:
    """The interpreter's exit steps for status ``code`` (SystemExit's: None, an int, or a message)."""
    for step in (threading._shutdown, atexit._run_exitfuncs):  # noqa: SLF001 -- what Py_Finalize runs, in order
        try:
            step()
        except BaseException:  # reported, and the next step runs, as the interpreter does
            import traceback

            traceback.print_exc()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return status


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[2:])
