"""Faults injected at every call to the environment, reproducibly: a chaos scenario against a really
serving gopherplug.

One scenario (``run_seed``) runs gopherplug in this process, device plugin and DRA driver at once
(serve_plugin with watch_config_file, as `gopherplug serve` runs it), against gopherplug's own
KubeletSimulator, the strict DraKubeletSimulator and ApiServerSimulator, on real unix sockets, real
inotify, real files and real programs (``describe``, ``pre_start``). Devices come and go, both
kubelets restart, claims are prepared and unprepared, the configuration is reloaded, with faults on;
then the faults stop and the scenario checks the invariants:

- the process is alive: serve_plugin did not end, the event loop never stopped for long;
- it converges to the truth within CONVERGE_BOUND: the kubelet's list equals the device directory,
  the API server's slices equal the DRA directory (with the attribute of the configuration last
  written), every claim the kubelet holds prepared has its CDI spec and its checkpoint entry;
- nothing prepared is lost or prepared twice with different answers: each claim prepared again
  answers what its first preparation answered.

The faults (FAULTS: kind, where, what the real environment does) are chosen by a random.Random of
the seed: for each step of the scenario, an action and the faults armed for it; an armed fault fires
at the next call of gopherplug that it matches (``times`` of them), and each firing is recorded as
(kind, call), so a seed's report lists what was injected. Injection is in-process and never in the
product: gopherplug's module-level names (``os``, ``open``, ``tempfile``, ``anyio``, ``INotify``,
``run_program``) are replaced by wrappers for the scenario's time, which fail only calls made by
gopherplug's serving code (not by the stand-ins that live in the same module); the stand-ins'
answers are the API server's and the kubelet's own hooks, subclassed here. What only the outside
can do is done from the outside: a FIFO where a ``file:`` attribute is read, a tmpfs mounted over a
device directory, peers that never read.

CI runs CI_SEEDS (together they inject every kind: test_ci_seeds_inject_every_kind), each as its own
test whose id names the seed; a failing seed replays with
``pytest test_chaos.py -k 'seed_<N>'`` or ``python bench/chaos.py --start N --seeds 1``.
bench/chaos.py runs as many seeds as asked and writes the figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import itertools
import json
import os
import random
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import h2.config
import h2.connection
import pytest
import trio
import yaml
from inotify_simple import Event as InotifyEvent
from inotify_simple import INotify, flags

import gopherplug as gp
import gopherplug_standins as standins

DRIVER = "gopherplug.example.com"
NODE = "node-1"
NODE_UID = "0b6f8a5e-4c1d-4e0a-9f3b-2d7c1e9a8b01"
MOLE = "example.com/mole"  # the device-plugin resource
GOPHER = "example.com/gopher"  # the DRA resource
POOL = gp.dra_pool_name(NODE, GOPHER)
#: How long the scenario may take to reach the truth once the faults stop (seconds): past the
#: product's longest retry interval after a failure, with room for a loaded machine.
CONVERGE_BOUND = 45.0
#: The event loop may stop this long before the watchdog calls it blocked (and frees what blocks it).
BLOCKED_BOUND = 5.0
#: How long a step waits for its armed faults to fire before going on (they may fire later).
STEP_BOUND = 1.5

#: Every kind of fault: kind -> (where it strikes, what the real environment does there).
FAULTS: dict[str, tuple[str, str]] = {
    # The API server, or what stands in front of it (a load balancer, a proxy)
    "api_html_502": ("API server, any request", "a load balancer's HTML 502 page"),
    "api_html_503": ("API server, any request", "HAProxy's HTML 503 page (no server available)"),
    "api_html_504": ("API server, any request", "a load balancer's HTML 504 page (gateway timeout)"),
    "api_503_no_content_type": ("API server, any request", "a 503 whose Status JSON has no Content-Type"),
    "api_json_charset": ("API server, any request", "a 500 Status as application/json; charset=utf-8"),
    "api_non_json_5xx": ("API server, any request", "a 500 whose body is not JSON (a proxy's text)"),
    "api_410_gone": ("API server, a watch", "410 Gone: the watch's resourceVersion is too old"),
    "api_429_retry_after": ("API server, any request", "429 Too Many Requests with Retry-After: 1"),
    "api_wrong_shape_200": ("API server, a list or write", "a 200 whose object has the wrong shape"),
    "api_hang": ("API server, any request", "no answer at all, the connection kept open"),
    "api_reset_mid_body": ("API server, any request", "headers, half the body, then a TCP reset"),
    "api_refused": ("API server, any request", "the connection cut, then refused for a moment"),
    # The filesystem
    "cdi_enospc": ("tempfile.mkstemp in the CDI spec directory", "ENOSPC: the disk is full"),
    "cdi_erofs": ("tempfile.mkstemp in the CDI spec directory", "EROFS: mounted read-only"),
    "cdi_eacces": ("tempfile.mkstemp in the CDI spec directory", "EACCES: permission denied"),
    "checkpoint_enospc": ("tempfile.mkstemp of the claims' checkpoint", "ENOSPC"),
    "checkpoint_erofs": ("tempfile.mkstemp of the claims' checkpoint", "EROFS"),
    "checkpoint_eacces": ("tempfile.mkstemp of the claims' checkpoint", "EACCES"),
    "nfd_enospc": ("tempfile.mkstemp of the NFD feature file", "ENOSPC"),
    "nfd_erofs": ("tempfile.mkstemp of the NFD feature file", "EROFS"),
    "nfd_eacces": ("tempfile.mkstemp of the NFD feature file", "EACCES"),
    "emfile_scan": ("os.listdir / os.scandir of a device directory", "EMFILE: out of file descriptors"),
    "emfile_config": ("open() of the configuration file", "EMFILE"),
    "emfile_socket": ("anyio.connect_unix / create_unix_listener", "EMFILE"),
    "emfile_program": ("os.memfd_create for describe, run_program", "EMFILE"),
    "read_never_returns": ("a file: attribute", "a FIFO nobody writes: open() never returns"),
    "sysfs_read_hangs": (
        "open() of a device node's sysfs numa_node in a directory's scan",
        "a hung device's sysfs: the read returns after BLOCKED_BOUND + 1 s, or when the faults stop",
    ),
    "remount": ("a device directory (a tmpfs)", "unmounted, a tmpfs mounted again with other devices"),
    # inotify
    "inotify_overflow": ("INotify.read", "IN_Q_OVERFLOW: the queue overflowed, its events lost"),
    "inotify_watch_limit": ("INotify.add_watch", "ENOSPC: fs.inotify.max_user_watches reached"),
    # Programs
    "describe_fork_fails": ("run_program of describe", "EAGAIN: fork failed (pids limit)"),
    "describe_killed": ("run_program of describe", "the program killed by SIGKILL"),
    "pre_start_fork_fails": ("run_program of pre_start", "EAGAIN: fork failed"),
    "pre_start_killed": ("run_program of pre_start", "the program killed by SIGKILL"),
    # The kubelet and other peers
    "kubelet_gone_after_accept": ("the kubelet's Register", "the kubelet restarts with the call accepted"),
    "registration_refused": ("the kubelet's Register", "refused: failed to dial device plugin"),
    "peer_never_reads": ("the device plugin's socket", "ListAndWatch peers that never read"),
}

#: The actions of the scenario, and the faults each one is the natural trigger of.
ACTIONS: dict[str, tuple[str, ...]] = {
    "add_mole": ("nfd_enospc", "nfd_erofs", "nfd_eacces", "inotify_overflow", "emfile_scan", "sysfs_read_hangs"),
    "remove_mole": ("emfile_scan", "inotify_overflow", "nfd_eacces"),
    "add_gopher": (
        "cdi_enospc",
        "cdi_erofs",
        "cdi_eacces",
        "emfile_scan",
        "read_never_returns",
        "describe_fork_fails",
        "describe_killed",
        "emfile_program",
        "api_html_502",
        "api_html_503",
        "api_html_504",
        "api_503_no_content_type",
        "api_json_charset",
        "api_non_json_5xx",
        "api_429_retry_after",
        "api_wrong_shape_200",
        "api_hang",
        "api_reset_mid_body",
        "api_refused",
        "api_410_gone",
    ),
    "remove_gopher": ("cdi_enospc", "api_html_503", "api_wrong_shape_200", "api_reset_mid_body"),
    "restart_kubelet": ("registration_refused", "kubelet_gone_after_accept", "emfile_socket"),
    "reprovision_kubelet": ("inotify_watch_limit", "emfile_socket", "registration_refused"),
    "restart_dra_kubelet": ("emfile_socket", "api_410_gone"),
    "prepare": ("checkpoint_enospc", "checkpoint_erofs", "checkpoint_eacces", "cdi_erofs", "api_json_charset"),
    "unprepare": ("checkpoint_eacces", "checkpoint_enospc"),
    "reload": ("emfile_config", "describe_killed", "cdi_eacces", "inotify_watch_limit", "remount"),
    "pre_start": ("pre_start_fork_fails", "pre_start_killed"),
    "peers": ("peer_never_reads",),
}
assert {kind for kinds in ACTIONS.values() for kind in kinds} == set(FAULTS)
#: The action that surely makes the call a fault strikes: the first that lists it; for the API
#: server's, a preparation (a new claim is read from the API server at once, while the slice
#: publisher may be waiting out a Retry-After).
TRIGGER = {kind: next(action for action, kinds in ACTIONS.items() if kind in kinds) for kind in FAULTS}
TRIGGER |= {kind: "prepare" for kind in FAULTS if kind.startswith("api_") and kind != "api_410_gone"}

#: Frames of these classes are the stand-ins (they live in gopherplug's module too): never faulted.
STANDIN_CLASSES = frozenset(
    {
        "KubeletSimulator",
        "DraKubeletSimulator",
        "LenientApiServer",
        "ApiServerSimulator",
        "ChaosApiServer",
        "ChaosKubelet",
        "PodResourcesSimulator",
    }
)


# ---------------------------------------------------------------------------------------------------
# The plan and the injector


@dataclasses.dataclass(frozen=True)
class Step:
    action: str
    faults: tuple[tuple[str, int], ...]  #: (kind, times): armed before the action


def plan(seed: int, steps: int = 6) -> list[Step]:
    """The scenario of a seed: ``steps`` actions, each with 0 to 2 faults among those it triggers."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        action = rng.choice(sorted(ACTIONS))
        kinds = rng.sample(ACTIONS[action], k=min(len(ACTIONS[action]), rng.choice((0, 1, 1, 2))))
        chosen.append(Step(action, tuple((kind, rng.choice((1, 1, 2, 3))) for kind in kinds)))
    return chosen


