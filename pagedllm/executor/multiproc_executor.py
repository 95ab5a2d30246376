"""One spawned process per rank, each running a ``Worker``; ``torch.distributed`` (gloo on CPU,
NCCL on CUDA) between them, a pipe per rank to this process.

Channel: a duplex ``multiprocessing`` pipe per rank carrying pickled messages. A step is
encoded once (``SchedulerOutputEncoder``: only what the workers have not seen), pickled once
and written to every rank's pipe; only the output rank (TP rank 0 of the last stage) answers
with its ``ModelRunnerOutput``, the others answer only with an error. vLLM uses shared-memory
ring buffers here; on CPU a pipe write and read cost ~20-40 us per step (measured in
docs/distributed.md), small beside a step's milliseconds of collectives.

Faults: the engine waits on the output rank's pipe together with every pipe (an error from any
rank) and every process sentinel (a rank that died), with a timeout
(``PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S``, default 300 s); each rank's heartbeat thread stamps a
shared array every second, so ``check_health`` also names a rank that stopped (e.g. SIGSTOP).
Any of these marks the executor failed (``ExecutorDeadError`` naming the rank): the ranks'
collectives cannot be trusted afterwards. ``shutdown`` asks every rank to exit, then
terminates and finally kills what is left.
"""
from __future__ import annotations

import logging
import mmap
import os
import pickle
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Client, Listener
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Optional, Union

from pagedllm.config import EngineArgs
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor, ExecutorDeadError
from pagedllm.executor.sched_codec import SchedulerOutputDecoder, SchedulerOutputEncoder
from pagedllm import envs

logger = logging.getLogger("pagedllm")

HEARTBEAT_INTERVAL_S = 1.0


def _env_float(name: str, default: float) -> float:
    """The declared float variable ``name`` (pagedllm/envs.py; ``default`` is its declared default).

    Raises:
        ValueError: a value that is not a number (naming the variable).
    """
    assert envs.ENV_VARS[name].default == default, f"{name}: default differs from pagedllm/envs.py"
    return float(envs.get(name))


