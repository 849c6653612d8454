"""What the node's peers do, and the program survives: the API server's answers (error pages, wrong
shapes, resets, hangs), the kubelet's peers (one that closes at once, one that asks for 100,000
unknown devices, a hundred that never read) and the programs a resource runs (one that daemonizes).

Each case meets a real peer: gopherplug_standins' API server answering the shape in question, a unix
socket that accepts and closes, `gopherplug serve` as a subprocess with real clients, a real shell
script that forks, calls setsid and forks again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
from pathlib import Path

import h2.settings
import pytest
import trio
import yaml

import gopherplug as gp
import gopherplug_standins as standins
import test_hostile
from test_hostile import RESOURCE, settled

serving = test_hostile.serving  # the fixture: a `gopherplug serve` with its kubelet
short_path = test_hostile.short_path  # the fixture: a directory short enough for unix sockets

v1beta1 = gp.v1beta1
MiB = 2**20
#: What a probe or an answer may take here, a generous bound on a loaded machine (the kubelet's
#: prober gives 1 s): the faults below held the event loop for minutes.
SLOW = 5


async def healthz(port: int) -> int:
    """GET /healthz as the kubelet's prober does, within SLOW seconds: the status code."""
    with trio.fail_after(SLOW):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := await stream.receive_some(65536):
                answer += chunk
    return int(answer.split()[1])


# ---------------------------------------------------------------------------------------------------
# The kubelet's peers


@pytest.mark.slow
async def test_an_allocate_of_100000_unknown_ids_is_refused_at_once_in_a_short_message(serving):
    """grpc-message is an HTTP/2 header and purerpc's HPACK encoder is quadratic in its length: a
    refusal naming 100,000 IDs held the event loop for minutes, no /healthz meanwhile. Now a few are
    named and the rest counted, in the answer and in the log line; the loop answers the probe."""
    served = await serving()
    ids = [f"nope-{i}" for i in range(100_000)]
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=ids)])
    refused: list[gp.RPCError] = []

    async def allocate() -> None:
        try:
            await gp.call_unary(served.socket_path, gp.METHODS["/v1beta1.DevicePlugin/Allocate"], request, timeout=10)
        except gp.RPCError as error:
            refused.append(error)
        answered.set()

    answered = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(allocate)
        while not answered.is_set():
            assert await healthz(served.health_port) == 200  # while the refusal is made
            with trio.move_on_after(0.2):
                await answered.wait()
    [error] = refused
    assert error.code == gp.StatusCode.INVALID_ARGUMENT
    assert error.message == f"unknown {RESOURCE} device IDs: nope-0, nope-1, nope-2, nope-3, nope-4 and 99995 more"
    line = await served.logged("refused Allocate of")
    assert "nope-0, nope-1, nope-2, nope-3, nope-4 and 99995 more: unknown" in line and len(line) < 400
    await served.well_behaved()


async def closing_peer(path: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """A unix socket at ``path`` that accepts every connection and closes it at once, unread."""
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with listener:
        await listener.bind(path)
        listener.listen(64)
        task_status.started()
        while True:
            connection, _ = await listener.accept()
            connection.close()


PYTHONS_WORDS = ("Exceptions from", "BrokenResourceError", "EndOfStream", "ClosedResourceError", "sub-exception")


async def test_a_peer_that_accepts_and_closes_is_spoken_of_not_pythons_classes(nursery, short_path):
    """A peer that accepts and hangs up before it answers: `probe`, `who` and a registration said
    "Exceptions from Trio nursery (2 sub-exceptions)", "BrokenResourceError" or "EndOfStream",
    whichever of the reader and the writer saw the hang-up first. Now they say what the peer did,
    every time (the race is run many times)."""
    plugin_dir = short_path / "dp"
    plugin_dir.mkdir()
    kubelet_sock = str(plugin_dir / "kubelet.sock")
    plugin_sock = str(plugin_dir / gp.socket_name(RESOURCE, str(plugin_dir), 1))
    pod_resources = str(short_path / "pr.sock")
    for path in (kubelet_sock, plugin_sock, pod_resources):
        await nursery.start(closing_peer, path)
    said = []
    for _ in range(20):
        register = gp.v1beta1.RegisterRequest(version=gp.API_VERSION, endpoint="x.sock", resource_name=RESOURCE)
        with pytest.raises(gp.RPCError) as refused:
            await gp.call_unary(kubelet_sock, gp.METHODS[gp.REGISTER], register, timeout=SLOW)
        said.append(str(refused.value))  # what "registration failed, retrying" says
        with pytest.raises(gp.GopherplugError) as who:
            await gp.list_pod_resources(pod_resources)
        said.append(str(who.value))
        [probed] = await gp.probe(str(plugin_dir))
        said.append(probed.error)
    for line in said:
        assert "the server closed the connection" in line or "connection closed" in line or "connection lost" in line
        assert not any(word in line for word in PYTHONS_WORDS), line


# ---------------------------------------------------------------------------------------------------
# The API server's answers


def kubeconfig(path: Path, server: str) -> str:
    document = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(document))
    return str(path)