class Injector:
    """Which faults are armed, and every one injected: (kind, the call it struck)."""

    def __init__(self) -> None:
        self.armed: dict[str, int] = {}
        self.injected: list[tuple[str, str]] = []
        self.on = True
        self.fired = gp.Watched(None)  # touched at every injection (in the loop's thread)
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None

    def arm(self, kind: str, times: int) -> None:
        with self._lock:
            self.armed[kind] = self.armed.get(kind, 0) + times

    def take(self, kind: str, call: str) -> bool:
        """Whether ``call`` fails with ``kind`` now (and if so, it is recorded)."""
        with self._lock:
            if not self.on or self.armed.get(kind, 0) <= 0:
                return False
            self.armed[kind] -= 1
            if not self.armed[kind]:
                del self.armed[kind]
            self.injected.append((kind, call))
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self.fired.touch)
        return True

    def disarm(self, kinds: Iterable[str]) -> None:
        with self._lock:
            for kind in kinds:
                self.armed.pop(kind, None)

    def stop(self) -> None:
        with self._lock:
            self.on = False
            self.armed.clear()


def _from_product() -> bool:
    """Whether the call being wrapped comes from gopherplug's own serving code, not from a stand-in
    (the simulators live in its module too) nor from this scenario: gopherplug's code on the stack,
    and no stand-in's, in this task nor in the tasks that started it (a trio task's name is its
    function's qualified name)."""
    frame = sys._getframe(1)  # this module's frames (the wrappers) are passed over
    product = False
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if str(name).startswith("trio._core"):
            break  # the task's root: below it is whoever called trio.run
        if name == "gopherplug":
            if frame.f_code.co_qualname.split(".")[0] in STANDIN_CLASSES:
                return False
            product = True
        elif name == "gopherplug_standins":
            return False
        frame = frame.f_back  # type: ignore[assignment]
    try:
        task: Any = trio.lowlevel.current_task()
    except RuntimeError:
        return product  # a worker thread: its stack is all there is
    while task is not None:
        if STANDIN_CLASSES.intersection(task.name.split(".")):
            return False
        task = task.parent_nursery.parent_task if task.parent_nursery is not None else None
    return product