def get_open_port() -> int:
    """A free TCP port on 127.0.0.1 chosen by the OS (never hard-coded)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """A rank's process: ``sentinel`` (a pidfd, readable once it exits), ``is_alive``,
    ``exitcode``, ``terminate`` / ``kill`` / ``join``."""

    def __init__(self, rank: int, popen: subprocess.Popen) -> None:
        self.rank, self.popen, self.pid = rank, popen, popen.pid
        self.sentinel = os.pidfd_open(popen.pid)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> Optional[int]:
        return self.popen.poll()

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def join(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        try:
            os.close(self.sentinel)
        except OSError:
            pass


class _Heartbeats:
    """One float64 (``time.time()``) per rank in a small shared file, written by each rank's
    heartbeat thread and read by ``check_health``."""

    def __init__(self, path: str, n: int, create: bool) -> None:
        self.path, self.n = path, n
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, 8 * n)
        finally:
            os.close(fd)
        self._owner = create

    @classmethod
    def create(cls, n: int) -> "_Heartbeats":
        fd, path = tempfile.mkstemp(prefix="pagedllm-heartbeat-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.write(fd, b"\0" * 8 * n)
        os.close(fd)
        return cls(path, n, True)

    def stamp(self, rank: int) -> None:
        struct.pack_into("d", self._mm, 8 * rank, time.time())

    def __iter__(self):
        return iter(struct.unpack_from(f"{self.n}d", self._mm, 0))

    def close(self) -> None:
        try:
            self._mm.close()
        except (ValueError, BufferError):
            pass
        if self._owner:
            try:
                os.unlink(self.path)
            except OSError:
                pass


class StepFuture:
    """The output of a step sent with ``non_block=True``; ``result()`` reads replies in order."""

    def __init__(self, executor: "MultiprocExecutor") -> None:
        self._executor = executor
        self._done = False
        self._value: Any = None
        self._error: Optional[BaseException] = None

    def set(self, value: Any = None, error: Optional[BaseException] = None) -> None:
        self._done, self._value, self._error = True, value, error

    def result(self) -> ModelRunnerOutput:
        while not self._done:
            self._executor._read_one_step()
        if self._error is not None:
            raise self._error
        return self._value


class MultiprocExecutor(Executor):
    """``tensor_parallel_size x pipeline_parallel_size`` spawned worker processes."""

    def _init_executor(self) -> None:
        args = self.args
        n = self.world_size
        loaded = self._load_model_info_first()
        self.output_rank = (args.pipeline_parallel_size - 1) * args.tensor_parallel_size
        self._encoder = SchedulerOutputEncoder()
        self._pending: deque[StepFuture] = deque()
        self._closed = False
        self._failure: Optional[str] = None
        self._lock = threading.Lock()
        self._heartbeats = _Heartbeats.create(n)
        # NOTE: this process hosts the rendezvous store on a port the OS binds at once (port 0);
        # picking a free port for rank 0 to bind later raced with other processes (EADDRINUSE).
        import datetime

        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=1800))
        init_method = f"tcpstore://127.0.0.1:{self._store.port}"
        self.procs: list[_Proc] = []
        self.conns: list[Any] = []
        authkey = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        try:
            env = dict(os.environ, PAGEDLLM_WORKER_ADDRESS=f"{listener.address[0]}:{listener.address[1]}",
                       PAGEDLLM_WORKER_AUTHKEY=authkey.hex())
            for rank in range(n):
                # NOTE: a fresh interpreter running this module (not multiprocessing's spawn,
                # which re-imports the caller's __main__ and needs an `if __name__` guard there).
                popen = subprocess.Popen([sys.executable, "-m", "pagedllm.executor.multiproc_executor",
                                          str(rank)], env=env, stdin=subprocess.DEVNULL)
                self.procs.append(_Proc(rank, popen))
            conns: dict[int, Any] = {}
            # NOTE: accept in 1 s slices so that a rank dying before it connects is reported.
            listener._listener._socket.settimeout(1.0)
            while len(conns) < n:
                try:
                    c = listener.accept()
                except socket.timeout:
                    dead = self._dead_rank()
                    if dead:
                        raise self._fail(dead) from None
                    continue
                rank = c.recv()
                # NOTE: every rank of every data-parallel replica shares this machine's cores.
                c.send((args, rank, init_method, n * max(1, args.data_parallel_size), self._heartbeats.path))
                conns[rank] = c
            self.conns = [conns[r] for r in range(n)]
            self._timeout = _env_float("PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S", 300.0)
            startup = _env_float("PAGEDLLM_WORKER_STARTUP_TIMEOUT_S", 1800.0)
            self.collective_rpc("init_device", timeout=startup)
            self.collective_rpc("load_model", timeout=startup)
            infos = self.collective_rpc("model_info", kwargs={"with_loaded": False})
            import dataclasses
            self.model_info = dataclasses.replace(infos[self.output_rank], loaded=loaded)
            self.rank_infos = infos
        except BaseException:
            self.shutdown()
            raise
        finally:
            listener.close()
        logger.info("pagedllm: %d worker processes (tensor_parallel_size %d, pipeline_parallel_size %d), pids %s",
                    n, args.tensor_parallel_size, args.pipeline_parallel_size, [p.pid for p in self.procs])

    def get_memory_stats(self) -> dict:
        """The worker processes' summed RSS (read from /proc: no call to the workers)."""
        from pagedllm.metrics.memory import resident_memory_bytes

        return {"resident_memory_bytes": sum(resident_memory_bytes(p.pid) for p in self.procs)}

    # ------------------------------------------------------------------ channel
    def _dead_rank(self) -> Optional[str]:
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                return f"worker rank {rank} (pid {p.pid}) died with exit code {p.exitcode}"
        return None

    def _wait_dead_rank(self, timeout: float) -> Optional[str]:
        """The first rank found dead within ``timeout`` seconds, described, or None."""
        mp_wait([p.sentinel for p in self.procs], timeout)
        return self._dead_rank()

    def _send_all(self, data: bytes) -> None:
        for rank, c in enumerate(self.conns):
            try:
                c.send_bytes(data)
            except (BrokenPipeError, ConnectionError, OSError) as e:
                raise self._fail(self._dead_rank() or f"worker rank {rank}: cannot send ({e!r})") from None

    def _recv(self, want: list[int], timeout: Optional[float]) -> dict[int, Any]:
        """Read one reply from each rank in ``want``; any rank's error, death or silence past
        ``timeout`` raises ``ExecutorDeadError`` (a failing call's own exception is re-raised
        only for RPCs every rank answers)."""
        got: dict[int, Any] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        by_conn = {c: r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(got) < len(want):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = mp_wait(list(by_conn) + list(by_sentinel), left)
            if not ready:
                missing = [r for r in want if r not in got]
                raise self._fail(f"worker rank(s) {missing} did not answer within {timeout:.0f} s "
                                 f"(PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S)")
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    try:
                        status, value = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        raise self._fail(self._dead_rank() or f"worker rank {rank} closed its pipe") from None
                    if status == "err":
                        desc, exc = value
                        # NOTE: a peer's death shows first as a collective error on the ranks
                        # still alive: name the rank that died when one did (waited for briefly).
                        cause = self._wait_dead_rank(1.0)
                        dead = self._fail(f"{cause} (rank {rank}: {desc})" if cause
                                          else f"worker rank {rank} failed: {desc}")
                        if exc is not None:  # an RPC's own error (e.g. a ValueError at load)
                            raise exc from dead
                        raise dead
                    if rank not in want or rank in got:
                        raise self._fail(f"worker rank {rank} answered out of turn")
                    got[rank] = value
            for obj in ready:
                if obj in by_sentinel:
                    # NOTE: a pipe may still hold the rank's last words (its error): read first.
                    rank = by_sentinel[obj]
                    if self.conns[rank].poll():
                        continue
                    raise self._fail(self._dead_rank() or f"worker rank {rank} exited")
        return got

    def _check_usable(self) -> None:
        if self._closed:
            raise ExecutorDeadError("executor is shut down")
        if self._failure is not None:
            raise ExecutorDeadError(self._failure)

    # ------------------------------------------------------------------ calls
    def collective_rpc(self, method: Union[str, Callable], timeout: Optional[float] = None,
                       args: tuple = (), kwargs: Optional[dict] = None) -> list[Any]:
        with self._lock:
            self._check_usable()
            while self._pending:
                self._read_one_step_locked()
            self._send_all(pickle.dumps(("rpc", (method, args, kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL))
            got = self._recv(list(range(self.world_size)), timeout if timeout is not None else self._timeout)
            return [got[r] for r in range(self.world_size)]

    def get_pooler(self) -> Any:
        return self.collective_rpc("get_pooler")[self.output_rank]

    def execute_model(self, so: SchedulerOutput, non_block: bool = False
                      ) -> Union[ModelRunnerOutput, StepFuture]:
        if so.is_empty:
            # Only frees: carried by the next real step (no round trip).
            self._encoder.defer(so)
            fut = StepFuture(self)
            fut.set(ModelRunnerOutput())
            return fut if non_block else fut.result()
        with self._lock:
            self._check_usable()
            data = pickle.dumps(("execute", self._encoder.encode(so)), protocol=pickle.HIGHEST_PROTOCOL)
            self._send_all(data)
            fut = StepFuture(self)
            fut.sent_at = time.monotonic()
            self._pending.append(fut)
        return fut if non_block else fut.result()

    def _read_one_step(self) -> None:
        with self._lock:
            self._read_one_step_locked()

    def _read_one_step_locked(self) -> None:
        fut = self._pending[0]
        if fut._done:
            return
        try:
            got = self._recv([self.output_rank], self._timeout)
        except ExecutorDeadError as e:
            for f in self._pending:
                f.set(error=e)
            self._pending.clear()
            return
        self._pending.popleft().set(got[self.output_rank])

    def check_health(self) -> None:
        """Raises ``ExecutorDeadError`` naming a rank that died, stopped beating or failed, or a
        step in flight past the timeout."""
        if self._closed:
            raise ExecutorDeadError("executor is shut down")
        if self._failure is not None:
            raise ExecutorDeadError(self._failure)
        dead = self._dead_rank()
        if dead:
            raise self._fail(dead)
        now = time.time()
        limit = _env_float("PAGEDLLM_WORKER_HEARTBEAT_TIMEOUT_S", 30.0)
        for rank, t in enumerate(self._heartbeats):
            if t and now - t > limit:
                raise self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) is not responding: "
                                 f"no heartbeat for {now - t:.0f} s")
        pending = list(self._pending)
        if pending and time.monotonic() - getattr(pending[0], "sent_at", time.monotonic()) > self._timeout:
            raise self._fail(f"a step has been running for more than {self._timeout:.0f} s "
                             f"(PAGEDLLM_EXECUTE_MODEL_TIMEOUT_S)")

    def shutdown(self) -> None:
        if getattr(self, "_closed", True) and not getattr(self, "procs", None):
            return
        self._closed = True
        procs, conns = list(getattr(self, "procs", [])), list(getattr(self, "conns", []))
        self.procs, self.conns = [], []
        msg = pickle.dumps(("shutdown", None))
        for c in conns:
            try:
                c.send_bytes(msg)
            except Exception:
                pass
        deadline = time.monotonic() + _env_float("PAGEDLLM_WORKER_SHUTDOWN_TIMEOUT_S", 5.0)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for c in conns:
            try:
                c.close()
            except Exception:
                pass
        for p in procs:
            p.close()
        self._store = None
        hb = getattr(self, "_heartbeats", None)
        if hb is not None:
            hb.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


# ---------------------------------------------------------------------------- worker process
def _heartbeat(heartbeats: _Heartbeats, rank: int, stop: threading.Event) -> None:
    while not stop.is_set():
        heartbeats.stamp(rank)
        stop.wait(HEARTBEAT_INTERVAL_S)


def _die_with_parent() -> None:
    """Linux: have the kernel kill this process when the engine process dies (prctl
    PR_SET_PDEATHSIG), so no rank outlives a killed engine."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _connect(rank: int):
    """Connect to the engine (address and key from the environment), receive this rank's setup."""
    host, port = os.environ["PAGEDLLM_WORKER_ADDRESS"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["PAGEDLLM_WORKER_AUTHKEY"]))
    conn.send(rank)
    return conn, conn.recv()


