"""Tests for gopherplug.

Rules:
- Real things only: real unix sockets in a short temporary directory (a socket path is limited to
  108 bytes, more than pytest's tmp_path sometimes leaves), real subprocesses, and on the other end
  of the wire an independent gRPC implementation, grpcio (C core), with message classes that protoc
  generates from gopherplug.proto for the test session.
- Every test that does I/O runs under a trio.fail_after bound, so a hang is a failure, not a stall.
- Nothing sleeps to synchronise: tests wait on events a handler sets, or on the peer's answer.
- grpcio calls block, and the server under test runs on the trio thread: they run in a worker
  thread (trio.to_thread.run_sync), never on the trio thread itself.
- Warnings are errors (pyproject.toml), except purerpc's documented unclosed-memory-stream one.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import trio
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

import gopherplug as gp
from gopherplug import StatusCode, v1beta1

HERE = Path(__file__).resolve().parent
TIMEOUT = 10  # generous bound for any single test's I/O on a loaded 2-core CI machine


# ------------------------------------------------------------------------------------------------
# Fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def sockdir():
    """A short directory for unix sockets, removed afterwards."""
    path = tempfile.mkdtemp(prefix="gp-", dir="/tmp" if os.path.isdir("/tmp") else None)
    assert len(path) < 60, path
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def protoc_out(tmp_path_factory):
    """gopherplug.proto compiled by protoc: the descriptor set and the generated message module."""
    out = tmp_path_factory.mktemp("protoc")
    args = ["protoc", f"-I{HERE}", f"--python_out={out}", f"--descriptor_set_out={out / 'set.bin'}", "gopherplug.proto"]
    assert protoc.main(args) == 0, "protoc failed on gopherplug.proto"
    spec = importlib.util.spec_from_file_location("protoc_gopherplug_pb2", out / "gopherplug_pb2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return out, module


@pytest.fixture(scope="session")
def pb2(protoc_out):
    """protoc's generated classes for gopherplug.proto: what the grpcio side of every test uses."""
    return protoc_out[1]


class Recorder:
    """What the test DevicePlugin service saw: stream lifecycles and pushes, as trio channels."""

    def __init__(self):
        self.push_send, self.push_receive = trio.open_memory_channel(100)
        self.finished_send, self.finished_receive = trio.open_memory_channel(1000)
        self.started = 0
        self.authorities = []


def device_plugin_service(recorder: Recorder):
    """A small DevicePlugin service for the transport tests: echo, errors, a push-driven stream."""

    async def get_options(empty):
        return v1beta1.DevicePluginOptions(get_preferred_allocation_available=True)

    async def allocate(req, request):
        recorder.authorities.append(request.authority)
        ids = [i for c in req.container_requests for i in c.devices_ids]
        if "bad" in ids:
            raise gp.RPCError(StatusCode.INVALID_ARGUMENT, "unknown device IDs: bad")
        if "crash" in ids:
            raise ZeroDivisionError("handler bug")
        return v1beta1.AllocateResponse(
            container_responses=[v1beta1.ContainerAllocateResponse(envs={"IDS": ",".join(ids)})]
        )

    async def list_and_watch(empty):
        recorder.started += 1
        try:
            yield v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID="first", health=gp.HEALTHY)])
            async for device_id in recorder.push_receive:
                yield v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID=device_id, health=gp.HEALTHY)])
        finally:
            recorder.finished_send.send_nowait("finished")

    import purerpc

    service = purerpc.Service("v1beta1.DevicePlugin")
    for name, fn in [
        ("GetDevicePluginOptions", get_options),
        ("Allocate", allocate),
        ("ListAndWatch", list_and_watch),
    ]:
        service.add_method(name, fn, gp.METHODS[f"/v1beta1.DevicePlugin/{name}"].signature)
    return service


@pytest.fixture
async def served(nursery, sockdir):
    """The test DevicePlugin service on a unix socket: (GRPCServer, Recorder)."""
    recorder = Recorder()
    server = await nursery.start(gp.serve_grpc, os.path.join(sockdir, "plugin.sock"), [device_plugin_service(recorder)])
    return server, recorder


class GrpcioClient:
    """grpcio stubs for the DevicePlugin service, built without generated service code."""

    def __init__(self, pb2, socket_path):
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        base = "/v1beta1.DevicePlugin/"
        self.get_options = self.channel.unary_unary(
            base + "GetDevicePluginOptions",
            request_serializer=pb2.Empty.SerializeToString,
            response_deserializer=pb2.DevicePluginOptions.FromString,
        )
        self.allocate = self.channel.unary_unary(
            base + "Allocate",
            request_serializer=pb2.AllocateRequest.SerializeToString,
            response_deserializer=pb2.AllocateResponse.FromString,
        )
        self.list_and_watch = self.channel.unary_stream(
            base + "ListAndWatch",
            request_serializer=pb2.Empty.SerializeToString,
            response_deserializer=pb2.ListAndWatchResponse.FromString,
        )

    def close(self):
        self.channel.close()