def _oserror(code: int, path: str = "") -> OSError:
    return OSError(code, os.strerror(code), *([path] if path else []))


class _Delegate:
    """A module's stand-in: every name is the module's, but for those defined on the subclass."""

    def __init__(self, module: Any, chaos: Chaos) -> None:
        self._module, self._chaos = module, chaos

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _Os(_Delegate):
    def listdir(self, path: Any = ".") -> list[str]:
        self._chaos.scan_fault(path)
        return os.listdir(path)

    def scandir(self, path: Any = ".") -> Any:
        self._chaos.scan_fault(path)
        return os.scandir(path)

    def memfd_create(self, name: str, *args: Any) -> int:
        if _from_product() and self._chaos.injector.take("emfile_program", f"os.memfd_create({name!r})"):
            raise _oserror(errno.EMFILE)
        return os.memfd_create(name, *args)


class _Tempfile(_Delegate):
    def mkstemp(self, suffix: Any = None, prefix: Any = None, dir: Any = None, text: bool = False) -> Any:
        self._chaos.write_fault(str(dir), str(prefix))
        return tempfile.mkstemp(suffix, prefix, dir, text)


class _Anyio(_Delegate):
    async def connect_unix(self, path: Any) -> Any:
        if _from_product() and self._chaos.injector.take("emfile_socket", f"anyio.connect_unix({path})"):
            raise _oserror(errno.EMFILE)
        return await self._module.connect_unix(path)

    async def create_unix_listener(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        if _from_product() and self._chaos.injector.take("emfile_socket", f"anyio.create_unix_listener({path})"):
            raise _oserror(errno.EMFILE)
        return await self._module.create_unix_listener(path, *args, **kwargs)


class Chaos:
    """The wrappers of gopherplug's module-level names, for one scenario (``installed()``)."""

    def __init__(self, injector: Injector, root: Path) -> None:
        self.injector, self.root = injector, root
        self.describe = str(root / "describe")
        self.pre_start = str(root / "pre-start")
        self.faults_off = threading.Event()  # set when the faults stop: a hung read returns

    def scan_fault(self, path: Any) -> None:
        path = os.fspath(path)
        if path.startswith(str(self.root / "devs")) and _from_product():
            if self.injector.take("emfile_scan", f"scan {os.path.basename(path)}"):
                raise _oserror(errno.EMFILE, path)

    def write_fault(self, directory: str, prefix: str) -> None:
        where = (
            "checkpoint"
            if prefix == ".checkpoint-"
            else "nfd"
            if directory == str(self.root / "nfd")
            else "cdi"
            if directory == str(self.root / "cdi")
            else ""
        )
        for code in (errno.ENOSPC, errno.EROFS, errno.EACCES):
            kind = f"{where}_{errno.errorcode[code].lower()}"
            if where and self.injector.take(kind, f"tempfile.mkstemp({prefix!r}) in {os.path.basename(directory)}"):
                raise _oserror(code, os.path.join(directory, prefix + "XXXX.tmp"))

    def open(self, file: Any, *args: Any, **kwargs: Any) -> Any:
        if file == str(self.root / "config.yaml") and _from_product():
            if self.injector.take("emfile_config", "open(config.yaml)"):
                raise _oserror(errno.EMFILE, file)
        # A scan's read (Allocate's look at the device it gives takes the scan's numa_node, reads none)
        if str(file).endswith("/numa_node") and _from_product():
            if self.injector.take("sysfs_read_hangs", f"open({file})"):
                self.faults_off.wait(BLOCKED_BOUND + 1)  # past the watchdog's bound: a frozen loop is seen
        return open(file, *args, **kwargs)

    async def run_program(self, argv: Any, env: Any, **kwargs: Any) -> Any:
        argv = list(argv)
        which = {self.describe: "describe", self.pre_start: "pre_start"}.get(argv[0], "")
        if which and self.injector.take(f"{which}_fork_fails", f"run_program({which})"):
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        if which == "describe" and self.injector.take("emfile_program", "run_program(describe)"):
            raise _oserror(errno.EMFILE)
        if which and self.injector.take(f"{which}_killed", f"run_program({which})"):
            argv = ["/bin/sh", "-c", "kill -KILL $$"]  # the program, killed by a signal as it runs
        return await self._run_program(argv, env, **kwargs)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        chaos = self

        class ChaosINotify(INotify):  # type: ignore[misc]
            def add_watch(self, path: Any, mask: int) -> int:
                if _from_product() and chaos.injector.take(
                    "inotify_watch_limit", f"add_watch({os.path.basename(path)})"
                ):
                    raise _oserror(errno.ENOSPC)
                wd: int = super().add_watch(path, mask)
                return wd

            def read(self, timeout: Any = None, read_delay: Any = None) -> list[Any]:
                events: list[Any] = super().read(timeout, read_delay)
                if events and _from_product() and chaos.injector.take("inotify_overflow", "INotify.read"):
                    return [InotifyEvent(-1, flags.Q_OVERFLOW, 0, "")]  # what was queued is lost
                return events

        self._run_program = gp.run_program
        saved = {name: vars(gp)[name] for name in ("os", "tempfile", "anyio", "INotify", "run_program")}
        replaced = {
            "os": _Os(os, self),
            "tempfile": _Tempfile(tempfile, self),
            "anyio": _Anyio(anyio, self),
            "INotify": ChaosINotify,
            "run_program": self.run_program,
            "open": self.open,
        }
        vars(gp).update(replaced)
        try:
            yield
        finally:
            vars(gp).update(saved)
            vars(gp).pop("open", None)


# ---------------------------------------------------------------------------------------------------
# The stand-ins' faults


HTML = {  # HAProxy's pages
    502: b"<h1>502 Bad Gateway</h1>\nThe server returned an invalid or incomplete response.\n",
    503: b"<h1>503 Service Unavailable</h1>\nNo server is available to handle this request.\n",
    504: b"<h1>504 Gateway Time-out</h1>\nThe server didn't respond in time.\n",
}
HTML = {code: b"<html><body>" + page + b"</body></html>\n" for code, page in HTML.items()}
REASONS = {410: "Gone", 429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway"}
REASONS |= {503: "Service Unavailable", 504: "Gateway Time-out", 200: "OK"}


def _status_json(code: int, reason: str, message: str) -> bytes:
    status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    return json.dumps({**status, "message": message, "reason": reason, "code": code}).encode()


class ChaosApiServer(standins.ApiServerSimulator):
    """The strict API server stand-in, whose answers the injector may replace with a fault's."""

    def __init__(self, injector: Injector) -> None:
        super().__init__()
        self.injector = injector
        self._refusing = trio.Event()
        self._refusing.set()  # set: listening

    async def run(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
                self.port = listeners[0].socket.getsockname()[1]
                async with trio.open_nursery() as serving:
                    serving.start_soon(functools.partial(trio.serve_listeners, self._connection, listeners))
                    task_status.started(self)
                    task_status = trio.TASK_STATUS_IGNORED
                    self._refusing = trio.Event()
                    await self._refusing.wait()
                    for listener in listeners:
                        await listener.aclose()
                    serving.cancel_scope.cancel()
                # Refused for a moment, as a server that is down refuses (the port is closed).
                await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

    async def _raw(self, stream: Any, status: int, headers: list[tuple[str, str]], body: bytes, cut: int = 0) -> None:
        head = f"HTTP/1.1 {status} {REASONS[status]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
        head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        await stream.send_all(head.encode() + body[: cut or len(body)])

    async def _refuse(self, http: Any, request: Any, headers: Any) -> bool:
        if await super()._refuse(http, request, headers):
            return True
        _, stream, _ = http
        target = request.target.decode()
        method = request.method.decode()
        call = f"{method} {target.split('?')[0]}"
        watch = "watch=true" in target or "watch=1" in target
        take = self.injector.take
        if take("api_refused", call):
            self._refusing.set()
            _reset(stream)
            return True
        for code in (502, 503, 504):
            if take(f"api_html_{code}", call):
                await self._raw(stream, code, [("content-type", "text/html")], HTML[code])
                return True
        if take("api_503_no_content_type", call):
            await self._raw(stream, 503, [], _status_json(503, "ServiceUnavailable", "the server is shutting down"))
            return True
        if take("api_json_charset", call):
            body = _status_json(500, "InternalError", "Internal error occurred: etcdserver: request timed out")
            await self._raw(stream, 500, [("content-type", "application/json; charset=utf-8")], body)
            return True
        if take("api_non_json_5xx", call):
            body = b"upstream connect error or disconnect/reset before headers. reset reason: connection failure"
            await self._raw(stream, 500, [("content-type", "text/plain")], body)
            return True
        if take("api_429_retry_after", call):
            body = _status_json(429, "TooManyRequests", "storage is (re)initializing")
            await self._raw(stream, 429, [("content-type", "application/json"), ("retry-after", "1")], body)
            return True
        if watch and take("api_410_gone", call):
            body = _status_json(410, "Expired", "too old resource version: 1 (2)")
            await self._raw(stream, 410, [("content-type", "application/json")], body)
            return True
        if not watch and method in ("GET", "POST", "PUT") and take("api_wrong_shape_200", call):
            await self._raw(stream, 200, [("content-type", "application/json")], _wrong_shape(method, target))
            return True
        if take("api_hang", call):
            await trio.sleep_forever()  # until the client gives up, or the scenario ends
        if take("api_reset_mid_body", call):
            body = _status_json(500, "InternalError", "x" * 2000)
            await self._raw(stream, 500, [("content-type", "application/json")], body, cut=len(body) // 2)
            _reset(stream)
            return True
        return False


def _reset(stream: Any) -> None:
    """Close the connection with a TCP reset (SO_LINGER 0), as a crashed peer or a proxy does."""
    with contextlib.suppress(OSError, AttributeError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()


def _wrong_shape(method: str, target: str) -> bytes:
    """A 200 of the wrong shape for this request: a list item without metadata, a written slice
    without spec, a Node whose status.allocatable is not a mapping."""
    path = target.split("?")[0]
    if "/nodes" in path:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": NODE_UID}, "status": "x"}
        if path.endswith("/nodes"):
            return json.dumps({"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": [node]}).encode()
        return json.dumps({**node, "status": {"allocatable": "x"}}).encode()
    if method == "GET" and path.endswith("/resourceslices"):
        listed = {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1", "metadata": {"resourceVersion": "1"}}
        return json.dumps({**listed, "items": [{"spec": {}}]}).encode()
    return json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "x"}}).encode()


class ChaosKubelet(gp.KubeletSimulator):
    """The kubelet stand-in, whose Register the injector may refuse or cut short."""

    def __init__(self, device_plugin_dir: str, injector: Injector) -> None:
        super().__init__(device_plugin_dir)
        self.injector = injector

    async def _register(self, request: Any, start: int) -> Any:
        call = f"Register({request.resource_name})"
        if self.injector.take("registration_refused", call):
            raise gp.RPCError(gp.StatusCode.UNKNOWN, "failed to dial device plugin: context deadline exceeded")
        if self.injector.take("kubelet_gone_after_accept", call):
            self.restart()  # every connection cut, kubelet.sock deleted and made again
            await trio.sleep_forever()
        return await super()._register(request, start)


async def never_reading_peer(socket_path: str, done: trio.Event) -> None:
    """A ListAndWatch peer that never reads its answers, until ``done``."""
    with contextlib.suppress(OSError, trio.BrokenResourceError):
        stream = await trio.open_unix_socket(socket_path)
        async with stream:
            h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            h2c.initiate_connection()
            headers = [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/v1beta1.DevicePlugin/ListAndWatch"),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
            h2c.send_headers(1, headers)
            h2c.send_data(1, b"\x00\x00\x00\x00\x00", end_stream=True)
            await stream.send_all(h2c.data_to_send())
            await done.wait()


# ---------------------------------------------------------------------------------------------------
# The scenario


@dataclasses.dataclass
class Report:
    """What one seed did and found."""

    seed: int
    injected: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    planned: set[str] = dataclasses.field(default_factory=set)
    restarts: int = 0
    converged_in: float | None = None
    violations: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        kinds = sorted({kind for kind, _ in self.injected})
        lines = [f"seed {self.seed}: injected {len(self.injected)} ({', '.join(kinds) or 'none'})"]
        lines += [f"  {kind}: {call}" for kind, call in self.injected]
        lines += [f"  VIOLATION: {violation}" for violation in self.violations]
        replay = f"pytest test_chaos.py -k 'seed_{self.seed}'  or  python bench/chaos.py --start {self.seed} --seeds 1"
        lines.append(f"  replay: {replay}")
        return "\n".join(lines)


def restarts_counted() -> int:
    """The restarts of serve's supervised tasks so far, as its metric gopherplug_task_restarts counts
    them (the scenario serves metrics for it); 0 while nothing serves them."""
    metrics = getattr(gp, "_metrics", None)
    counter = getattr(metrics, "restarts", None)
    if counter is None:
        return 0
    return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))


DESCRIBE = """#!/bin/sh
# Describes every device it is given: one attribute each.
printf '{'; sep=''; IFS=','
for id in $GOPHERPLUG_DEVICES; do printf '%s"%s": {"attributes": {"described": true}}' "$sep" "$id"; sep=', '; done
printf '}\\n'
"""


class Scenario:
    """One seed's node: the stand-ins, the device directories, the configuration, gopherplug."""

    def __init__(self, seed: int, root: Path, nursery: trio.Nursery) -> None:
        self.seed, self.root, self.nursery = seed, root, nursery
        self.rng = random.Random(seed ^ 0x5EED)
        self.injector = Injector()
        self.chaos = Chaos(self.injector, root)
        self.report = Report(seed)
        self.moles = root / "devs" / "moles"
        self.gophers = root / "devs" / "gophers"
        self.cdi = root / "cdi"
        self.kubelet_dir = root / "k"
        self.dp_dir = root / "dp"
        self.model = root / "model"
        self.generation = 1
        self.mounts: list[Path] = []
        self.peers_done = trio.Event()
        self.fifo_open = False
        #: claim UID -> (name, device); which of them the kubelet wants prepared now
        self.claims: dict[str, tuple[str, str]] = {}
        self.wanted: set[str] = set()
        self.answers: dict[str, list[tuple[str, str, tuple[str, ...]]]] = {}  # first answer of each claim
        self.ended: BaseException | str | None = None
        self.serving = trio.CancelScope()
        self.heartbeat = time.monotonic()
        self.next_id = 0

    # -- set-up

    def write_config(self) -> None:
        config = {
            "device_plugin_dir": str(self.dp_dir),
            "metrics_address": "127.0.0.1:0",  # for the supervisor's count of restarts
            "nfd_features_file": str(self.root / "nfd" / "gopherplug.features"),
            "dra": {"driver": DRIVER, "kubelet_dir": str(self.kubelet_dir), "device_metadata": False},
            "resources": [
                {"name": MOLE, "directory": str(self.moles), "pre_start": [self.chaos.pre_start]},
                {
                    "name": GOPHER,
                    "directory": str(self.gophers),
                    "api": "dra",
                    "cdi": {"kind": GOPHER, "spec_dir": str(self.cdi)},
                    "describe": [self.chaos.describe],
                    "attributes": {"generation": self.generation, "model": {"file": str(self.model)}},
                },
            ],
        }
        temporary = self.root / ".config.yaml.tmp"
        temporary.write_text(yaml.safe_dump(config))
        temporary.replace(self.root / "config.yaml")

    async def start(self) -> None:
        for directory in (self.moles, self.gophers, self.dp_dir, self.root / "nfd"):
            directory.mkdir(parents=True)
        for directory in (self.moles, self.gophers):  # each a file system of its own, for "remount"
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(directory)], check=True, capture_output=True)
            self.mounts.append(directory)
        for index in range(2):
            (self.moles / f"mole{index}").touch()
            (self.gophers / f"gopher{index}").touch()
        self.model.write_text("burrower\n")
        Path(self.chaos.describe).write_text(DESCRIBE)
        Path(self.chaos.pre_start).write_text("#!/bin/sh\nexit 0\n")
        for program in (self.chaos.describe, self.chaos.pre_start):
            os.chmod(program, 0o755)
        self.write_config()
        self.api = ChaosApiServer(self.injector)
        self.api.put_node(NODE, NODE_UID)
        await self.nursery.start(self.api.run)
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": self.api.url}}],
            "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
        (self.root / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        os.environ["KUBECONFIG"] = str(self.root / "kubeconfig")
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
        self.kubelet = ChaosKubelet(str(self.dp_dir), self.injector)
        await self.nursery.start(self.kubelet.run)
        self.dra_kubelet = standins.DraKubeletSimulator(
            str(self.kubelet_dir), wipe=lambda driver: self.api.delete_node_slices(NODE, driver), seed=self.seed
        )
        await self.nursery.start(self.dra_kubelet.run)
        self.injector._token = trio.lowlevel.current_trio_token()
        for _ in range(2):
            self.new_claim()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        path = str(self.root / "config.yaml")
        try:
            with self.serving:
                config = gp.load_config(path)

                def updates(current: gp.Config) -> AsyncGenerator[gp.Config, None]:  # a watch of its own at each run
                    return gp.watch_config_file(path, current=current)

                await gp.serve_plugin(config, updates=updates, node_name=NODE, task_status=task_status)
            if not self.serving.cancelled_caught:
                self.ended = "serve_plugin returned"
        except BaseException as error:  # what ended serve is the finding
            self.ended = error
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise
        finally:
            with contextlib.suppress(RuntimeError):  # started already, unless the start failed
                task_status.started()

    def new_claim(self) -> str:
        uid = f"00000000-0000-4000-8000-{self.next_id:012d}"
        name = f"claim-{self.next_id}"
        self.next_id += 1
        device = self.rng.choice(sorted(os.listdir(self.gophers)) or ["gopher0"])
        result = {"request": "gopher", "driver": DRIVER, "pool": POOL, "device": device}
        self.api.put_claim(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "default", "uid": uid},
                "spec": {"devices": {"requests": [{"name": "gopher", "exactly": {"deviceClassName": "gopher"}}]}},
                "status": {"allocation": {"devices": {"results": [result]}}},
            }
        )
        self.claims[uid] = (name, device)
        self.wanted.add(uid)
        return uid

    # -- the truth, and what gopherplug made of it

    def differences(self) -> list[str]:
        """What is not yet as the truth says: empty once converged."""
        found = []
        moles = sorted(os.listdir(self.moles))
        resource = self.kubelet.resources.get(MOLE)
        listed = sorted(resource.devices) if resource is not None and resource.streaming else None
        if listed != moles:
            found.append(f"the kubelet lists {listed} for {MOLE}, the directory holds {moles}")
        gophers = sorted(os.listdir(self.gophers))
        published = sorted(
            device["name"]
            for item in self.api.slices.values()
            if item["spec"]["pool"]["name"] == POOL
            for device in item["spec"].get("devices", [])
        )
        if published != gophers:
            found.append(f"the API server's slices hold {published}, the directory {gophers}")
        stale = sorted(
            device["name"]
            for item in self.api.slices.values()
            for device in item["spec"].get("devices", [])
            if device.get("attributes", {}).get("generation", {}).get("int") != self.generation
        )
        if stale:
            found.append(f"devices {stale} are published without generation {self.generation}, the configuration's")
        checkpoint = self.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
        try:
            saved = json.loads(checkpoint.read_text())["claims"]
        except (OSError, ValueError, KeyError):
            saved = {}
        specs = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.cdi):
                with contextlib.suppress(OSError, ValueError):
                    spec = json.loads((self.cdi / name).read_text())
                    specs.update({f"{spec['kind']}={device['name']}": name for device in spec.get("devices", [])})
        held = set(self.dra_kubelet.prepared)
        if self.preparable() - held or held - self.wanted:
            found.append(
                f"claims {sorted(self.preparable() - held)} cannot be prepared, {sorted(held - self.wanted)} unprepared"
            )
        for uid in sorted(held):
            if uid not in saved:
                found.append(f"claim {uid} is prepared, but not in the checkpoint")
            # The claim's own CDI devices, and those of its devices still there (a device gone from
            # the directory leaves the spec: the claim's container could not have it anyway)
            missing = [
                cdi
                for _, device, ids in self.answers.get(uid, [])
                for cdi in ids
                if cdi not in specs and (cdi.partition("=")[2].startswith(f"{uid}_") or device in gophers)
            ]
            if missing:
                found.append(f"claim {uid} is prepared, but its CDI devices {missing} are in no spec")
        return found

    # -- the actions

    async def act(self, action: str) -> None:
        rng = self.rng
        if action == "add_mole":
            (self.moles / f"mole{rng.randrange(100)}").touch()
        elif action == "remove_mole" and (names := sorted(os.listdir(self.moles))):
            os.unlink(self.moles / rng.choice(names))
        elif action == "add_gopher":
            (self.gophers / f"gopher{rng.randrange(100)}").touch()
        elif action == "remove_gopher" and (names := sorted(os.listdir(self.gophers))):
            os.unlink(self.gophers / rng.choice(names))
        elif action == "restart_kubelet":
            self.kubelet.restart()
        elif action == "reprovision_kubelet":
            self.kubelet.restart(remove_directory=True)
        elif action == "restart_dra_kubelet":
            self.dra_kubelet.restart()
        elif action == "prepare":
            await self.prepare(self.new_claim())  # a new claim: its preparation is written
        elif action == "unprepare" and self.wanted:
            uid = rng.choice(sorted(self.wanted))
            self.wanted.discard(uid)
            await self.unprepare(uid)
        elif action == "reload":
            self.generation += 1
            self.write_config()
        elif action == "pre_start":
            with contextlib.suppress(gp.GopherplugError, trio.TooSlowError):
                with trio.fail_after(STEP_BOUND):
                    await self.kubelet.pre_start_container(MOLE, sorted(os.listdir(self.moles))[:1])
        elif action == "peers":
            socket_path = (
                os.path.join(self.dp_dir, self.kubelet.resources[MOLE].endpoint)
                if MOLE in self.kubelet.resources
                else ""
            )
            if socket_path:
                count = rng.randrange(1, 20)
                if self.injector.take(
                    "peer_never_reads", f"{count} ListAndWatch peers on {os.path.basename(socket_path)}"
                ):
                    for _ in range(count):
                        self.nursery.start_soon(never_reading_peer, socket_path, self.peers_done)

    async def prepare(self, uid: str) -> bool:
        """The kubelet's NodePrepareResources for one claim; whether it was prepared."""
        name, _ = self.claims[uid]
        try:
            with trio.fail_after(STEP_BOUND + gp.API_REQUEST_TIMEOUT):
                answer = await self.dra_kubelet.prepare(DRIVER, [("default", uid, name)])
        except (gp.GopherplugError, trio.TooSlowError):
            return False
        one = answer.claims[uid]
        if one.error:
            return False
        got = sorted((d.pool_name, d.device_name, tuple(d.cdi_device_ids)) for d in one.devices)
        first = self.answers.setdefault(uid, got)
        if first != got:
            self.report.violations.append(f"claim {uid} prepared twice with different answers: {first} then {got}")
        return True

    async def unprepare(self, uid: str) -> bool:
        name, _ = self.claims[uid]
        try:
            with trio.fail_after(STEP_BOUND + gp.API_REQUEST_TIMEOUT):
                answer = await self.dra_kubelet.unprepare(DRIVER, [("default", uid, name)])
        except (gp.GopherplugError, trio.TooSlowError):
            return False
        if answer.claims[uid].error:
            return False
        self.answers.pop(uid, None)  # prepared anew later, it may get other devices
        return True

    # -- faults done from the outside

    def outside_fault(self, kind: str) -> None:
        """Arm a fault the outside does: a FIFO for the file: attribute, a tmpfs over a directory."""
        if kind == "read_never_returns" and not self.fifo_open:
            self.model.unlink()
            os.mkfifo(self.model)
            self.fifo_open = True
            self.injector.injected.append((kind, f"open({self.model.name}) of a FIFO"))
        elif kind == "remount":
            # Each device directory is a file system of its own (a tmpfs, mounted at the start):
            # unmounted and mounted again, as a node's /dev or a device's own mount may be.
            directory = self.rng.choice([self.moles, self.gophers])
            held = sorted(os.listdir(directory))
            subprocess.run(["umount", str(directory)], check=True, capture_output=True)
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(directory)], check=True, capture_output=True)
            new = f"{directory.name[:-1]}{200 + self.rng.randrange(9)}"
            for name in [*held[: self.rng.randrange(len(held) + 1)], new]:
                (directory / name).touch()  # the new file system's devices: some of the old, one new
            self.injector.injected.append((kind, f"{directory.name} unmounted, a tmpfs mounted again"))

    def release_fifo(self) -> None:
        """The FIFO becomes a regular file again; a reader blocked on it is let go (end of file)."""
        if not self.fifo_open:
            return
        self.fifo_open = False
        with contextlib.suppress(OSError):
            os.close(os.open(self.model, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: no reader is there
        temporary = self.root / ".model.tmp"
        temporary.write_text("burrower\n")
        temporary.replace(self.model)

    def watchdog(self, stop: threading.Event) -> None:
        """In a thread: the event loop blocked past BLOCKED_BOUND is a violation; what blocks it
        (a FIFO being read) is let go, so that the scenario can end."""
        while not stop.wait(0.5):
            if time.monotonic() - self.heartbeat > BLOCKED_BOUND:
                self.report.violations.append(f"the event loop was blocked for more than {BLOCKED_BOUND:g} s")
                self.release_fifo()
                self.heartbeat = time.monotonic()

    async def beat(self) -> None:
        while True:
            self.heartbeat = time.monotonic()
            await trio.sleep(0.1)

    # -- the run

    async def run(self, steps: list[Step]) -> None:
        await self.start()
        self.report.planned = {kind for step in steps for kind, _ in step.faults}
        self.nursery.start_soon(self.beat)
        with trio.move_on_after(CONVERGE_BOUND) as started:
            await self.nursery.start(self.serve)
        if started.cancelled_caught or self.ended is not None:
            self.report.violations.append(f"gopherplug did not start: {self.ended!r}")
            return
        if not await self.converge():
            self.report.violations.append("no convergence before any fault: " + "; ".join(self.differences()))
            return
        for uid in sorted(self.wanted):
            await self.prepare(uid)
        # Faults on
        for step in steps:
            await self.step(step.action, step.faults)
            if self.ended is not None:
                break
        # A planned fault that found no call to strike: its trigger once more, a few times at most
        for _ in range(3):
            unfired = sorted(self.report.planned - {kind for kind, _ in self.injector.injected})
            if not unfired or self.ended is not None:
                break
            for kind in unfired:
                # One that struck already, armed still for the same call, would take it first (a loaded
                # machine makes fewer calls meanwhile: pre_start_fork_fails before pre_start_killed).
                same_call = [other for other in list(self.injector.armed) if TRIGGER[other] == TRIGGER[kind]]
                self.injector.disarm(set(same_call) - set(unfired))
                await self.step(TRIGGER[kind], ((kind, 1),) if kind in self.injector.armed else ())
        # Faults off: what is armed is disarmed, the peers leave, the FIFO is a file again
        self.injector.stop()
        self.chaos.faults_off.set()
        self.peers_done.set()
        self.release_fifo()
        if self.ended is not None:
            self.report.violations.append(f"serve ended: {_one_line(self.ended)}")
            return
        started_at = trio.current_time()
        if await self.converge():
            self.report.converged_in = trio.current_time() - started_at
        else:
            for difference in self.differences():
                self.report.violations.append(f"not converged within {CONVERGE_BOUND:g} s: {difference}")
        if self.ended is not None:
            self.report.violations.append(f"serve ended: {_one_line(self.ended)}")

    async def step(self, action: str, faults: tuple[tuple[str, int], ...]) -> None:
        """Arm the faults, act, and wait (STEP_BOUND at most) until each fault has struck once."""
        counts = {kind: sum(k == kind for k, _ in self.injector.injected) for kind, _ in faults}
        for kind, times in faults:
            if kind in ("read_never_returns", "remount"):
                self.outside_fault(kind)
            elif kind in self.injector.armed and action == TRIGGER[kind]:
                pass  # armed still: its trigger again
            else:
                self.injector.arm(kind, times)
            if kind == "sysfs_read_hangs":  # a device node (as /dev/null: 1:3), whose scan reads its numa_node
                name = next(f"mole-n{n}" for n in itertools.count() if not (self.moles / f"mole-n{n}").exists())
                os.mknod(self.moles / name, stat.S_IFCHR | 0o666, os.makedev(1, 3))
            if kind == "emfile_scan":  # a full rescan comes after an overflow (or a start)
                self.injector.arm("inotify_overflow", 1)
            if kind == "api_410_gone":  # the watches end (their timeout): the next one is answered 410
                self.api.end_watches()

        def struck() -> bool:
            return all(sum(k == kind for k, _ in self.injector.injected) > n for kind, n in counts.items())

        await self.act(action)
        with trio.move_on_after(STEP_BOUND):
            while not struck() and self.ended is None:
                await self.injector.fired.wait_touched()

    def preparable(self) -> set[str]:
        """The claims the kubelet wants prepared whose device is in the directory (the others are
        refused, rightly: their pods wait)."""
        there = set(os.listdir(self.gophers))
        return {uid for uid in self.wanted if self.claims[uid][1] in there}

    async def converge(self) -> bool:
        """Until the truth is reached (the kubelet retrying what it wants of the claims, as it does),
        or CONVERGE_BOUND. Files have no notification here: what is not there is looked at again
        each 0.1 s, or at once when a stand-in sees a change."""
        with trio.move_on_after(CONVERGE_BOUND):
            while self.ended is None:
                for uid in sorted(self.preparable() - set(self.dra_kubelet.prepared)):
                    await self.prepare(uid)
                for uid in sorted(set(self.dra_kubelet.prepared) - self.wanted):
                    await self.unprepare(uid)
                if not self.differences():
                    return True
                with trio.move_on_after(0.1):
                    await self.api.changed.wait_touched()
        return False

    def cleanup(self) -> None:
        for directory in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(directory)], check=False, capture_output=True)


