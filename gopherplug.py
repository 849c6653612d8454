"""gopherplug: a Kubernetes device plugin in one module, and a lesson in the protocol.

The kubelet learns about hardware from device plugins. A plugin serves the DevicePlugin gRPC API
(v1beta1) on a unix socket in the kubelet's device-plugin directory, registers through the kubelet's
own socket there, streams its device list, and tells the kubelet what a container needs for the
devices it was given. This file does all of that with trio, purerpc, protobuf and inotify.

Read it top to bottom; every section only uses the ones above it:

  1. The kubelet contract      constants, the v1beta1 messages built in code, the service table
  2. Errors                    one base class; what a caller of this module can catch
  3. purerpc on unix sockets   the fenced glue that makes purerpc serve and call like grpc-go
  4. Command line              main(argv) -> exit code

Quick start:

    pip install .
    gopherplug --version
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import sys
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import h2.events
import purerpc
import trio
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from purerpc.grpc_proto import GRPCProtoSocket, GRPCProtoStream
from purerpc.grpc_socket import SocketWrapper
from purerpc.grpclib.config import GRPCConfiguration
from purerpc.grpclib.connection import GRPCConnection
from purerpc.grpclib.events import RequestEnded, RequestReceived, WindowUpdated
from purerpc.grpclib.exceptions import RpcFailedError
from purerpc.grpclib.status import Status, StatusCode
from purerpc.wrappers import extract_message_from_singleton_stream

__version__ = "0.1.0"

__all__ = [
    "API_VERSION",
    "DEFAULT_DEVICE_PLUGIN_DIR",
    "FILE_DESCRIPTOR",
    "HEALTHY",
    "KUBELET_SOCKET",
    "METHODS",
    "UNHEALTHY",
    "GRPCServer",
    "GopherplugError",
    "Method",
    "RPCError",
    "StatusCode",
    "call_unary",
    "main",
    "serve_grpc",
    "v1beta1",
]

log = logging.getLogger("gopherplug")


########################################################################################################
# 1. The kubelet contract
#
# Rules for this section: data only. Everything here is fixed by the kubelet (package
# k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 and pkg/kubelet/cm/devicemanager); nothing is ours.
########################################################################################################

#: The only API version the kubelet accepts in RegisterRequest.version.
API_VERSION = "v1beta1"

#: Where the kubelet looks for plugin sockets unless it was started with another root directory
#: (k3s and RKE2 use it too; microk8s and k0s do not, see the README).
DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"

#: The kubelet's Registration socket, inside the device-plugin directory.
KUBELET_SOCKET = "kubelet.sock"

#: Device.health values. The kubelet counts "Healthy" as allocatable and anything else as not.
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

# The messages of v1beta1, as (message name, fields); a field is (name, number, type). A type is a
# scalar ("string", "bool", "int32", "int64"), another message of this package, "repeated T", or
# "map<string, string>". The order is gopherplug.proto's, so that the descriptor built from this
# table is byte-for-byte the one protoc makes from that file (the test suite checks it).
_MESSAGES: dict[str, tuple[tuple[str, int, str], ...]] = {
    "Empty": (),
    "DevicePluginOptions": (
        ("pre_start_required", 1, "bool"),
        ("get_preferred_allocation_available", 2, "bool"),
    ),
    "RegisterRequest": (
        ("version", 1, "string"),
        ("endpoint", 2, "string"),
        ("resource_name", 3, "string"),
        ("options", 4, "DevicePluginOptions"),
    ),
    "ListAndWatchResponse": (("devices", 1, "repeated Device"),),
    "Device": (
        ("ID", 1, "string"),
        ("health", 2, "string"),
        ("topology", 3, "TopologyInfo"),
    ),
    "TopologyInfo": (("nodes", 1, "repeated NUMANode"),),
    "NUMANode": (("ID", 1, "int64"),),
    "PreferredAllocationRequest": (("container_requests", 1, "repeated ContainerPreferredAllocationRequest"),),
    "ContainerPreferredAllocationRequest": (
        ("available_deviceIDs", 1, "repeated string"),
        ("must_include_deviceIDs", 2, "repeated string"),
        ("allocation_size", 3, "int32"),
    ),
    "PreferredAllocationResponse": (("container_responses", 1, "repeated ContainerPreferredAllocationResponse"),),
    "ContainerPreferredAllocationResponse": (("deviceIDs", 1, "repeated string"),),
    "AllocateRequest": (("container_requests", 1, "repeated ContainerAllocateRequest"),),
    "ContainerAllocateRequest": (("devices_ids", 1, "repeated string"),),
    "AllocateResponse": (("container_responses", 1, "repeated ContainerAllocateResponse"),),
    "ContainerAllocateResponse": (
        ("envs", 1, "map<string, string>"),
        ("mounts", 2, "repeated Mount"),
        ("devices", 3, "repeated DeviceSpec"),
        ("annotations", 4, "map<string, string>"),
        ("cdi_devices", 5, "repeated CDIDevice"),
    ),
    "Mount": (
        ("container_path", 1, "string"),
        ("host_path", 2, "string"),
        ("read_only", 3, "bool"),
    ),
    "DeviceSpec": (
        ("container_path", 1, "string"),
        ("host_path", 2, "string"),
        ("permissions", 3, "string"),
    ),
    "CDIDevice": (("name", 1, "string"),),
    "PreStartContainerRequest": (("devices_ids", 1, "repeated string"),),
    "PreStartContainerResponse": (),
}

# The services, as (service name, methods); a method is (name, request, response, server streams?).
# Registration is served by the kubelet on kubelet.sock; DevicePlugin by each plugin on its own socket.
_SERVICES: dict[str, tuple[tuple[str, str, str, bool], ...]] = {
    "Registration": (("Register", "RegisterRequest", "Empty", False),),
    "DevicePlugin": (
        ("GetDevicePluginOptions", "Empty", "DevicePluginOptions", False),
        ("ListAndWatch", "Empty", "ListAndWatchResponse", True),
        ("GetPreferredAllocation", "PreferredAllocationRequest", "PreferredAllocationResponse", False),
        ("Allocate", "AllocateRequest", "AllocateResponse", False),
        ("PreStartContainer", "PreStartContainerRequest", "PreStartContainerResponse", False),
    ),
}

_SCALARS = {
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
}


def _json_name(field_name: str) -> str:
    """protoc's JSON name: underscores dropped, the letter after each one upper-cased."""
    head, *rest = field_name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _add_field(message: Any, name: str, number: int, type_: str) -> None:
    """Append one field, described as in _MESSAGES, to a DescriptorProto."""
    fdp = descriptor_pb2.FieldDescriptorProto
    field = message.field.add(name=name, number=number, json_name=_json_name(name))
    field.label = fdp.LABEL_OPTIONAL
    if type_.startswith("map<"):
        # A map is a repeated nested "<Name>Entry" message with key = 1, value = 2 and the
        # map_entry option: that is what protoc generates, and what the wire carries.
        key_type, value_type = (part.strip() for part in type_[4:-1].split(","))
        entry = message.nested_type.add(name=_json_name(name)[:1].upper() + _json_name(name)[1:] + "Entry")
        _add_field(entry, "key", 1, key_type)
        _add_field(entry, "value", 2, value_type)
        entry.options.map_entry = True
        field.label = fdp.LABEL_REPEATED
        field.type = fdp.TYPE_MESSAGE
        field.type_name = f".{API_VERSION}.{message.name}.{entry.name}"
        return
    if type_.startswith("repeated "):
        field.label = fdp.LABEL_REPEATED
        type_ = type_.removeprefix("repeated ")
    if type_ in _SCALARS:
        field.type = _SCALARS[type_]
    else:
        field.type = fdp.TYPE_MESSAGE
        field.type_name = f".{API_VERSION}.{type_}"


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """Build gopherplug.proto's descriptor from the tables above, as protoc would."""
    file = descriptor_pb2.FileDescriptorProto(name="gopherplug.proto", package=API_VERSION, syntax="proto3")
    for message_name, fields in _MESSAGES.items():
        message = file.message_type.add(name=message_name)
        for field_name, number, type_ in fields:
            _add_field(message, field_name, number, type_)
    for service_name, methods in _SERVICES.items():
        service = file.service.add(name=service_name)
        for method_name, request, response, server_streaming in methods:
            method = service.method.add(
                name=method_name,
                input_type=f".{API_VERSION}.{request}",
                output_type=f".{API_VERSION}.{response}",
            )
            method.options.SetInParent()  # protoc writes an empty MethodOptions for an `{}` body
            if server_streaming:
                method.server_streaming = True
    return file