@pytest.fixture
def grpcio_client(pb2, served):
    client = GrpcioClient(pb2, served[0].socket_path)
    yield client
    client.close()


def in_thread(fn, *args, **kwargs):
    return trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def allocate_request(pb2, *ids):
    return pb2.AllocateRequest(container_requests=[pb2.ContainerAllocateRequest(devices_ids=list(ids))])


# ------------------------------------------------------------------------------------------------
# The contract: gopherplug.proto and the module's messages never drift apart
# ------------------------------------------------------------------------------------------------


def test_descriptor_is_byte_identical_to_protoc(protoc_out):
    out, _ = protoc_out
    descriptor_set = descriptor_pb2.FileDescriptorSet.FromString((out / "set.bin").read_bytes())
    assert len(descriptor_set.file) == 1
    assert gp.FILE_DESCRIPTOR.SerializeToString() == descriptor_set.file[0].SerializeToString()


def test_messages_encode_like_protoc_generated_ones(pb2):
    ours = v1beta1.AllocateResponse(
        container_responses=[
            v1beta1.ContainerAllocateResponse(
                envs={"GOPHER": "a,b"},
                mounts=[v1beta1.Mount(container_path="/m", host_path="/h", read_only=True)],
                devices=[v1beta1.DeviceSpec(container_path="/dev/a", host_path="/dev/a", permissions="rw")],
                annotations={"k": "v"},
                cdi_devices=[v1beta1.CDIDevice(name="example.com/gopher=a")],
            )
        ]
    )
    theirs = pb2.AllocateResponse.FromString(ours.SerializeToString())
    assert theirs.container_responses[0].cdi_devices[0].name == "example.com/gopher=a"
    assert theirs.SerializeToString(deterministic=True) == ours.SerializeToString(deterministic=True)


def test_service_table_matches_the_kubelet_api():
    shapes = {
        path: (m.request_type.DESCRIPTOR.name, m.response_type.DESCRIPTOR.name, m.server_streaming)
        for path, m in gp.METHODS.items()
    }
    assert shapes == {
        "/v1beta1.Registration/Register": ("RegisterRequest", "Empty", False),
        "/v1beta1.DevicePlugin/GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "/v1beta1.DevicePlugin/ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "/v1beta1.DevicePlugin/GetPreferredAllocation": (
            "PreferredAllocationRequest",
            "PreferredAllocationResponse",
            False,
        ),
        "/v1beta1.DevicePlugin/Allocate": ("AllocateRequest", "AllocateResponse", False),
        "/v1beta1.DevicePlugin/PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    }


# ------------------------------------------------------------------------------------------------
# Serving: grpcio (the kubelet's stand-in) calls gopherplug's purerpc server on a unix socket
# ------------------------------------------------------------------------------------------------


async def test_grpcio_unary_calls(pb2, served, grpcio_client):
    with trio.fail_after(TIMEOUT):
        options = await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)
        assert options.get_preferred_allocation_available and not options.pre_start_required
        response = await in_thread(grpcio_client.allocate, allocate_request(pb2, "a", "b"), timeout=TIMEOUT)
        assert dict(response.container_responses[0].envs) == {"IDS": "a,b"}