def _worker_main(args: EngineArgs, rank: int, init_method: str, local_world_size: int, conn,
                 heartbeats_path: str) -> None:
    """A rank's process: build the ``Worker``, then serve the engine's messages until
    ``shutdown`` or until the engine's end of the connection closes."""
    from pagedllm.worker.worker import Worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: Ctrl-C is the engine's to handle
    heartbeats = _Heartbeats(heartbeats_path, args.world_size, False)
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(heartbeats, rank, stop), daemon=True,
                     name="pagedllm-heartbeat").start()
    worker = Worker(args, rank=rank, distributed_init_method=init_method,
                    local_world_size=local_world_size, load_tokenizer=False)
    decoder = SchedulerOutputDecoder()
    dumps = pickle.dumps
    proto = pickle.HIGHEST_PROTOCOL
    try:
        while True:
            try:
                kind, payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the engine is gone
            if kind == "execute":
                try:
                    out = worker.execute_model(decoder.decode(payload))
                except BaseException as e:
                    conn.send_bytes(dumps(("err", (_describe(e), None)), protocol=proto))
                    raise
                if out is not None:
                    conn.send_bytes(dumps(("ok", out), protocol=proto))
            elif kind == "rpc":
                method, a, kw = payload
                try:
                    fn = getattr(worker, method) if isinstance(method, str) else (
                        lambda *x, **y: method(worker, *x, **y))  # noqa: B023 (called right below)
                    result = fn(*a, **kw)
                    if method == "load_model":
                        result = None  # NOTE: the LoadedModel is not picklable; see model_info
                    reply = ("ok", result)
                except Exception as e:
                    reply = ("err", (_describe(e), _picklable(e)))
                conn.send_bytes(dumps(reply, protocol=proto))
            elif kind == "shutdown":
                break
    finally:
        stop.set()
        try:
            worker.shutdown()
        except Exception:
            pass


def _picklable(e: BaseException) -> Optional[BaseException]:
    """``e`` when it survives pickling (to be re-raised in the engine), else None."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return None


def _describe(e: BaseException) -> str:
    """``Type: message`` plus the innermost frame, for the engine's error message."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


if __name__ == "__main__":
    _die_with_parent()
    _rank = int(sys.argv[1])
    _conn, (_args, _r, _init, _n, _hb) = _connect(_rank)
    _worker_main(_args, _r, _init, _n, _conn, _hb)
    # NOTE: a clean end (shutdown or the engine gone): the worker has left its process groups and
    # holds nothing to flush but stdio, so skip the interpreter's teardown (freeing the model and
    # unloading torch: ~0.5 s per rank at every engine shutdown). An error still exits through
    # the traceback above, with status 1.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