#: The v1beta1 API as a protobuf FileDescriptorProto, equal to protoc's output for gopherplug.proto.
FILE_DESCRIPTOR = _file_descriptor()

# A private pool: an embedding program may load the kubelet's own generated api_pb2 (same names, same
# package) into the default pool, and two files defining "v1beta1.Device" there would collide.
_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(FILE_DESCRIPTOR)


def _message_class(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{API_VERSION}.{name}"))


class v1beta1:  # noqa: N801 - named after the protobuf package, as the kubelet's Go code imports it
    """The messages of the device plugin API, e.g. ``v1beta1.AllocateResponse(container_responses=[...])``."""

    Empty = _message_class("Empty")
    DevicePluginOptions = _message_class("DevicePluginOptions")
    RegisterRequest = _message_class("RegisterRequest")
    ListAndWatchResponse = _message_class("ListAndWatchResponse")
    Device = _message_class("Device")
    TopologyInfo = _message_class("TopologyInfo")
    NUMANode = _message_class("NUMANode")
    PreferredAllocationRequest = _message_class("PreferredAllocationRequest")
    ContainerPreferredAllocationRequest = _message_class("ContainerPreferredAllocationRequest")
    PreferredAllocationResponse = _message_class("PreferredAllocationResponse")
    ContainerPreferredAllocationResponse = _message_class("ContainerPreferredAllocationResponse")
    AllocateRequest = _message_class("AllocateRequest")
    ContainerAllocateRequest = _message_class("ContainerAllocateRequest")
    AllocateResponse = _message_class("AllocateResponse")
    ContainerAllocateResponse = _message_class("ContainerAllocateResponse")
    Mount = _message_class("Mount")
    DeviceSpec = _message_class("DeviceSpec")
    CDIDevice = _message_class("CDIDevice")
    PreStartContainerRequest = _message_class("PreStartContainerRequest")
    PreStartContainerResponse = _message_class("PreStartContainerResponse")


@dataclass(frozen=True)
class Method:
    """One RPC of the contract: where it lives on the wire and what it carries."""

    service: str  #: full service name, e.g. "v1beta1.DevicePlugin"
    name: str  #: method name, e.g. "ListAndWatch"
    request_type: Any  #: message class of the request
    response_type: Any  #: message class of the response (of each message, for a stream)
    server_streaming: bool  #: True for ListAndWatch: one request, a stream of responses

    @property
    def path(self) -> str:
        """The HTTP/2 :path the call is made on, e.g. "/v1beta1.DevicePlugin/ListAndWatch"."""
        return f"/{self.service}/{self.name}"

    @property
    def signature(self) -> purerpc.RPCSignature:
        """purerpc's description of the call's shape."""
        cardinality = purerpc.Cardinality.UNARY_STREAM if self.server_streaming else purerpc.Cardinality.UNARY_UNARY
        return purerpc.RPCSignature(cardinality, self.request_type, self.response_type)


#: Every RPC of v1beta1 by its path, e.g. METHODS["/v1beta1.Registration/Register"].
METHODS: dict[str, Method] = {
    method.path: method
    for service_name, methods in _SERVICES.items()
    for method in (
        Method(f"{API_VERSION}.{service_name}", name, _message_class(request), _message_class(response), streaming)
        for name, request, response, streaming in methods
    )
}


########################################################################################################
# 2. Errors
#
# Rules for this section: one base class, so an embedding program can catch everything gopherplug
# raises on purpose with one `except`. Each message is one line a person can act on.
########################################################################################################


class GopherplugError(Exception):
    """Base class of every error gopherplug raises on purpose."""


class RPCError(GopherplugError):
    """A gRPC call failed, or a handler refuses one: a status code and a one-line message.

    Raised by the client side (``call_unary``) for any failure, with the code grpc-go would report
    (UNAVAILABLE when the socket cannot be reached, DEADLINE_EXCEEDED when no answer came in time).
    Raised by a handler, it becomes the call's status on the wire instead of a generic error.
    """

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


########################################################################################################
# 3. purerpc on unix sockets
#
# purerpc speaks gRPC over h2 on anyio streams, but its Server and channels are TCP-only, and its
# connection handler does not fit a long-lived ListAndWatch (see DESIGN notes below). This fence
# keeps purerpc's message framing, HTTP/2 state machine and stream objects, and replaces the socket
# plumbing and the per-connection dispatch. It relies on these purerpc 0.8.0 internals, pinned in
# pyproject.toml:
#
#   - purerpc.grpc_socket.SocketWrapper: the writer task; its static _set_socket_options(stream)
#   - purerpc.grpc_socket.GRPCSocket attributes _grpc_connection, _socket, _receive_buffer_size,
#     _streams, _allocate_stream(stream_id)
#   - purerpc.grpc_socket.GRPCStream: _incoming_events (an anyio memory stream pair), _close_remote(),
#     _flow_control_update_event (an anyio Event its sender waits on)
#   - purerpc.grpclib.connection.GRPCConnection: receive_data(), message_read_buffers, and the
#     _stream_reset(event) hook that turns h2's StreamReset into gRPC events (stock: none)
#
# Rules for this section: no knowledge of device plugins; everything runs under trio (anyio's trio
# backend underneath purerpc); trio.Cancelled always propagates.
########################################################################################################

# One read from the socket. HTTP/2 frames are reassembled by h2, so this only bounds memory per read.
_RECEIVE_BUFFER_SIZE = 64 * 1024

# Errors that mean "the peer went away". A kubelet that restarts, a probe that exits, a client that
# drops a stream: all normal goodbyes, logged at debug level, never as errors.
_GOODBYE = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, ConnectionError)


