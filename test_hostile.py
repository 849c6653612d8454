"""Hostile peers against a real `gopherplug serve`: nothing a peer sends takes a node's plugin down.

Each case starts `python -m gopherplug serve` as a subprocess with one resource, its health and
metrics ports, and gopherplug's kubelet simulator in this process (which registers the plugin and
keeps the kubelet's ListAndWatch stream open). Then a peer misbehaves on a real socket (the plugin's
unix socket, spoken to with h2 frame by frame, or a TCP port), and the case checks, from outside
the process:

- memory: the growth of the serve process's peak RSS over its RSS before the attack (the kernel's
  VmHWM, reset through /proc/PID/clear_refs, and VmRSS from /proc/PID/status) stays within the
  bound the case states;
- the probe: GET /healthz answers 200 within 1 s;
- the others: a well-behaved client is served, a real Allocate through gopherplug's own client and
  the kubelet's ListAndWatch stream, which sees a device added after the attack.

The limits themselves are gopherplug's named constants (section 5 and the HTTP server): a case
checks the effect a peer sees (GOAWAY ENHANCE_YOUR_CALM, RESOURCE_EXHAUSTED, a connection closed
by the server) and that memory stayed bounded.
"""

from __future__ import annotations

import gzip
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hpack
import hyperframe.frame
import pytest
import trio
import yaml

import gopherplug as gp

HERE = Path(__file__).resolve().parent
RESOURCE = "example.com/gopher"
MiB = 2**20
TIMEOUT = 30
#: What a case may add to the serve process's peak RSS, unless it states another bound: the peer's
#: own costs (a connection, a few hundred streams' state) and the allocator's slack.
RSS_BOUND = 4 * MiB
#: grpc-status of a refusal for size (grpc-go's codes.ResourceExhausted).
RESOURCE_EXHAUSTED = "8"
v1beta1 = gp.v1beta1


# ---------------------------------------------------------------------------------------------------
# The plugin under attack


@dataclass
class Served:
    """A running `gopherplug serve`, and what this process knows of it."""

    process: trio.Process
    root: Path
    simulator: gp.KubeletSimulator
    socket_path: str = ""
    health_port: int = 0
    metrics_port: int = 0
    lines: list[str] = field(default_factory=list)
    device: str = "d0"  #: one of its devices, for Allocate
    _new_line: trio.Event = field(default_factory=trio.Event)

    @property
    def pid(self) -> int:
        return self.process.pid

    def status(self) -> dict[str, int]:
        """The numbers of /proc/PID/status (kB for the Vm* fields)."""
        numbers = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if value.split() and value.split()[0].isdigit():
                numbers[name] = int(value.split()[0])
        return numbers

    def reset_peak(self) -> int:
        """Reset the process's VmHWM to its VmRSS (Linux: 5 > clear_refs); return that RSS in bytes."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")
        return self.status()["VmRSS"] * 1024

    def peak_growth(self, before: int) -> int:
        return self.status()["VmHWM"] * 1024 - before

    async def read_log(self) -> None:
        buffer = b""
        assert self.process.stderr is not None
        while chunk := await self.process.stderr.receive_some(65536):
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            self.lines += [line.decode(errors="replace") for line in complete]
            self._new_line.set()
            self._new_line = trio.Event()

    async def logged(self, text: str) -> str:
        """The first log line holding ``text``, once the process has written it."""
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if text in line:
                    return line
            seen = len(self.lines)
            await self._new_line.wait()

    async def well_behaved(self, device: str | None = None) -> None:
        """A well-behaved client is served: an Allocate through gopherplug's own client, the probe
        within 1 s, and (``device``: a file created now) the kubelet's stream lists the new device."""
        with trio.fail_after(5):
            answer = await gp.call_unary(
                self.socket_path,
                gp.METHODS["/v1beta1.DevicePlugin/Allocate"],
                v1beta1.AllocateRequest(
                    container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=[self.device])]
                ),
                timeout=5,
            )
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": self.device}
        assert await probe(self.health_port) == 200
        if device is not None:
            (self.root / "dev" / device).touch()
            with trio.fail_after(5):
                await self.simulator.wait_until(lambda s: device in (s.resources[RESOURCE].devices or {}))