def _one_line(error: BaseException | str) -> str:
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(_one_line(one) for one in error.exceptions)
    return error if isinstance(error, str) else f"{type(error).__name__}: {str(error)[:300]}"


async def run_seed_async(seed: int, steps: list[Step] | None = None) -> Report:
    root = Path(tempfile.mkdtemp(prefix="gpc-", dir="/tmp"))
    started = time.monotonic()
    stop_watchdog = threading.Event()
    scenario: Scenario | None = None
    try:
        async with trio.open_nursery() as nursery:
            scenario = Scenario(seed, root, nursery)
            watchdog = threading.Thread(target=scenario.watchdog, args=(stop_watchdog,), daemon=True)
            watchdog.start()
            with scenario.chaos.installed():
                try:
                    await scenario.run(plan(seed) if steps is None else steps)
                except Exception as error:  # the scenario's own failure: said, with its seed, not lost
                    scenario.report.violations.append(f"the scenario itself failed: {_one_line(error)}")
                scenario.report.restarts = restarts_counted()
                scenario.serving.cancel()
                with trio.move_on_after(gp.STOP_TIMEOUT + 5) as stopping:
                    while not (scenario.ended is not None or scenario.serving.cancelled_caught):
                        await trio.sleep(0.05)
                if stopping.cancelled_caught:
                    scenario.report.violations.append("serve did not stop when cancelled")
            nursery.cancel_scope.cancel()
    finally:
        stop_watchdog.set()
        if scenario is not None:
            scenario.release_fifo()
            scenario.cleanup()
        shutil.rmtree(root, ignore_errors=True)
    assert scenario is not None
    report = scenario.report
    report.injected = list(scenario.injector.injected)
    report.seconds = time.monotonic() - started
    return report