class _UnixSocketWrapper(SocketWrapper):
    """purerpc's socket wrapper without its TCP options.

    purerpc sets TCP_KEEPIDLE and TCP_NODELAY on every socket. On AF_UNIX they fail with EOPNOTSUPP,
    and purerpc's stock handler swallows the error: the client just times out. A unix socket needs
    none of them (no Nagle, no keepalive: the kernel knows when the peer is gone).
    """

    @staticmethod
    def _set_socket_options(stream: Any) -> None:
        pass


class _ResetAwareConnection(GRPCConnection):
    """purerpc's gRPC-over-h2 state machine, reporting RST_STREAM instead of dropping it.

    A client cancels one call (grpc-go's context cancellation, grpcio's call.cancel()) by sending
    RST_STREAM on that stream only; the connection stays open. Stock purerpc ignores it, so a
    ListAndWatch handler would live on until its next push tried to write, forever if none came.
    """

    def _stream_reset(self, event: h2.events.StreamReset) -> list[Any]:
        return [event]


class _GRPCSocket(GRPCProtoSocket):
    """A purerpc connection on any anyio byte stream (here: a unix socket), client or server side."""

    def __init__(self, stream: anyio.abc.ByteStream, connection: GRPCConnection) -> None:
        # GRPCSocket.__init__ would wrap the stream in the stock SocketWrapper, whose constructor
        # applies the TCP options, so the attributes it sets are set here instead.
        AsyncExitStack.__init__(self)
        self._grpc_connection = connection
        self._socket = _UnixSocketWrapper(connection, stream)
        self._receive_buffer_size = _RECEIVE_BUFFER_SIZE
        self._streams: dict[int, GRPCProtoStream] = {}


