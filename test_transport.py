"""gRPC on unix sockets: gopherplug serving, and calling, as grpc-go does."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import stat
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import trio
import trio.socket
import trio.testing

import gopherplug as gp
from gopherplug import StatusCode, v1beta1
from testsupport import (
    HERE,
    TIMEOUT,
    GrpcioClient,
    allocate_request,
    in_thread,
)


@pytest.fixture
def grpcio_client(pb2, served):
    client = GrpcioClient(pb2, served[0].socket_path)
    yield client
    client.close()


# ------------------------------------------------------------------------------------------------
# Serving: grpcio (the kubelet's stand-in) calls gopherplug's purerpc server on a unix socket
# ------------------------------------------------------------------------------------------------


async def test_grpcio_unary_calls(pb2, served, grpcio_client):
    with trio.fail_after(TIMEOUT):
        options = await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)
        assert options.get_preferred_allocation_available and not options.pre_start_required
        response = await in_thread(grpcio_client.allocate, allocate_request(pb2, "a", "b"), timeout=TIMEOUT)
        assert dict(response.container_responses[0].envs) == {"IDS": "a,b"}


#: An Allocate call's request headers, as grpc-go sends them, for the tests that speak h2 themselves.
ALLOCATE_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/v1beta1.DevicePlugin/Allocate"),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


async def test_a_unary_answer_larger_than_the_peers_window_arrives_whole(served):
    # A unary answer leaves in one send when it fits in what the peer lets us send. One larger
    # must go out in parts, each after the peer's WINDOW_UPDATE: held back to be sent at once, it
    # would never make the peer send one. The peer here: h2 as a client, opening 4 KiB per stream.
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    server, _ = served
    ids = [f"device-{i:05}" for i in range(2_000)]  # an answer of about 24 KB
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=ids)])
    body = request.SerializeToString()
    body = b"\0" + len(body).to_bytes(4, "big") + body  # gRPC's framing: not compressed, length
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4096})
    with trio.fail_after(TIMEOUT), trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        await sock.connect(server.socket_path)
        for stream_id in (1, 3):  # and the connection goes on after it
            client.send_headers(stream_id, ALLOCATE_HEADERS)
            for at in range(0, len(body), 16384):  # the frame size the server allows
                client.send_data(stream_id, body[at : at + 16384], end_stream=at + 16384 >= len(body))
            await _send_all(sock, client.data_to_send())
            answer, trailers, ended = b"", {}, False
            while not ended:
                data = await sock.recv(65536)
                assert data, "the server hung up"
                for event in client.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        answer += event.data
                        client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.TrailersReceived):
                        trailers = {_text(k): _text(v) for k, v in event.headers}
                    elif isinstance(event, h2.events.StreamEnded):
                        ended = True
                await _send_all(sock, client.data_to_send())
            assert trailers["grpc-status"] == "0"
            assert int.from_bytes(answer[1:5], "big") == len(answer) - 5
            response = v1beta1.AllocateResponse.FromString(answer[5:])
            assert response.container_responses[0].envs["IDS"] == ",".join(ids)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _send_all(sock, data: bytes) -> None:
    while data:
        data = data[await sock.send(data) :]


class TasksSpawned(trio.abc.Instrument):
    """Counts the trio tasks spawned while it is installed."""

    def __init__(self):
        self.count = 0

    def task_spawned(self, task):
        self.count += 1


async def test_immediate_methods_are_answered_without_a_task(pb2, served, grpcio_client):
    # The point of an immediate method: no task, cancel scope and purerpc stream per call. The
    # first call opens the connection (its tasks); the next ones must start none, or must start
    # one each when answered as purerpc answers (the same service, its methods async).
    server, recorder = served
    with trio.fail_after(TIMEOUT):
        await in_thread(grpcio_client.allocate, allocate_request(pb2, "a"), timeout=TIMEOUT)
        (connection,) = server.connections
        immediate = ("v1beta1.DevicePlugin", "Allocate") in connection._immediate
        spawned = TasksSpawned()
        trio.lowlevel.add_instrument(spawned)
        try:
            for ids in (["b"], ["c", "d"]):
                response = await in_thread(grpcio_client.allocate, allocate_request(pb2, *ids), timeout=TIMEOUT)
                assert dict(response.container_responses[0].envs) == {"IDS": ",".join(ids)}
            options = await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)
            assert options.get_preferred_allocation_available
        finally:
            trio.lowlevel.remove_instrument(spawned)
    assert spawned.count == (0 if immediate else 3)
    assert recorder.allocated == [["a"], ["b"], ["c", "d"]]


async def test_a_call_reset_with_its_request_is_not_answered(served):
    # grpc-go resets a call whose context ends (RST_STREAM on that stream only). When the reset
    # arrives in the same read as the end of the request, the call was over before it began: its
    # handler is not run (an Allocate would log an allocation nobody received), nothing is sent
    # on its stream, and the connection serves the next call.
    import h2.config
    import h2.connection
    import h2.errors
    import h2.events

    server, recorder = served
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()

    def call(stream_id, device_id):
        client.send_headers(stream_id, ALLOCATE_HEADERS)
        body = v1beta1.AllocateRequest(
            container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=[device_id])]
        ).SerializeToString()
        client.send_data(stream_id, b"\0" + len(body).to_bytes(4, "big") + body, end_stream=True)

    with trio.fail_after(TIMEOUT), trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        await sock.connect(server.socket_path)
        call(1, "cancelled")
        client.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
        await _send_all(sock, client.data_to_send())  # one write: the server reads it at once
        call(3, "next")
        await _send_all(sock, client.data_to_send())
        answered, ended = set(), False
        while not ended:
            data = await sock.recv(65536)
            assert data, "the server hung up"
            for event in client.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.DataReceived):
                    answered.add(event.stream_id)
                ended = ended or (isinstance(event, h2.events.StreamEnded) and event.stream_id == 3)
            await _send_all(sock, client.data_to_send())
    assert answered == {3}
    assert recorder.allocated == [["next"]]


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
        line = "v1beta1.DevicePlugin/Allocate: ZeroDivisionError: handler bug: held back; a bug in gopherplug"
        assert info.value.details().startswith(line)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == [info.value.details()]
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


@pytest.mark.parametrize(
    ("messages", "details"),
    [
        ([], "expected one request message, got none"),
        ([b"", b"", b""], "expected one request message, got more than one"),
        ([b"\xff"], "cannot parse the request: Error parsing message"),
    ],
)
async def test_malformed_request_is_internal_and_server_goes_on(pb2, served, grpcio_client, messages, details):
    # grpcio's client-streaming call on a unary method: any number of raw messages on one stream.
    call = grpcio_client.channel.stream_unary(
        "/v1beta1.DevicePlugin/Allocate",
        request_serializer=bytes,
        response_deserializer=pb2.AllocateResponse.FromString,
    )
    with trio.fail_after(TIMEOUT):
        with pytest.raises(grpc.RpcError) as info:
            await in_thread(call, iter(messages), timeout=TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert info.value.details().startswith(details)
        await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)


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


async def test_an_overlong_frame_is_refused_at_its_header(pb2, served, grpcio_client):
    """A frame announced longer than the 16 KiB we allow ends the connection as soon as its 9-byte
    header arrives: h2 itself (3.2 and 4.x) would buffer up to 16 MiB and wait for the rest."""
    server, _ = served
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # an empty SETTINGS frame: a well-greeted peer
    data_header = (2**20).to_bytes(3, "big") + bytes([0, 0, 0, 0, 0, 1])  # DATA, 1 MiB, stream 1
    with trio.fail_after(TIMEOUT):
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with sock:
            await sock.connect(server.socket_path)
            await sock.send(preface + settings + data_header)  # and nothing more, the socket left open
            while await sock.recv(65536):  # SETTINGS, maybe GOAWAY; then the server hangs up
                pass
        await in_thread(grpcio_client.get_options, pb2.Empty(), timeout=TIMEOUT)  # others go on


@pytest.mark.slow
def test_importing_gopherplug_leaves_h2_as_other_users_know_it():
    """Other HTTP/2 users in the process (httpx, grpclib) keep the h2 they imported: purerpc's own
    patches, applied at its import, only restate what h2 3.2 and 4.x do, and gopherplug only adds
    h2 3's event name PingAcknowledged where h2 4 lacks it. Run in a fresh interpreter."""
    code = """
import json, h2.config, h2.connection, h2.events, h2.stream

def observe():
    transitions = sorted((str(k), str(v[1])) for k, v in h2.stream._transitions.items())
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    connection.send_headers(1, [(":method", "GET"), (":path", "/"), (":scheme", "http"), (":authority", "x")])
    first = connection.data_to_send(10)
    return transitions, (first + connection.data_to_send()).hex(), connection.data_to_send().hex()

events = set(dir(h2.events))
before = observe()
import gopherplug
after = observe()
print(json.dumps([before == after, sorted(set(dir(h2.events)) - events), h2.__version__]))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=HERE)
    same, added, version = json.loads(result.stdout)
    assert same
    assert added == ([] if version.startswith("3.") else ["PingAcknowledged"])


async def test_socket_is_private_and_removed_on_exit(sockdir):
    path = os.path.join(sockdir, "p.sock")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(gp.serve_grpc, path, [])
            assert stat.S_ISSOCK(os.stat(path).st_mode)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            assert server.identity[1] == os.stat(path).st_ino
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


@pytest.mark.parametrize("served", ["task"], indirect=True)  # an immediate method sees only the message
async def test_call_unary_sends_authority_localhost(served):
    server, recorder = served
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=["x"])])
    with trio.fail_after(TIMEOUT):
        answer = await gp.call_unary(
            server.socket_path, gp.METHODS["/v1beta1.DevicePlugin/Allocate"], request, timeout=5
        )
    assert dict(answer.container_responses[0].envs) == {"IDS": "x"}
    assert recorder.authorities == ["localhost"]


@pytest.mark.slow
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
    assert info.value.message.endswith(": No such file or directory")  # the system's words, not Python's class


async def test_open_stream_to_a_server_that_hangs_up_on_our_writer_is_unavailable(sockdir):
    # The server greets (SETTINGS, which the client must acknowledge) and hangs up at once: the
    # client's writer then fails (EPIPE), beside the stream that lost its connection. The caller
    # gets one RPCError, as for any lost connection; the writer's error escaped instead, alone or
    # grouped, and took the simulated kubelet down with it (a stress test saw it, 1 run in 30).
    path = os.path.join(sockdir, "rude.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen()
    listener.setblocking(False)

    async def greet_and_hang_up():
        await trio.lowlevel.wait_readable(listener)
        connection, _ = listener.accept()
        connection.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an empty SETTINGS frame
        connection.close()  # in the same step: before the client can answer

    method = gp.METHODS["/v1beta1.DevicePlugin/ListAndWatch"]
    try:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(greet_and_hang_up)
                with pytest.raises(gp.RPCError) as info:
                    async with gp.open_stream(path, method, v1beta1.Empty(), timeout=TIMEOUT) as responses:
                        async for _ in responses:
                            pass
    finally:
        listener.close()
    assert info.value.code == StatusCode.UNAVAILABLE
    assert info.value.message.startswith(f"{method.path} on {path}: connection ")