def run_seed(seed: int, steps: list[Step] | None = None) -> Report:
    return trio.run(run_seed_async, seed, steps)


# ---------------------------------------------------------------------------------------------------
# The tests

#: The seeds CI runs: together they inject every kind of FAULTS (test_ci_seeds_inject_every_kind),
#: found by a greedy cover of the seeds' plans (0 besides, from the cover before sysfs_read_hangs).
CI_SEEDS = [0, 51, 1211, 1869, 6281, 7924, 9240]


def test_ci_seeds_inject_every_kind() -> None:
    planned = {kind for seed in CI_SEEDS for step in plan(seed) for kind, _ in step.faults}
    assert planned == set(FAULTS), f"no CI seed injects {sorted(set(FAULTS) - planned)}: add a seed that does"


def test_a_seed_is_the_same_plan_every_time() -> None:
    assert plan(2759) == plan(2759) and plan(2759) != plan(2760)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs on each device directory: needs root (CI has it)")
@pytest.mark.parametrize("seed", CI_SEEDS, ids=[f"seed_{seed}" for seed in CI_SEEDS])
def test_chaos_seed(seed: int) -> None:
    """The scenario of ``seed`` (its id names it; its message says how to replay it): gopherplug
    alive, converged and consistent once the faults stop, and each fault planned injected."""
    report = run_seed(seed)
    fired = {kind for kind, _ in report.injected}
    assert not report.violations, report.summary()
    assert report.planned <= fired, (
        f"planned faults never injected: {sorted(report.planned - fired)}\n{report.summary()}"
    )