def _close_event_queues(stream: GRPCProtoStream) -> None:
    """Close the memory streams purerpc opens per call and never closes (else: ResourceWarning)."""
    for end in stream._incoming_events:
        end.close()


class _ServerConnection(_GRPCSocket):
    """One accepted connection: reads frames, runs each call in its own task and cancel scope.

    Resource handling: every call gets a trio.CancelScope kept in ``calls`` until its task ends.
    RST_STREAM cancels that one scope; end of file (the peer closed the connection) cancels them all.
    Reset streams are removed from purerpc's stream table, which only forgets streams that ended
    normally in both directions.

    Error handling: a handler's RPCError becomes the call's status; any other exception is logged
    with its traceback and answered UNKNOWN. Malformed HTTP/2 or gRPC from the peer raises out of
    serve(), and the caller drops the connection.
    """

    def __init__(self, stream: anyio.abc.ByteStream, services: Mapping[str, purerpc.Service]) -> None:
        super().__init__(stream, _ResetAwareConnection(GRPCConfiguration(client_side=False)))
        self._services = services
        #: Calls in progress on this connection, by HTTP/2 stream id.
        self.calls: dict[int, trio.CancelScope] = {}

    @property
    def open_streams(self) -> int:
        """Streams purerpc still tracks on this connection (0 once every call is over)."""
        return len(self._streams) + len(self._grpc_connection.message_read_buffers)

    async def serve(self) -> None:
        """Answer calls until the peer closes the connection, then cancel whatever is still running."""
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    data = await self._socket.recv(self._receive_buffer_size)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
                events = self._grpc_connection.receive_data(data)  # raises on malformed input
                await self._socket.flush()  # h2 may owe the peer a SETTINGS ack, a PING reply...
                reset = self._dispatch(events, nursery)
                # Only now, with the whole batch dispatched, forget the reset streams: an event of
                # the same batch may still have named them.
                for stream_id in reset:
                    self._streams.pop(stream_id, None)
                    self._grpc_connection.message_read_buffers.pop(stream_id, None)
            # The peer is gone, and with it every answer we could send: end every call now.
            nursery.cancel_scope.cancel()

    def _dispatch(self, events: Iterable[Any], nursery: trio.Nursery) -> list[int]:
        """Hand one batch of events to their calls, starting new ones; return the reset stream ids.

        Synchronous on purpose: the batch is applied as a whole, no other task runs in between.
        """
        reset = []
        for event in events:
            if isinstance(event, WindowUpdated):
                # The peer let us send more: wake the senders waiting on flow control.
                waiting = self._streams.values() if event.stream_id == 0 else [self._streams.get(event.stream_id)]
                for stream in waiting:
                    if stream is not None:
                        stream._flow_control_update_event.set()
            elif isinstance(event, h2.events.StreamReset):
                scope = self.calls.get(event.stream_id)
                if scope is not None:
                    scope.cancel()
                reset.append(event.stream_id)
            elif isinstance(event, RequestReceived):
                stream = self._allocate_stream(event.stream_id)
                stream._incoming_events[0].send_nowait(event)
                scope = self.calls[event.stream_id] = trio.CancelScope()
                nursery.start_soon(self._run_call, stream, scope)
            elif (stream := self._streams.get(event.stream_id)) is not None:
                # A message or the end of the request. (None: a late frame for a call already over.)
                stream._incoming_events[0].send_nowait(event)
                if isinstance(event, RequestEnded):
                    stream._close_remote()
        return reset

    async def _run_call(self, stream: GRPCProtoStream, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await _answer_call(self._services, stream)
        finally:
            del self.calls[stream.stream_id]
            _close_event_queues(stream)


async def _answer_call(services: Mapping[str, purerpc.Service], stream: GRPCProtoStream) -> None:
    """Run one call: find its handler, feed it the request, send what it returns, close with a status."""
    request: RequestReceived = await stream.receive_event()
    service = services.get(request.service_name)
    bound = service.methods.get(request.method_name) if service is not None else None
    if bound is None or bound.signature.cardinality not in (
        purerpc.Cardinality.UNARY_UNARY,
        purerpc.Cardinality.UNARY_STREAM,
    ):
        await stream.close(
            Status(StatusCode.UNIMPLEMENTED, f"unknown method /{request.service_name}/{request.method_name}")
        )
        return
    try:
        stream.expect_message_type(bound.signature.request_type)
        message = await extract_message_from_singleton_stream(stream)
        if bound.signature.cardinality == purerpc.Cardinality.UNARY_UNARY:
            response = await bound.method_fn(message, request=request)
            await stream.start_response()
            await stream.send_message(response)
        else:
            await stream.start_response()
            responses = bound.method_fn(message, request=request)
            try:
                async for response in responses:
                    await stream.send_message(response)
            finally:
                # Runs the handler's own `finally` now, even when we were cancelled mid-stream.
                with trio.CancelScope(shield=True):
                    await responses.aclose()
        status = Status(StatusCode.OK)
    except RPCError as error:
        status = Status(error.code, error.message)
    except RpcFailedError as error:  # purerpc's own, e.g. a request that is not one message
        status = error.status
    except Exception as error:
        log.exception("%s/%s failed", request.service_name, request.method_name)
        status = Status(StatusCode.UNKNOWN, f"{type(error).__name__}: {error}")
    try:
        await stream.close(status)
    except Exception as error:  # the peer reset the stream while we were finishing
        log.debug("could not close stream %d: %r", stream.stream_id, error)


@dataclass
class GRPCServer:
    """What ``serve_grpc`` reports once it listens: its socket and what is live on it."""

    socket_path: str  #: the unix socket the server listens on
    inode: int  #: the socket file's inode: tells our own file from one created later at that path
    connections: set[_ServerConnection]  #: connections open right now

    @property
    def live_calls(self) -> int:
        """Calls being answered right now, over all connections."""
        return sum(len(connection.calls) for connection in self.connections)

    @property
    def open_streams(self) -> int:
        """Stream entries purerpc still holds, over all connections (0 when all calls are over)."""
        return sum(connection.open_streams for connection in self.connections)


async def serve_grpc(
    socket_path: str,
    services: Iterable[purerpc.Service],
    *,
    task_status: trio.TaskStatus[GRPCServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve purerpc services on a unix socket until cancelled.

    Creates the socket (replacing a stale socket file at that path) with mode 0600, calls
    ``task_status.started(GRPCServer)`` once it is listening, and never returns.

    Resource handling: each connection runs in its own task and is closed when the peer leaves or
    when this function is cancelled; the socket file is removed on the way out, unless someone
    else already replaced it (checked by inode).

    Error handling: a connection that breaks the protocol is dropped with a debug log line; the
    server goes on serving the others. Errors creating the socket propagate to the caller.
    """
    by_name = {service.name: service for service in services}
    listener = await anyio.create_unix_listener(socket_path, mode=0o600)
    server = GRPCServer(socket_path, os.stat(socket_path).st_ino, set())
    try:
        async with listener, trio.open_nursery() as nursery:
            task_status.started(server)
            while True:
                stream = await listener.accept()
                nursery.start_soon(_serve_connection, stream, by_name, server.connections)
    finally:
        _remove_socket_file(server)


def _remove_socket_file(server: GRPCServer) -> None:
    try:
        if os.stat(server.socket_path).st_ino == server.inode:
            os.unlink(server.socket_path)
    except FileNotFoundError:
        pass  # already gone: a restarting kubelet removes every socket in its directory


async def _serve_connection(
    stream: anyio.abc.ByteStream,
    services: Mapping[str, purerpc.Service],
    connections: set[_ServerConnection],
) -> None:
    connection = _ServerConnection(stream, services)
    connections.add(connection)
    try:
        try:
            async with stream, connection:
                await connection.serve()
        except* _GOODBYE:
            log.debug("peer left mid-write")
    except Exception as error:
        log.debug("dropped a connection: %s", _describe(error))
    finally:
        connections.discard(connection)


def _innermost(error: BaseException) -> BaseException:
    """The error inside the one-member exception groups that anyio and trio wrap around it."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _describe(error: BaseException) -> str:
    """One line for an error, for a log line or an RPCError message."""
    error = _innermost(error)
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@asynccontextmanager
async def _client_connection(socket_path: str) -> AsyncIterator[_GRPCSocket]:
    """Connect to a unix socket and speak HTTP/2 on it; close the socket on the way out."""
    stream = await anyio.connect_unix(socket_path)
    async with stream, _GRPCSocket(stream, GRPCConnection(GRPCConfiguration(client_side=True))) as grpc_socket:
        yield grpc_socket


async def call_unary(socket_path: str, method: Method, request: Any, *, timeout: float) -> Any:
    """Make one unary call on a unix socket, the way grpc-go (the kubelet) does, and return the answer.

    Sends ``:authority: localhost`` (what the kubelet sends; purerpc's channel would send
    "host:port"), a grpc-timeout header, and gives up after ``timeout`` seconds, because a server
    that accepts a connection but never answers would otherwise hang the caller forever. A fresh
    connection per call, closed afterwards: the calls this is for (Register, probes) are rare.

    Raises RPCError: the server's status if it answered with one, UNAVAILABLE if the socket could
    not be reached or the connection broke, DEADLINE_EXCEEDED if no answer came in time.
    """
    service, _, name = method.path[1:].partition("/")
    try:
        with trio.fail_after(timeout):
            async with _client_connection(socket_path) as grpc_socket:
                stream = await grpc_socket.start_request(
                    "http",
                    service,
                    name,
                    method.request_type.DESCRIPTOR.full_name,
                    authority="localhost",
                    # Whole seconds: grpc-go rejects a timeout of more than 8 digits, which
                    # purerpc's microsecond unit reaches at 100 s.
                    timeout=datetime.timedelta(seconds=math.ceil(timeout)),
                )
                try:
                    stream.expect_message_type(method.response_type)
                    await stream.send_message(request)
                    await stream.close()
                    return await extract_message_from_singleton_stream(stream)
                finally:
                    _close_event_queues(stream)
    except trio.TooSlowError:
        raise RPCError(
            StatusCode.DEADLINE_EXCEEDED, f"{method.path} on {socket_path}: no answer within {timeout:g} s"
        ) from None
    except Exception as group:
        error = _innermost(group)
        if isinstance(error, RpcFailedError):
            raise RPCError(error.status.status_code, error.status.status_message) from None
        raise RPCError(StatusCode.UNAVAILABLE, f"{method.path} on {socket_path}: {_describe(error)}") from error


########################################################################################################
# 4. Command line
#
# Rules for this section: parse, validate, run, return an exit code: 0 on a requested shutdown,
# 2 on bad usage or configuration, 1 on a runtime failure.
########################################################################################################


def main(argv: list[str] | None = None) -> int:
    """The ``gopherplug`` command. Returns the process exit code."""
    parser = argparse.ArgumentParser(
        prog="gopherplug",
        description="A Kubernetes device plugin: files in a directory become schedulable devices.",
    )
    parser.add_argument("--version", action="version", version=f"gopherplug {__version__}")
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    # Run as a script, this file is both __main__ and (for anything importing it) gopherplug:
    # register it under its own name so that there is one module object, not two.
    sys.modules.setdefault("gopherplug", sys.modules[__name__])
    sys.exit(main())