SLICE = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceSlice",
    "metadata": {"name": "node-1-gopher"},
    "spec": {"driver": "gopherplug.example.com", "nodeName": "node-1", "pool": {"name": "p", "resourceSliceCount": 1}},
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(standins.ERROR_SHAPES))
async def test_every_error_answer_of_the_api_server_or_a_proxy_is_an_api_error(nursery, tmp_path, monkeypatch, shape):
    """lightkube makes its ApiError only of an answer typed exactly application/json, and of a Status:
    a load balancer's HTML 502/503/504, a 503 without Content-Type, a Status with a charset, a body
    that is not JSON came out as httpx's HTTPStatusError, a KeyError or a JSON error, which ended the
    driver. Every one is now gopherplug's ApiError, with the status (None: no answer) and Retry-After,
    for a list, a get and a write alike."""
    monkeypatch.setattr(gp, "API_REQUEST_TIMEOUT", 1.0)  # "hang": given up on after this
    api = standins.ApiServerSimulator()
    api.put_node("node-1", "uid-1")
    await nursery.start(api.run)
    client = gp.KubeApi.connect(kubeconfig=kubeconfig(tmp_path / "kubeconfig", api.url))
    status, _, _ = standins.ERROR_SHAPES[shape]
    status = None if shape in ("reset", "close", "hang") else status  # no whole answer came
    try:
        calls = {
            "list": lambda: client.list_slices("node-1", "gopherplug.example.com"),
            "get": lambda: client.get_node("node-1"),
            "create": lambda: client.create_slice(SLICE),
        }
        for verb, call in calls.items():
            api.garble(shape, verb=verb)
            with trio.fail_after(SLOW + 1), pytest.raises(gp.ApiError) as refused:
                await call()
            assert refused.value.status == status, str(refused.value)
            assert refused.value.retry_after == (2.0 if status in (429, 503) else None)
            said = str(refused.value)
            assert "\n" not in said and len(said) < 300, said
            assert not any(word in said for word in ("KeyError", "HTTPStatusError", "Traceback")), said
        assert api.garbled[shape] == 3
        assert (await client.get_node("node-1"))["metadata"]["uid"] == "uid-1"  # and the next answer is taken
    finally:
        await client.aclose()


async def test_a_refused_connection_is_an_api_error_without_a_status(tmp_path):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # closed again before the request: nothing listens there
    client = gp.KubeApi.connect(kubeconfig=kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}"))
    try:
        with trio.fail_after(SLOW), pytest.raises(gp.ApiError) as refused:
            await client.get_node("node-1")
    finally:
        await client.aclose()
    assert refused.value.status is None
    assert "get Node node-1: " in str(refused.value)


@pytest.mark.slow
async def test_the_api_server_failing_is_one_line_and_its_return_another(nursery, tmp_path, caplog):
    """A Status-JSON 503 was survived, but with one WARNING per retry and nothing when the server was
    back. Now: a warning at the first failure, one line when it answers again, debug in between."""
    caplog.set_level(logging.DEBUG, logger="gopherplug")
    api = standins.ApiServerSimulator()
    api.put_node("node-1", "uid-1")
    await nursery.start(api.run)
    client = gp.KubeApi.connect(kubeconfig=kubeconfig(tmp_path / "kubeconfig", api.url))
    seen = trio.Event()
    api.garble("html-503", times=3, verb="watch", resource="nodes")
    try:
        async with trio.open_nursery() as watching:
            watching.start_soon(
                functools.partial(
                    gp.list_and_watch,
                    "Node node-1",
                    functools.partial(client.list_node, "node-1"),
                    functools.partial(client.watch_node, "node-1"),
                    lambda items, version: None,
                    lambda kind, item: seen.set() if kind == "MODIFIED" else None,
                )
            )
            with trio.fail_after(60):
                while api.garbled["html-503"] < 3:
                    await api.changed.wait_touched()
                while not seen.is_set():
                    api.put_node("node-1", "uid-1", {"example.com/gopher": "1"})
                    with trio.move_on_after(1):
                        await seen.wait()
            watching.cancel_scope.cancel()
    finally:
        await client.aclose()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "Node node-1" in r.getMessage()]
    warned = [message for level, message in lines if level >= logging.WARNING]
    assert len(warned) == 1 and "503 Service Unavailable" in warned[0], lines
    assert [m for level, m in lines if level == logging.INFO] == [
        "DRA: watching Node node-1: the API server answers again"
    ]


# ---------------------------------------------------------------------------------------------------
# The programs a resource runs