async def probe(port: int, path: str = "/healthz") -> int:
    """GET ``path`` as the kubelet's prober does, within 1 s (its default timeoutSeconds): the status code."""
    with trio.fail_after(1):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := await stream.receive_some(65536):
                answer += chunk
    return int(answer.split()[1])


def _lower_open_files(soft: int) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def start_serving(
    nursery: trio.Nursery, root: Path, devices: list[str], soft_nofile: int | None = None
) -> Served:
    plugin_dir, device_dir = root / "dp", root / "dev"
    plugin_dir.mkdir(parents=True)
    device_dir.mkdir()
    for name in devices:
        (device_dir / name).touch()
    config = root / "config.yaml"
    document = {
        "device_plugin_dir": str(plugin_dir),
        "health_address": "127.0.0.1:0",
        "metrics_address": "127.0.0.1:0",
        "resources": [{"name": RESOURCE, "directory": str(device_dir)}],
    }
    config.write_text(yaml.safe_dump(document))
    simulator = await nursery.start(gp.KubeletSimulator(str(plugin_dir)).run)
    argv = [sys.executable, "-m", "gopherplug", "serve", "--config", str(config), "--log-level", "info"]
    preexec = (lambda: _lower_open_files(soft_nofile)) if soft_nofile is not None else None
    process = await trio.lowlevel.open_process(
        argv, cwd=HERE, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=preexec
    )
    served = Served(process, root, simulator, device=devices[0])
    nursery.start_soon(served.read_log)
    with trio.fail_after(TIMEOUT):
        served.health_port = int((await served.logged("serving the liveness check on")).rsplit(":", 1)[1].split("/")[0])
        served.metrics_port = int(
            (await served.logged("serving Prometheus metrics on")).rsplit(":", 1)[1].split("/")[0]
        )
        await simulator.wait_until(
            lambda s: len((s.resources.get(RESOURCE) and s.resources[RESOURCE].devices) or {}) == len(devices)
        )
    [registration] = simulator.registrations
    served.socket_path = str(plugin_dir / registration.endpoint)
    await served.well_behaved()  # every path warmed up before the peak is reset
    with trio.fail_after(5):
        await scrape(served.metrics_port)
    return served


@pytest.fixture
def short_path():
    """A short directory (a unix socket's path has at most 107 bytes), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="gph-", dir="/tmp" if os.path.isdir("/tmp") else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def serving(nursery):
    """Start a plugin with four devices (or these, or this many), in a short directory (a unix
    socket's path has at most 107 bytes); killed and removed at the end."""
    started: list[Served] = []
    root = Path(tempfile.mkdtemp(prefix="gph-", dir="/tmp" if os.path.isdir("/tmp") else None))

    async def start(devices: int | list[str] = 4, soft_nofile: int | None = None) -> Served:
        names = devices if isinstance(devices, list) else [f"d{i}" for i in range(devices)]
        served = await start_serving(nursery, root / f"n{len(started)}", names, soft_nofile)
        started.append(served)
        return served

    try:
        yield start
    finally:
        for served in started:
            served.process.kill()
            await served.process.wait()
        shutil.rmtree(root, ignore_errors=True)


async def scrape(port: int) -> str:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"200", head
    return body.decode()


async def settled(served: Served) -> None:
    """Wait until the process's RSS has stopped moving: five reads 50 ms apart alike (the work a peer
    caused has no event of its own to wait for); at most 10 s."""
    last, same = -1, 0
    with trio.fail_after(10):
        while same < 5:
            rss = served.status()["VmRSS"]
            same = same + 1 if rss == last else 0
            last = rss
            await trio.sleep(0.05)


# ---------------------------------------------------------------------------------------------------
# A peer that speaks h2 frame by frame

REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


def headers_for(method: str, *more: tuple[str, str]) -> list[tuple[str, str]]:
    return [*REQUEST_HEADERS[:2], (":path", f"/v1beta1.DevicePlugin/{method}"), *REQUEST_HEADERS[2:], *more]


def allocate_request(*ids: str) -> bytes:
    return v1beta1.AllocateRequest(
        container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=list(ids))]
    ).SerializeToString()


def grpc_message(data: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">?I", compressed, len(data)) + data