async def test_handler_rpc_error_becomes_the_status(pb2, served, grpcio_client):
    with trio.fail_after(TIMEOUT):
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(grpcio_client.allocate, allocate_request(pb2, "a", "bad"), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "unknown device IDs: bad"


async def test_handler_bug_is_unknown_and_server_goes_on(pb2, served, grpcio_client, caplog):
    with trio.fail_after(TIMEOUT):
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(grpcio_client.allocate, allocate_request(pb2, "crash"), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.UNKNOWN
        assert info.value.details() == "ZeroDivisionError: handler bug"
        assert "DevicePlugin/Allocate failed" in caplog.text
        await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)


@pytest.mark.parametrize("path", ["/v1beta1.DevicePlugin/NoSuchMethod", "/v1beta1.NoSuchService/Allocate"])
async def test_unknown_method_is_unimplemented(pb2, served, path):
    channel = grpc.insecure_channel(f"unix:{served[0].socket_path}")
    call = channel.unary_unary(
        path, request_serializer=pb2.Empty.SerializeToString, response_deserializer=pb2.Empty.FromString
    )
    try:
        with trio.fail_after(TIMEOUT):
            with pytest.raises(grpc.RpcError) as info:
                await in_thread(call, pb2.Empty(), timeout=TIMEOUT)
    finally:
        channel.close()
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert info.value.details() == f"unknown method {path}"


async def test_stream_receives_pushes_in_order(pb2, served, grpcio_client):
    _, recorder = served
    call = grpcio_client.list_and_watch(pb2.Empty())
    try:
        with trio.fail_after(TIMEOUT):
            first = await in_thread(next, call)
            assert [d.ID for d in first.devices] == ["first"]
            pushed = [f"dev{i}" for i in range(20)]
            for device_id in pushed:
                await recorder.push_send.send(device_id)
            received = [(await in_thread(next, call)).devices[0].ID for _ in pushed]
            assert received == pushed
    finally:
        call.cancel()


async def test_cancelled_stream_ends_handler_without_another_push(pb2, served, grpcio_client):
    _, recorder = served
    call = grpcio_client.list_and_watch(pb2.Empty())
    with trio.fail_after(TIMEOUT):
        await in_thread(next, call)
        call.cancel()  # RST_STREAM on this stream; the connection stays open
        assert await recorder.finished_receive.receive() == "finished"
    # Nothing was pushed: the stock purerpc handler would still be waiting for the next push.
    assert recorder.push_send.statistics().current_buffer_used == 0


async def test_closed_channel_ends_handler_without_another_push(pb2, served):
    server, recorder = served
    client = GrpcioClient(pb2, server.socket_path)
    call = client.list_and_watch(pb2.Empty())
    with trio.fail_after(TIMEOUT):
        await in_thread(next, call)
        client.close()
        assert await recorder.finished_receive.receive() == "finished"
    assert server.live_calls == 0


async def test_200_cancel_cycles_on_one_connection_leave_nothing_behind(pb2, served, grpcio_client):
    server, recorder = served
    with trio.fail_after(TIMEOUT * 3):
        for _ in range(200):
            call = grpcio_client.list_and_watch(pb2.Empty())
            await in_thread(next, call)
            call.cancel()
            assert await recorder.finished_receive.receive() == "finished"
        # One more call on the same connection: when it is answered, the server has read past
        # every reset above.
        await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)
    assert recorder.started == 200
    assert len(server.connections) == 1, "grpcio should have used one connection for everything"
    assert server.live_calls == 0
    assert server.open_streams == 0


async def test_random_bytes_drop_only_that_connection(pb2, served, grpcio_client):
    server, _ = served
    rng = random.Random(1)
    with trio.fail_after(TIMEOUT):
        await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)  # an established peer
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        headers_on_stream_0 = bytes([0, 0, 64, 1, 4, 0, 0, 0, 0]) + rng.randbytes(64)
        cases = [
            (rng.randbytes(4096), False),  # not even the HTTP/2 preface
            (preface + headers_on_stream_0, False),  # a valid preface, then a forbidden frame
            # A frame header claiming up to 16 MiB: the server waits for the rest, like any slow
            # peer, until the peer hangs up.
            (preface + rng.randbytes(4096), True),
        ]
        for garbage, hang_up in cases:
            sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await sock.connect(server.socket_path)
            await sock.send(garbage)
            if hang_up:
                sock.shutdown(socket.SHUT_WR)
            while await sock.recv(65536):  # the server may say SETTINGS or GOAWAY, then hangs up
                pass
            sock.close()
        await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)
        fresh = GrpcioClient(pb2, server.socket_path)
        try:
            await in_thread(fresh.get_options, pb2.Empty(), timeout=TIMEOUT)
        finally:
            fresh.close()


async def test_socket_is_private_and_removed_on_exit(sockdir):
    path = os.path.join(sockdir, "p.sock")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(gp.serve_grpc, path, [])
            assert stat.S_ISSOCK(os.stat(path).st_mode)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert server.inode == os.stat(path).st_ino
            nursery.cancel_scope.cancel()
    assert not os.path.exists(path)


async def test_exit_leaves_a_replaced_socket_file_alone(sockdir):
    path = os.path.join(sockdir, "p.sock")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(gp.serve_grpc, path, [])
            os.unlink(path)
            Path(path).write_text("someone else's file")
            nursery.cancel_scope.cancel()
    assert Path(path).read_text() == "someone else's file"