async def test_a_daemon_that_describe_starts_ends_with_it(tmp_path):
    """A describe that daemonizes (fork, setsid, fork: the daemon in a session and process group of
    its own) outlived every run, as killing the program's process group does not reach it. Now it
    is killed with the program, found by the mark its environment inherited."""
    pid_file = tmp_path / "daemon.pid"
    daemon = tmp_path / "daemon"
    daemon.write_text(f"#!/bin/sh\necho $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\nexec sleep 300\n")
    script = tmp_path / "describe"
    lines = [f"setsid sh -c '{daemon} &' </dev/null >/dev/null 2>&1 &", f"while [ ! -e {pid_file} ]; do :; done"]
    script.write_text("#!/bin/sh\n" + "\n".join(lines) + "\necho '{\"g1\": {}}'\n")
    for program in (daemon, script):
        program.chmod(0o755)
    config = {"device_plugin_dir": str(tmp_path), "resources": [{"name": RESOURCE, "directory": str(tmp_path)}]}
    resource = dataclasses.replace(
        gp.parse_config(yaml.safe_dump(config), "t.yaml").resources[0], describe=(str(script),)
    )
    with trio.fail_after(gp.DESCRIBE_TIMEOUT / 2):
        described, _ = await gp.run_describe(resource, ["g1"])
    assert described == {"g1": gp.ReadValues({}, {})}
    daemon_pid = int(pid_file.read_text())
    try:  # SIGKILL was sent; its death follows: a pidfd turns readable when the process has ended
        pidfd = os.pidfd_open(daemon_pid)
    except ProcessLookupError:
        return  # ended and reaped already
    try:
        with trio.fail_after(SLOW):  # a daemon left alive would keep it unreadable
            await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


@pytest.mark.parametrize(
    ("shape", "verb", "resource"),
    [
        ("item-without-metadata", "list", "resourceslices"),
        ("slice-without-spec", "update", "resourceslices"),
        ("node-status-not-a-mapping", "list", "nodes"),
        ("node-allocatable-a-list", "list", "nodes"),
    ],
)
async def test_a_200_of_the_wrong_shape_is_retried_and_the_driver_serves_on(dra_node, shape, verb, resource):
    """Watch events were checked, list items and write answers were not: a listed slice without
    metadata, a slice written and answered without spec, a Node whose status or allocatable is no
    mapping ended the DRA driver with a KeyError or an AttributeError. Now each is the API server's
    failure, said and retried, and the driver converges once the answers are right again."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(60):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.garble(shape, verb=verb, resource=resource)
        if verb == "list":  # a list comes after a watch's 410
            dra_node.api.expire_watches()
        else:
            (dra_node.devices / "gopher1").touch()
        while not dra_node.api.garbled[shape]:
            await dra_node.api.changed.wait_touched()
        (dra_node.devices / "gopher2").touch()
        names = ["gopher0", "gopher2"] if verb == "list" else ["gopher0", "gopher1", "gopher2"]
        await dra_node.wait_for_slices(names)


@pytest.mark.slow
async def test_100_listandwatch_peers_that_never_read_stay_within_the_memory_limit(serving):
    """100 peers, each with one ListAndWatch stream on a connection whose windows it opened to
    2^31-1, that read nothing: purerpc copied each stream's list into a buffer of its own and framed
    it all at once, and each connection queued up to 1 MiB, 228 MiB in all, past the shipped
    limits.memory of 128Mi. Now the streams share the one encoded list, and each connection queues
    SEND_QUEUE_LIMIT (128 KiB) and a frame. Bound: that and as much in the writer's hand per peer,
    and 16 MiB for their connections' state and the allocator's slack, generously rounded; and what
    they held is given back when they leave, in part at least (bench/bench_peers.py measures it)."""
    peers = 100
    served = await serving([f"accelerator-card-{i:05d}-of-a-rack" for i in range(10_000)])
    await settled(served)
    before = served.reset_peak()
    opened = []
    for _ in range(peers):
        peer = await test_hostile.Peer.open(
            served.socket_path, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1}
        )
        peer.h2.increment_flow_control_window(2**31 - 1 - 65535)
        peer.h2.send_headers(1, test_hostile.headers_for("ListAndWatch"))
        peer.h2.send_data(1, test_hostile.grpc_message(b""), end_stream=True)
        await peer.flush()  # and from now on, nothing is read
        opened.append(peer)
    await served.well_behaved("added")  # every stream has a new list to send, and the kubelet gets it
    await settled(served)
    growth, during = served.peak_growth(before), served.status()["VmRSS"] * 1024
    assert growth <= 48 * MiB, growth / MiB  # 100 x (128 KiB queued + 128 KiB in hand) + 16 MiB
    assert served.status()["VmHWM"] * 1024 <= 128 * MiB  # the DaemonSet's limits.memory
    for peer in opened:
        await peer.aclose()
    await settled(served)
    assert served.status()["VmRSS"] * 1024 <= during - growth // 4, (during - served.status()["VmRSS"] * 1024) / MiB
    await served.well_behaved()