class Peer:
    """One HTTP/2 connection to the plugin's socket, driven by hand."""

    def __init__(self, stream: trio.SocketStream, settings: dict[int, int] | None) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.h2.initiate_connection()
        if settings:
            self.h2.update_settings(settings)
        self.events: list[h2.events.Event] = []
        self.closed = False
        self._sending = trio.Lock()  # a reader task's flush and the case's own sends take turns

    @classmethod
    async def open(cls, path: str, settings: dict[int, int] | None = None) -> Peer:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.connect(path)
        peer = cls(trio.SocketStream(sock), settings)
        await peer.flush()
        while not any(isinstance(event, h2.events.RemoteSettingsChanged) for event in peer.events):
            await peer.read()  # the server's SETTINGS: its windows and limits known
        return peer

    async def flush(self) -> None:
        await self.send_raw(self.h2.data_to_send())

    async def send_raw(self, data: bytes) -> None:
        async with self._sending:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.closed = True

    async def read(self) -> bool:
        """One read; False at end of file (the server closed the connection)."""
        try:
            data = await self.stream.receive_some(1 << 20)
        except trio.BrokenResourceError:
            data = b""
        if not data:
            self.closed = True
            return False
        try:
            self.events += self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            pass  # what the server sent after its GOAWAY: the events before it are kept
        await self.flush()
        return True

    async def until_closed(self) -> None:
        """Read until the server closes the connection."""
        with trio.fail_after(TIMEOUT):
            while await self.read():
                pass

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        return next((e for e in self.events if isinstance(e, h2.events.ConnectionTerminated)), None)

    def status_of(self, stream_id: int) -> str | None:
        """grpc-status of a stream's trailers (or of a trailers-only answer)."""
        for event in self.events:
            if (
                isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived))
                and event.stream_id == stream_id
            ):
                found = dict(event.headers).get("grpc-status")
                if found is not None:
                    return found
        return None

    async def until_status(self, stream_id: int) -> str:
        with trio.fail_after(TIMEOUT):
            while (status := self.status_of(stream_id)) is None:
                assert await self.read(), "the server closed the connection"
        return status

    async def aclose(self) -> None:
        await self.stream.aclose()


def frame(
    kind: type[hyperframe.frame.Frame], stream_id: int, flags: tuple[str, ...] = (), **attributes: object
) -> bytes:
    """One frame as built by hand, whatever h2's own rules would allow a client to send."""
    made = kind(stream_id)
    for flag in flags:
        made.flags.add(flag)
    for name, value in attributes.items():
        setattr(made, name, value)
    return made.serialize()


# ---------------------------------------------------------------------------------------------------
# The rows