# ------------------------------------------------------------------------------------------------
# Calling: gopherplug's purerpc client (as Register will) against grpcio and against silence
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def grpcio_registration(pb2, sockdir):
    """A grpcio Registration server on kubelet.sock: records requests, answers per `reply`."""
    seen = []
    reply = {"status": None}

    def register(request, context):
        seen.append((request, context.time_remaining()))
        if reply["status"] is not None:
            context.abort(*reply["status"])
        return pb2.Empty()

    handler = grpc.method_handlers_generic_handler(
        "v1beta1.Registration",
        {
            "Register": grpc.unary_unary_rpc_method_handler(
                register,
                request_deserializer=pb2.RegisterRequest.FromString,
                response_serializer=pb2.Empty.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([handler])
    path = os.path.join(sockdir, gp.KUBELET_SOCKET)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    yield path, seen, reply
    server.stop(None).wait()


def register_request():
    return v1beta1.RegisterRequest(
        version=gp.API_VERSION,
        endpoint="gopherplug-example.sock",
        resource_name="example.com/gopher",
        options=v1beta1.DevicePluginOptions(get_preferred_allocation_available=True),
    )


async def test_call_unary_to_grpcio_server(grpcio_registration):
    path, seen, _ = grpcio_registration
    register = gp.METHODS["/v1beta1.Registration/Register"]
    with trio.fail_after(TIMEOUT):
        answer = await gp.call_unary(path, register, register_request(), timeout=5)
    assert answer == v1beta1.Empty()
    request, time_remaining = seen[0]
    assert (request.version, request.endpoint, request.resource_name) == (
        "v1beta1",
        "gopherplug-example.sock",
        "example.com/gopher",
    )
    assert request.options.get_preferred_allocation_available
    assert 0 < time_remaining <= 5, "the grpc-timeout header should carry the deadline"


async def test_call_unary_reports_the_servers_status(grpcio_registration):
    path, _, reply = grpcio_registration
    reply["status"] = (grpc.StatusCode.INVALID_ARGUMENT, "invalid resource name")
    with trio.fail_after(TIMEOUT):
        with pytest.raises(gp.RPCError) as info:
            await gp.call_unary(path, gp.METHODS["/v1beta1.Registration/Register"], register_request(), timeout=5)
    assert (info.value.code, info.value.message) == (StatusCode.INVALID_ARGUMENT, "invalid resource name")


async def test_call_unary_sends_authority_localhost(served):
    server, recorder = served
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=["x"])])
    with trio.fail_after(TIMEOUT):
        answer = await gp.call_unary(
            server.socket_path, gp.METHODS["/v1beta1.DevicePlugin/Allocate"], request, timeout=5
        )
    assert dict(answer.container_responses[0].envs) == {"IDS": "x"}
    assert recorder.authorities == ["localhost"]


async def test_call_unary_fails_at_its_deadline_on_a_silent_server(sockdir):
    path = os.path.join(sockdir, "silent.sock")
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(path)
    listener.listen()
    accepted = []

    async def accept_and_never_answer():
        conn, _ = await listener.accept()
        accepted.append(conn)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_and_never_answer)
            start = trio.current_time()
            with pytest.raises(gp.RPCError) as info:
                await gp.call_unary(path, gp.METHODS["/v1beta1.Registration/Register"], register_request(), timeout=0.5)
            elapsed = trio.current_time() - start
    assert info.value.code == StatusCode.DEADLINE_EXCEEDED
    assert "no answer within 0.5 s" in info.value.message
    assert 0.5 <= elapsed < TIMEOUT
    assert accepted, "the server did accept: the deadline, not a refusal, ended the call"
    for conn in accepted:
        conn.close()
    listener.close()


async def test_call_unary_to_a_missing_socket_is_unavailable(sockdir):
    with trio.fail_after(TIMEOUT):
        with pytest.raises(gp.RPCError) as info:
            await gp.call_unary(
                os.path.join(sockdir, "none.sock"),
                gp.METHODS["/v1beta1.Registration/Register"],
                register_request(),
                timeout=5,
            )
    assert info.value.code == StatusCode.UNAVAILABLE
    assert "FileNotFoundError" in info.value.message


# ------------------------------------------------------------------------------------------------
# The module as users run it
# ------------------------------------------------------------------------------------------------


def test_module_copied_alone_runs(tmp_path):
    shutil.copy(HERE / "gopherplug.py", tmp_path / "gopherplug.py")
    # Test-only packages are made unimportable: the copy must need only the runtime dependencies.
    script = (
        "import sys, runpy\n"
        "for name in ('grpc', 'grpc_tools', 'pytest', 'test_gopherplug'): sys.modules[name] = None\n"
        "sys.argv = ['gopherplug.py', '--version']\n"
        "runpy.run_path('gopherplug.py', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"gopherplug {gp.__version__}\n"


def test_main_version(capsys):
    with pytest.raises(SystemExit) as info:
        gp.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"gopherplug {gp.__version__}\n"