@pytest.mark.slow
async def test_m1_probe_answers_within_1s_with_1000_idle_connections_and_a_reconnecting_peer(serving):
    """M1: the health port, with the process's soft limit of open files at 128 as a container runtime
    may set it. serve raises it to the hard limit (as Go programs do), and holds at most
    HTTP_MAX_CONNECTIONS connections, pushing out the oldest: with 1,000 idle connections open and a
    peer opening more all the time, the probe answers within 1 s, every time."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < 2000:
        pytest.skip(f"this process may open {hard} files: the case needs more than 1,000 connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process's own, for its 1,000 peers
    served = await serving(soft_nofile=128)
    limits = Path(f"/proc/{served.pid}/limits").read_text()
    [files] = [line.split()[3:5] for line in limits.splitlines() if line.startswith("Max open files")]
    assert files[0] == files[1], limits  # soft raised to hard
    before = served.reset_peak()
    idle = []
    for _ in range(1000):
        idle.append(await trio.open_tcp_stream("127.0.0.1", served.health_port))

    async def reconnect_forever() -> None:
        while True:
            extra = await trio.open_tcp_stream("127.0.0.1", served.health_port)
            idle.append(extra)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reconnect_forever)
        for _ in range(10):
            assert await probe(served.health_port) == 200
        nursery.cancel_scope.cancel()
    await served.well_behaved("added")
    assert served.peak_growth(before) <= RSS_BOUND
    # The server closed all but the newest HTTP_MAX_CONNECTIONS: the rest see end of file.
    with trio.fail_after(gp.HTTP_HEADER_TIMEOUT + 5):
        assert await idle[0].receive_some(10) == b""
    for stream in idle:
        await stream.aclose()


@pytest.mark.slow
async def test_m2_metrics_port_has_timeouts_and_no_threads(serving):
    """M2: /metrics was prometheus_client's threaded server (a thread per connection, no timeout).
    Now the same server as /healthz: 100 idle connections hold no thread, each is closed within
    HTTP_HEADER_TIMEOUT, and a scrape is answered meanwhile."""
    served = await serving()
    threads = served.status()["Threads"]
    before = served.reset_peak()
    idle = [await trio.open_tcp_stream("127.0.0.1", served.metrics_port) for _ in range(100)]
    start = time.monotonic()
    with trio.fail_after(1):
        assert "gopherplug_devices" in await scrape(served.metrics_port)
    assert served.status()["Threads"] == threads
    with trio.fail_after(gp.HTTP_HEADER_TIMEOUT + 2):
        for stream in idle:
            assert await stream.receive_some(10) == b""
    assert time.monotonic() - start >= gp.HTTP_HEADER_TIMEOUT - 0.1  # closed by the timeout, not at once
    for stream in idle:
        await stream.aclose()
    await served.well_behaved("added")
    assert served.peak_growth(before) <= RSS_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("port", ["health", "metrics"])
async def test_slowloris_on_each_http_port_is_closed_at_the_header_timeout(serving, port):
    """One byte every 100 ms never completes a request head: the connection is closed
    HTTP_HEADER_TIMEOUT after it was accepted, not kept while bytes trickle in."""
    served = await serving()
    number = served.health_port if port == "health" else served.metrics_port
    stream = await trio.open_tcp_stream("127.0.0.1", number)
    start = time.monotonic()
    closed = trio.Event()

    async def trickle() -> None:
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000:
            try:
                await stream.send_all(bytes([byte]))
            except trio.BrokenResourceError:
                return
            with trio.move_on_after(0.1):  # the attack's pace, not a synchronisation
                await closed.wait()
            if closed.is_set():
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        with trio.fail_after(gp.HTTP_HEADER_TIMEOUT + 3):
            while await stream.receive_some(100):
                pass
        closed.set()
    took = time.monotonic() - start
    assert gp.HTTP_HEADER_TIMEOUT - 0.2 <= took <= gp.HTTP_HEADER_TIMEOUT + 1, took
    await stream.aclose()
    await served.well_behaved()


@pytest.mark.slow
async def test_m3_compressed_request_over_the_limit_is_resource_exhausted(serving):
    """M3: a gzip request of 8 KiB that inflates to 8 MiB was inflated whole (a 130 KiB one passed the
    chart's 128 MiB limit). Now inflated into at most KUBELET_MAX_MESSAGE bytes, and refused with
    RESOURCE_EXHAUSTED as grpc-go refuses it; a compressed request within the limit is answered.
    Bound: the one message's worth of memory, KUBELET_MAX_MESSAGE, and RSS_BOUND."""
    served = await serving()
    peer = await Peer.open(served.socket_path)
    peer.h2.send_headers(1, headers_for("Allocate", ("grpc-encoding", "gzip")))
    peer.h2.send_data(1, grpc_message(gzip.compress(allocate_request("d1")), compressed=True), end_stream=True)
    await peer.flush()
    assert await peer.until_status(1) == "0"
    before = served.reset_peak()
    bomb = gzip.compress(b"\0" * (8 * MiB))
    assert len(bomb) < 16 * 1024
    for stream_id in (3, 5, 7):
        peer.h2.send_headers(stream_id, headers_for("Allocate", ("grpc-encoding", "gzip")))
        peer.h2.send_data(stream_id, grpc_message(bomb, compressed=True), end_stream=True)
        await peer.flush()
        assert await peer.until_status(stream_id) == RESOURCE_EXHAUSTED
    await peer.aclose()
    await served.well_behaved("added")
    assert served.peak_growth(before) <= gp.KUBELET_MAX_MESSAGE + RSS_BOUND


@pytest.mark.slow
async def test_m4_requests_without_end_stream_close_the_connection_past_its_limit(serving):
    """M4: streams that send data without ending their requests held two whole messages each (six
    held 44 MiB). Now a connection's unanswered requests are at most MAX_CONNECTION_REQUEST_BYTES:
    twelve streams of 1 MiB each get GOAWAY ENHANCE_YOUR_CALM past it, and a stream over
    MAX_REQUEST_BYTES alone is answered RESOURCE_EXHAUSTED. Bound: that limit and RSS_BOUND."""
    served = await serving()
    before = served.reset_peak()
    peer = await Peer.open(served.socket_path)
    chunk = b"\0" * 16384
    for number in range(12):
        stream_id = 1 + 2 * number
        peer.h2.send_headers(stream_id, headers_for("Allocate"))
        announce = struct.pack(">?I", False, gp.KUBELET_MAX_MESSAGE)  # one message of the largest size
        await peer.send_raw(peer.h2.data_to_send() + frame(hyperframe.frame.DataFrame, stream_id, data=announce))
        for _ in range(64):
            await peer.send_raw(frame(hyperframe.frame.DataFrame, stream_id, data=chunk))
        if peer.closed:
            break
    await peer.until_closed()
    await peer.aclose()
    goaway = peer.goaway()
    assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    assert served.peak_growth(before) <= gp.MAX_CONNECTION_REQUEST_BYTES + RSS_BOUND
    assert any("a client of this plugin's socket was disconnected" in line for line in served.lines)
    # One stream alone, announcing a message over the limit: that call is refused, the connection kept.
    peer = await Peer.open(served.socket_path)
    peer.h2.send_headers(1, headers_for("Allocate"))
    too_large = struct.pack(">?I", False, gp.KUBELET_MAX_MESSAGE + 1)
    await peer.send_raw(peer.h2.data_to_send() + frame(hyperframe.frame.DataFrame, 1, data=too_large))
    assert await peer.until_status(1) == RESOURCE_EXHAUSTED
    peer.h2.send_headers(3, headers_for("Allocate"))
    peer.h2.send_data(3, grpc_message(allocate_request("d2")), end_stream=True)
    await peer.flush()
    assert await peer.until_status(3) == "0"
    await peer.aclose()
    await served.well_behaved("added")


@pytest.mark.slow
async def test_l1_a_peer_that_never_reads_is_not_buffered_for(serving):
    """L1: 400 ListAndWatch streams against 2,000 devices, the windows opened to 2^31-1, and nothing
    read: 11.9 MiB was queued for the peer, more with every stream. Now the connection stops being
    served past SEND_QUEUE_LIMIT: what is queued stays within it and one message in flight, and the
    streams share one encoded list. Bound: SEND_QUEUE_LIMIT, one list (about 90 KiB here, copied
    once into the queue) and 2 x RSS_BOUND for the 400 streams' own state."""
    served = await serving([f"accelerator-card-{i:05d}-of-a-rack" for i in range(2000)])
    before = served.reset_peak()
    peer = await Peer.open(served.socket_path, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    peer.h2.increment_flow_control_window(2**31 - 1 - 65535)
    for number in range(400):
        peer.h2.send_headers(1 + 2 * number, headers_for("ListAndWatch"))
        peer.h2.send_data(1 + 2 * number, grpc_message(b""), end_stream=True)
    await peer.flush()  # and from now on, nothing is read
    await settled(served)
    await served.well_behaved("added")
    await settled(served)
    assert served.peak_growth(before) <= gp.SEND_QUEUE_LIMIT + 2 * RSS_BOUND + 2 * 90 * 1024
    await peer.aclose()


@pytest.mark.slow
async def test_l2_a_bare_token_from_an_exec_plugin_is_in_no_log_line(short_path):
    tmp_path = short_path
    """L2: a DRA driver whose kubeconfig's exec credential plugin prints a bare token (not an
    ExecCredential): `serve` fails every API request, retrying, and no line of its log holds any 8
    characters of the token. The error quoted the first 60 bytes of the plugin's output."""
    secret = "ya29.SeCrEt-" + "k9Z" * 20
    plugin = tmp_path / "credential-plugin"
    plugin.write_text(f"#!/bin/sh\necho '{secret}'\n")
    plugin.chmod(0o755)
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [
            {
                "name": "u",
                "user": {
                    "exec": {
                        "apiVersion": "client.authentication.k8s.io/v1",
                        "command": str(plugin),
                        "interactiveMode": "Never",
                    }
                },
            }
        ],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "d0").touch()
    (tmp_path / "kubelet" / "plugins_registry").mkdir(parents=True)
    config = {
        "dra": {"driver": "gopher.example.com", "kubelet_dir": str(tmp_path / "kubelet")},
        "resources": [{"name": RESOURCE, "directory": str(tmp_path / "dev"), "api": "dra"}],
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig"), "NODE_NAME": "node-1"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    argv = [
        sys.executable,
        "-m",
        "gopherplug",
        "serve",
        "--config",
        str(tmp_path / "config.yaml"),
        "--log-level",
        "debug",
    ]
    process = await trio.lowlevel.open_process(
        argv, cwd=HERE, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    output = b""
    try:
        with trio.move_on_after(TIMEOUT):
            assert process.stderr is not None
            while b"not ExecCredential JSON" not in output:  # the failure, as logged
                chunk = await process.stderr.receive_some(65536)
                if not chunk:
                    break
                output += chunk
    finally:
        process.kill()
        await process.wait()
    text = output.decode(errors="replace")
    assert "not ExecCredential JSON" in text, text
    pieces = {secret[i : i + 8] for i in range(len(secret) - 8)}
    assert [line for line in text.splitlines() if any(piece in line for piece in pieces)] == []


@pytest.mark.slow
def test_l3_the_dra_chart_mounts_only_its_own_plugin_directory():
    """L3: the DRA DaemonSet mounted all of <kubeletDir>/plugins read-write (every other driver's
    socket and staged volumes, to a root process). Now plugins/<driver> and plugins_registry only,
    and the admission policy checks spec.driver: the render, from helm itself."""
    helm = subprocess.run(
        [str(HERE / ".ci" / "helm")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if helm.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no helm: {helm.stderr.strip()[-200:]}")
        pytest.skip(f"no helm: {helm.stderr.strip()[-200:]}")
    values = "chart/gopherplug/ci/dra-values.yaml"  # the shipped daemonset-dra.yaml's values
    argv = [helm.stdout.strip(), "template", "gopherplug", "chart/gopherplug", "--namespace", "kube-system"]
    argv += ["-f", values]
    rendered = subprocess.run(argv, cwd=HERE, capture_output=True, text=True, timeout=120, check=True).stdout
    documents = [d for d in yaml.safe_load_all(rendered) if d]
    [daemonset] = [d for d in documents if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    host_paths = sorted(v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v)
    kubelet = "/var/lib/kubelet"
    assert f"{kubelet}/plugins" not in host_paths, host_paths
    assert f"{kubelet}/plugins_registry" in host_paths, host_paths
    assert [p for p in host_paths if p.startswith(f"{kubelet}/plugins/")] == [
        f"{kubelet}/plugins/gopherplug.example.com"
    ]
    policies = [d for d in documents if d["kind"] == "ValidatingAdmissionPolicy"]
    assert policies and any("spec.driver" in str(policy) for policy in policies)


# ---------------------------------------------------------------------------------------------------
# Beyond the rows


@pytest.mark.slow
async def test_headers_floods_end_at_the_stream_limit(serving):
    """HEADERS without END_STREAM, on three connections at once, up to the stream limit and past it:
    each connection is closed when it passes MAX_CONCURRENT_STREAMS. Bound: their streams' state."""
    served = await serving()
    before = served.reset_peak()
    peers = [await Peer.open(served.socket_path) for _ in range(3)]
    limit = gp._ResetAwareConnection.MAX_CONCURRENT_STREAMS
    for peer in peers:
        encoder = hpack.Encoder()  # h2 would not open more streams than the server allows: by hand
        data = b"".join(
            frame(
                hyperframe.frame.HeadersFrame,
                1 + 2 * number,
                data=encoder.encode(headers_for("ListAndWatch")),
                flags=("END_HEADERS",),
            )
            for number in range(limit + 1)
        )
        await peer.send_raw(data)
    for peer in peers:
        await peer.until_closed()
        await peer.aclose()
    await served.well_behaved("added")
    assert served.peak_growth(before) <= 3 * RSS_BOUND


@pytest.mark.slow
async def test_continuation_without_end_closes_the_connection(serving):
    """HEADERS without END_HEADERS, then CONTINUATION frames that never end the block: h2 refuses past
    64 of them, the connection is closed, and nothing of it stays."""
    served = await serving()
    before = served.reset_peak()
    peer = await Peer.open(served.socket_path)
    await peer.send_raw(frame(hyperframe.frame.HeadersFrame, 1, data=b"\x82"))  # no END_HEADERS
    for _ in range(200):
        await peer.send_raw(frame(hyperframe.frame.ContinuationFrame, 1, data=b"\x00\x01a\x01b" * 3000))
        if peer.closed:
            break
    await peer.until_closed()
    await peer.aclose()
    await served.well_behaved("added")
    assert served.peak_growth(before) <= RSS_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("reads", [False, True], ids=["not-reading", "reading"])
@pytest.mark.parametrize("kind", ["ping", "settings"])
async def test_ping_and_settings_floods(serving, kind, reads):
    """PINGs (or SETTINGS) without end, each asking for an acknowledgement. A peer that reads none of
    them: the acknowledgements queue up to SEND_QUEUE_LIMIT, then the connection is not read any
    more, its flood left in its own socket. A peer that reads them: each read of the plugin's is
    _RECEIVE_BUFFER_SIZE of frames, so the probe and the other clients get their turns meanwhile.
    Bound: SEND_QUEUE_LIMIT and RSS_BOUND."""
    served = await serving()
    before = served.reset_peak()
    peer = await Peer.open(served.socket_path)
    if kind == "ping":
        one = frame(hyperframe.frame.PingFrame, 0, opaque_data=b"12345678")
    else:
        one = frame(hyperframe.frame.SettingsFrame, 0, settings={h2.settings.SettingCodes.ENABLE_PUSH: 0})
    flood = one * 1000

    async def send_flood() -> None:  # a non-reading peer's blocks for good once the plugin stops reading it
        while True:
            await peer.stream.send_all(flood)

    async def read_and_forget() -> None:
        while data := await peer.stream.receive_some(1 << 20):
            del data

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_flood)
        if reads:
            nursery.start_soon(read_and_forget)
        await settled(served)
        await served.well_behaved("added")
        nursery.cancel_scope.cancel()
    assert served.peak_growth(before) <= gp.SEND_QUEUE_LIMIT + RSS_BOUND
    await peer.aclose()


@pytest.mark.slow
async def test_window_update_to_2_to_the_31_is_a_flow_control_error(serving):
    """WINDOW_UPDATE past 2^31-1, on the connection and on a stream: the connection (or stream) is
    ended as RFC 9113 section 6.9.1 says, and the plugin goes on serving."""
    served = await serving()
    before = served.reset_peak()
    peer = await Peer.open(served.socket_path)
    await peer.send_raw(frame(hyperframe.frame.WindowUpdateFrame, 0, window_increment=2**31 - 1) * 2)
    await peer.until_closed()
    goaway = peer.goaway()
    assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.FLOW_CONTROL_ERROR
    await peer.aclose()
    peer = await Peer.open(served.socket_path)
    peer.h2.send_headers(1, headers_for("ListAndWatch"))
    peer.h2.send_data(1, grpc_message(b""), end_stream=True)
    await peer.send_raw(
        peer.h2.data_to_send() + frame(hyperframe.frame.WindowUpdateFrame, 1, window_increment=2**31 - 1) * 2
    )
    with trio.fail_after(TIMEOUT):
        while not peer.closed and not any(
            isinstance(e, (h2.events.StreamReset, h2.events.ConnectionTerminated))
            and getattr(e, "stream_id", 1) in (0, 1)
            for e in peer.events
        ):
            await peer.read()
    await peer.aclose()
    await served.well_behaved("added")
    assert served.peak_growth(before) <= RSS_BOUND


@pytest.mark.slow
@pytest.mark.parametrize("method", ["Allocate", "ListAndWatch"])
async def test_rst_storm_after_requests(serving, method):
    """Rapid reset (CVE-2023-44487): 5,000 complete requests, each reset at once. Every call is
    started or dropped and then forgotten: memory comes back, and the plugin goes on serving."""
    served = await serving()
    before = served.reset_peak()
    peer = await Peer.open(served.socket_path, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    peer.h2.increment_flow_control_window(2**31 - 1 - 65535)  # the answers are never held for our window
    body = grpc_message(allocate_request("d1") if method == "Allocate" else b"")

    async def read_and_forget() -> None:  # what the server answers before each reset arrives, unparsed
        while data := await peer.stream.receive_some(1 << 20):
            del data

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_and_forget)
        for batch in range(50):
            for number in range(100):
                stream_id = 1 + 2 * (batch * 100 + number)
                peer.h2.send_headers(stream_id, headers_for(method))
                peer.h2.send_data(stream_id, body, end_stream=True)
                peer.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            await peer.flush()
        await served.well_behaved("added")
        nursery.cancel_scope.cancel()
    await peer.aclose()
    await settled(served)
    assert served.peak_growth(before) <= 2 * RSS_BOUND
